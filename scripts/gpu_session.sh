#!/usr/bin/env bash
# One GPU session, one command, at most 9 minutes on one GPU: bash scripts/gpu_session.sh OUTDIR [--timm-train PATH]
#   (a) the demo on the GPU: python train.py runtime.device=cuda, its run folder under OUTDIR/demo/
#   (b) the GPU check: bash scripts/gpu_check.sh OUTDIR/gpu_check.json
#   (c) whole runs, ours against timm's train.py in turn: DeiT-S/16 at 224 px, bf16, global batch 256, loader workers
#       = cores - 2, 2 epochs on 6,400 + 800 drawn 500x375 JPEGs (drawn once into the bench cache), 2 pairs
#       (scripts/bench.py --sections e2e_run); timm's train.py from --timm-train or $TIMM_TRAIN, else skipped
# Each part runs under its own `timeout` (SIGTERM, then SIGKILL 10 s later) with its output redirected into
# OUTDIR/<part>.log; every part runs whatever the others did. It ends with a summary (OUTDIR/summary.txt and
# summary.json: each part's status, exit code and seconds) and exits 1 if a part failed, 0 otherwise. Without a GPU
# it stops at once with exit 3, unless --dry: the same flow on the CPU at toy sizes. Limits (s), set in the
# environment: GPU_SESSION_DEMO_S (75; --dry 90), GPU_SESSION_CHECK_S (240; 270), GPU_SESSION_RUNS_S (225; 180); at
# most 540 together.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

usage() {
    echo "usage: bash scripts/gpu_session.sh OUTDIR [--dry] [--timm-train PATH]   (--dry: the same flow on the CPU" \
         "at toy sizes; timm's train.py also from \$TIMM_TRAIN)" >&2
    exit 2
}

OUT="" DRY=0 TIMM=${TIMM_TRAIN:-}
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) DRY=1 ;;
        --timm-train) [ $# -ge 2 ] || usage; TIMM=$2; shift ;;
        -*) usage ;;
        *) [ -z "$OUT" ] || usage; OUT=$1 ;;
    esac
    shift
done
[ -n "$OUT" ] || usage
[ -x "$PY" ] || { echo "gpu_session: $PY not found; run bash scripts/install.sh first (or set PYTHON=...)" >&2; exit 2; }
if [ -n "$TIMM" ] && [ ! -f "$TIMM" ]; then
    echo "gpu_session: timm's train.py $TIMM is not a file; get it as deit_ablate/bench/timm_ref.py says, or leave" \
         "--timm-train and TIMM_TRAIN unset to skip the whole-run pair." >&2
    exit 2
fi
if [ "$DRY" = 1 ]; then  # toy sizes on a CPU: gpu_check's torch.compile takes the longest there
    DEMO_S=${GPU_SESSION_DEMO_S:-90} CHECK_S=${GPU_SESSION_CHECK_S:-270} RUNS_S=${GPU_SESSION_RUNS_S:-180}
else
    DEMO_S=${GPU_SESSION_DEMO_S:-75} CHECK_S=${GPU_SESSION_CHECK_S:-240} RUNS_S=${GPU_SESSION_RUNS_S:-225}
fi
for limit in "$DEMO_S" "$CHECK_S" "$RUNS_S"; do
    [[ "$limit" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_session: time limit '$limit' is not a positive number of" \
        "seconds; fix GPU_SESSION_DEMO_S, GPU_SESSION_CHECK_S or GPU_SESSION_RUNS_S." >&2; exit 2; }
done
if [ $((DEMO_S + CHECK_S + RUNS_S)) -gt 540 ]; then
    echo "gpu_session: the parts' time limits ${DEMO_S} + ${CHECK_S} + ${RUNS_S} s exceed the session's 540 s;" \
         "lower GPU_SESSION_DEMO_S, GPU_SESSION_CHECK_S or GPU_SESSION_RUNS_S." >&2
    exit 2
fi
if [ "$DRY" = 0 ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_session: no CUDA GPU is visible (torch.cuda.is_available() is False); run it on a machine with a GPU," \
         "or add --dry for the same flow on the CPU." >&2
    exit 3
fi
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
export WANDB_SILENT=true PYTHONUNBUFFERED=1

WORKERS=$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))
if [ "$DRY" = 1 ]; then
    DEVICE=cpu
    DEMO_ARGS=(train.epochs=1 data.builtin.train_per_class=30 data.builtin.val_per_class=10)
    CHECK_ARGS=(--dry)
    RUN_ARGS=(--draw-jpegs 32 --draw-classes 2 --run-model deit_tiny --run-model-kwargs embed_dim=32,depth=1,num_heads=2
              --run-size 32 --run-batch 16 --e2e-epochs 1 --repeats 1 --workers 0)
else
    DEVICE=cuda
    DEMO_ARGS=()
    CHECK_ARGS=()
    RUN_ARGS=(--draw-jpegs 6400 --draw-classes 10 --run-model deit_small --run-size 224 --run-batch 256
              --e2e-epochs 2 --repeats 2 --workers "$WORKERS")
fi

NAMES=() STATUSES=() CODES=() SECONDS_TAKEN=() FAILED=0

# run_part NAME LIMIT COMMAND...: COMMAND under `timeout`, its output into OUTDIR/NAME.log; records how it ended.
run_part() {
    local name=$1 limit=$2 start end code status
    shift 2
    echo "[gpu_session] $name (limit ${limit} s): $* > $OUT/$name.log 2>&1"
    start=$(date +%s%N)
    timeout --signal=TERM --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    code=$?
    end=$(date +%s%N)
    case $code in
        0) status=ok ;;
        124|137) status="timed out after ${limit} s"; FAILED=1 ;;
        *) status=failed; FAILED=1 ;;
    esac
    record "$name" "$status" "$code" "$(( (end - start) / 1000000 ))"
}

record() {
    NAMES+=("$1") STATUSES+=("$2") CODES+=("$3") SECONDS_TAKEN+=("$4")
    echo "[gpu_session] $1: $2 (exit $3, $(printf '%d.%03d' $(($4 / 1000)) $(($4 % 1000))) s)"
}

run_part demo "$DEMO_S" "$PY" train.py "runtime.device=$DEVICE" "runtime.output_root=$OUT/demo" "${DEMO_ARGS[@]}"
run_part gpu_check "$CHECK_S" bash scripts/gpu_check.sh "$OUT/gpu_check.json" "${CHECK_ARGS[@]}"
if [ -n "$TIMM" ]; then
    run_part e2e_run "$RUNS_S" "$PY" scripts/bench.py --sections e2e_run --device "$DEVICE" --timm-train "$TIMM" \
        "${RUN_ARGS[@]}" --out "$OUT/e2e_run.json"
else
    echo "[gpu_session] e2e_run skipped: timm's train.py is not given (--timm-train PATH or TIMM_TRAIN=PATH; see" \
         "deit_ablate/bench/timm_ref.py)" | tee "$OUT/e2e_run.log"
    record e2e_run "skipped: no timm train.py" - 0
fi

{
    echo "gpu_session $([ "$DRY" = 1 ] && echo "--dry (CPU, toy sizes)" || echo "on $DEVICE") into $OUT"
    printf '%-10s %-32s %5s %9s  %s\n' part status exit seconds log
    for i in "${!NAMES[@]}"; do
        ms=${SECONDS_TAKEN[$i]}
        printf '%-10s %-32s %5s %5d.%03d  %s\n' "${NAMES[$i]}" "${STATUSES[$i]}" "${CODES[$i]}" $((ms / 1000)) \
            $((ms % 1000)) "$OUT/${NAMES[$i]}.log"
    done
} | tee "$OUT/summary.txt"
{
    printf '{"dry": %s, "device": "%s", "parts": [' "$([ "$DRY" = 1 ] && echo true || echo false)" "$DEVICE"
    for i in "${!NAMES[@]}"; do
        ms=${SECONDS_TAKEN[$i]}
        code=${CODES[$i]}
        [ "$code" = - ] && code=null
        printf '%s{"part": "%s", "status": "%s", "exit": %s, "seconds": %d.%03d, "log": "%s.log"}' \
            "$([ "$i" = 0 ] || echo ', ')" "${NAMES[$i]}" "${STATUSES[$i]}" "$code" $((ms / 1000)) $((ms % 1000)) \
            "${NAMES[$i]}"
    done
    printf '], "failed": %s}\n' "$([ "$FAILED" = 1 ] && echo true || echo false)"
} > "$OUT/summary.json"
exit "$FAILED"

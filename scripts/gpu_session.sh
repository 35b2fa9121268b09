#!/usr/bin/env bash
# One GPU session, one command, at most 9 minutes on one GPU:
#   bash scripts/gpu_session.sh OUTDIR [--wheelhouse DIR [--python PY]] [--timm-train PATH]
#   (0) install, with --wheelhouse only: a venv with --system-site-packages from PY (default python3, the image's: it
#       imports torch) at $GPU_SESSION_VENV (default .node-venv in the checkout, ignored; reused if it has a python),
#       pip install --no-index --find-links DIR deit-ablate (the wheelhouse alone: pip --isolated), and a check of
#       `import torch, timm, deit_ablate` with torch's version and whether CUDA is available, into OUTDIR/install.log.
#       The parts below run with that venv's python, and are skipped ("skipped: install failed") if it failed.
#       Without --wheelhouse they run with $PYTHON, else .venv/bin/python.
#   (a) the demo on the GPU: python train.py runtime.device=cuda, its run folder under OUTDIR/demo/
#   (b) the GPU check: bash scripts/gpu_check.sh OUTDIR/gpu_check.json
#   (c) the host's share of a step on the GPU: scripts/bench.py --sections host_step --device cuda, ours against
#       timm's loop on a stand-in of negligible compute, batch 256 at 224 and 32 px (docs/host-step.md):
#       OUTDIR/host_step.json
#   (d) whole runs, ours against timm's train.py in turn: DeiT-S/16 at 224 px, bf16, global batch 256, loader workers
#       = cores - 2, 2 epochs on 6,400 + 800 drawn 500x375 JPEGs (drawn once into the bench cache), 2 pairs
#       (scripts/bench.py --sections e2e_run); timm's train.py from --timm-train or $TIMM_TRAIN, else skipped
# Each part runs under its own `timeout` (SIGTERM, then SIGKILL 10 s later) with its output redirected into
# OUTDIR/<part>.log; every part after the install runs whatever the others did. It ends with a summary
# (OUTDIR/summary.txt and summary.json: each part's status, exit code and seconds; the python the parts ran with) and
# exits 1 if a part failed, 0 otherwise. Without a GPU it stops at once with exit 3, unless --dry: the same flow on
# the CPU at toy sizes. Limits (s), set in the environment: GPU_SESSION_INSTALL_S (60; --dry 90), GPU_SESSION_DEMO_S
# (60; 75), GPU_SESSION_CHECK_S (210; 225), GPU_SESSION_HOST_S (45; 30), GPU_SESSION_RUNS_S (165; 120); at most 540
# together (the install's counted when --wheelhouse is given).
# Relative paths (OUTDIR, --wheelhouse, --python, --timm-train) are the caller's, wherever the script lives.
set -uo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

from_caller() {  # a path the caller gave, relative to the caller's folder, not the checkout's
    case "$1" in /*|"") echo "$1" ;; */*) echo "$CALLER/$1" ;; *) if [ -e "$CALLER/$1" ]; then echo "$CALLER/$1"; \
        else echo "$1"; fi ;; esac
}

usage() {
    echo "usage: bash scripts/gpu_session.sh OUTDIR [--dry] [--wheelhouse DIR [--python PY]] [--timm-train PATH]" \
         "  (--dry: the same flow on the CPU at toy sizes; --wheelhouse: install from DIR, made by" \
         "scripts/wheelhouse.sh, into a venv over PY, default python3; timm's train.py also from \$TIMM_TRAIN)" >&2
    exit 2
}

OUT="" DRY=0 TIMM=${TIMM_TRAIN:-} HOUSE="" IMAGE_PY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) DRY=1 ;;
        --timm-train) [ $# -ge 2 ] || usage; TIMM=$(from_caller "$2"); shift ;;
        --wheelhouse) [ $# -ge 2 ] || usage; HOUSE=$(from_caller "$2"); shift ;;
        --python) [ $# -ge 2 ] || usage; IMAGE_PY=$(from_caller "$2"); shift ;;
        -*) usage ;;
        *) [ -z "$OUT" ] || usage; OUT=$1; case "$OUT" in /*) ;; *) OUT=$CALLER/$OUT ;; esac ;;
    esac
    shift
done
[ -n "$OUT" ] || usage
if [ -n "$HOUSE" ]; then  # the image's python stands in for the venv's until the install part has made it
    VENV=${GPU_SESSION_VENV:-.node-venv}
    IMAGE_PY=${IMAGE_PY:-python3}
    [ -d "$HOUSE" ] || { echo "gpu_session: the wheelhouse $HOUSE is not a folder; build one with bash" \
        "scripts/wheelhouse.sh DIR (docs/gpu.md), carry it, and give --wheelhouse DIR." >&2; exit 2; }
    compgen -G "$HOUSE/deit_ablate-*.whl" > /dev/null || { echo "gpu_session: the wheelhouse $HOUSE holds no" \
        "deit_ablate wheel; build it with bash scripts/wheelhouse.sh DIR (docs/gpu.md)." >&2; exit 2; }
    "$IMAGE_PY" -c "" 2>/dev/null || { echo "gpu_session: --python $IMAGE_PY cannot be run; give the image's" \
        "Python, the one that imports torch, with --python PY." >&2; exit 2; }
    "$IMAGE_PY" -c "import torch" 2>/dev/null || { echo "gpu_session: --python $IMAGE_PY does not import torch;" \
        "give the image's Python, the one that has torch and torchvision, with --python PY." >&2; exit 2; }
    [ ! -e "$VENV" ] || [ -x "$VENV/bin/python" ] || { echo "gpu_session: $VENV exists and is not a venv; remove" \
        "it, or set GPU_SESSION_VENV to another folder." >&2; exit 2; }
    HOUSE=$(cd "$HOUSE" && pwd)
    PY=$IMAGE_PY
elif [ -n "$IMAGE_PY" ]; then
    echo "gpu_session: --python names the image's Python the wheelhouse installs over; give --wheelhouse DIR" \
         "with it, or set PYTHON=... to run the parts with a Python that has deit-ablate." >&2
    exit 2
else
    [ -x "$PY" ] || { echo "gpu_session: $PY not found; run bash scripts/install.sh first (or set PYTHON=...)" >&2
                      exit 2; }
fi
if [ -n "$TIMM" ] && [ ! -f "$TIMM" ]; then
    echo "gpu_session: timm's train.py $TIMM is not a file; get it as deit_ablate/bench/timm_ref.py says, or leave" \
         "--timm-train and TIMM_TRAIN unset to skip the whole-run pair." >&2
    exit 2
fi
LIMIT_NAMES="GPU_SESSION_INSTALL_S, GPU_SESSION_DEMO_S, GPU_SESSION_CHECK_S, GPU_SESSION_HOST_S or GPU_SESSION_RUNS_S"
if [ "$DRY" = 1 ]; then  # toy sizes on a CPU: the install and the whole-run pair take longest there
    INSTALL_S=${GPU_SESSION_INSTALL_S:-90} DEMO_S=${GPU_SESSION_DEMO_S:-75} CHECK_S=${GPU_SESSION_CHECK_S:-225}
    HOST_S=${GPU_SESSION_HOST_S:-30} RUNS_S=${GPU_SESSION_RUNS_S:-120}
else
    INSTALL_S=${GPU_SESSION_INSTALL_S:-60} DEMO_S=${GPU_SESSION_DEMO_S:-60} CHECK_S=${GPU_SESSION_CHECK_S:-210}
    HOST_S=${GPU_SESSION_HOST_S:-45} RUNS_S=${GPU_SESSION_RUNS_S:-165}
fi
LIMITS=("$DEMO_S" "$CHECK_S" "$HOST_S" "$RUNS_S")
[ -z "$HOUSE" ] || LIMITS=("$INSTALL_S" "${LIMITS[@]}")
TOTAL=0
for limit in "${LIMITS[@]}"; do
    [[ "$limit" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_session: time limit '$limit' is not a positive number of" \
        "seconds; fix $LIMIT_NAMES." >&2; exit 2; }
    TOTAL=$((TOTAL + limit))
done
if [ "$TOTAL" -gt 540 ]; then
    SUM="${LIMITS[*]}"
    echo "gpu_session: the parts' time limits ${SUM// / + } s exceed the session's 540 s; lower $LIMIT_NAMES." >&2
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
    HOST_ARGS=(--quick)
    RUN_ARGS=(--draw-jpegs 32 --draw-classes 2 --run-model deit_tiny --run-model-kwargs embed_dim=32,depth=1,num_heads=2
              --run-size 32 --run-batch 16 --e2e-epochs 1 --repeats 1 --workers 0)
else
    DEVICE=cuda
    DEMO_ARGS=()
    CHECK_ARGS=()
    HOST_ARGS=()
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

# install_node IMAGE_PY VENV WHEELHOUSE: the install part (run as `bash -c`, under its timeout).
install_node() {
    set -euo pipefail
    local image_py=$1 venv=$2 house=$3 site
    if [ -x "$venv/bin/python" ]; then
        echo "reusing the venv $venv"
    else
        echo "creating the venv $venv with --system-site-packages from $image_py"
        "$image_py" -m venv --system-site-packages "$venv"
        # A venv made by a venv's python sees the interpreter under it, not that venv's packages: a .pth adds them.
        if "$image_py" -c "import sys; sys.exit(sys.prefix == sys.base_prefix)"; then
            site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
            "$image_py" -c "import site; print(''.join(f'import site; site.addsitedir({p!r})\n'
                            for p in site.getsitepackages()), end='')" > "$site/_image_site_packages.pth"
            echo "the image's python is a venv's: $site/_image_site_packages.pth adds its site-packages"
        fi
        # Below Python 3.12 the venv gets ensurepip's setuptools, which hides the image's: torch may need a newer one.
        if "$image_py" -c "import setuptools" 2> /dev/null; then
            "$venv/bin/python" -m pip --isolated uninstall --disable-pip-version-check -y setuptools
        fi
    fi
    "$venv/bin/python" -m pip --isolated install --disable-pip-version-check --no-index --find-links "$house" \
        deit-ablate
    cd /  # the installed deit_ablate, not the checkout's
    "$venv/bin/python" -I -c "import sys, torch, timm, deit_ablate
print('python', sys.executable, '| torch', torch.__version__, '| timm', timm.__version__, '| deit_ablate',
      deit_ablate.__file__, '| CUDA available:', torch.cuda.is_available())"
}

if [ -n "$HOUSE" ]; then
    run_part install "$INSTALL_S" bash -c "$(declare -f install_node); install_node \"\$@\"" install "$IMAGE_PY" \
        "$VENV" "$HOUSE"
    PY=$(cd "$VENV" 2>/dev/null && pwd || echo "$VENV")/bin/python
fi
if [ -n "$HOUSE" ] && [ "${STATUSES[0]}" != ok ]; then
    for name in demo gpu_check host_step e2e_run; do
        echo "[gpu_session] $name skipped: the install failed (see $OUT/install.log)" | tee "$OUT/$name.log"
        record "$name" "skipped: install failed" - 0
    done
else
    echo "[gpu_session] the parts run with $PY"
    # scripts/bench.py imports the checkout's deit_ablate (conf/ beside it), as train.py and gpu_check.sh's -m do,
    # not an installed wheel's copy, which has no conf/
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    run_part demo "$DEMO_S" "$PY" train.py "runtime.device=$DEVICE" "runtime.output_root=$OUT/demo" "${DEMO_ARGS[@]}"
    run_part gpu_check "$CHECK_S" env PYTHON="$PY" bash scripts/gpu_check.sh "$OUT/gpu_check.json" "${CHECK_ARGS[@]}"
    run_part host_step "$HOST_S" "$PY" scripts/bench.py --sections host_step --skip-timm --device "$DEVICE" \
        "${HOST_ARGS[@]}" --out "$OUT/host_step.json"
    if [ -n "$TIMM" ]; then
        run_part e2e_run "$RUNS_S" "$PY" scripts/bench.py --sections e2e_run --device "$DEVICE" --timm-train "$TIMM" \
            "${RUN_ARGS[@]}" --out "$OUT/e2e_run.json"
    else
        echo "[gpu_session] e2e_run skipped: timm's train.py is not given (--timm-train PATH or TIMM_TRAIN=PATH; see" \
             "deit_ablate/bench/timm_ref.py)" | tee "$OUT/e2e_run.log"
        record e2e_run "skipped: no timm train.py" - 0
    fi
fi

{
    echo "gpu_session $([ "$DRY" = 1 ] && echo "--dry (CPU, toy sizes)" || echo "on $DEVICE") into $OUT, with $PY"
    printf '%-10s %-32s %5s %9s  %s\n' part status exit seconds log
    for i in "${!NAMES[@]}"; do
        ms=${SECONDS_TAKEN[$i]}
        printf '%-10s %-32s %5s %5d.%03d  %s\n' "${NAMES[$i]}" "${STATUSES[$i]}" "${CODES[$i]}" $((ms / 1000)) \
            $((ms % 1000)) "$OUT/${NAMES[$i]}.log"
    done
} | tee "$OUT/summary.txt"
{
    printf '{"dry": %s, "device": "%s", "python": "%s", "wheelhouse": %s, "parts": [' \
        "$([ "$DRY" = 1 ] && echo true || echo false)" "$DEVICE" "$PY" \
        "$([ -n "$HOUSE" ] && echo "\"$HOUSE\"" || echo null)"
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

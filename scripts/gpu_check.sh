#!/usr/bin/env bash
# One prepared GPU check (issue #17): bash scripts/gpu_check.sh OUT.json
# bf16 matmul rate; DeiT-B/16 bf16 train step images/s and MFU, eager and torch.compile; host syncs per step; DeiT-B/16
# fp16 train steps (train.amp=fp16: images/s, steps the loss scaler skipped, final scale); input pipeline images/s
# at 224 (pil on all cores, dali on the GPU); hard-token distillation step (RegNetY-16GF teacher, random init,
# + DeiT-B distilled); peak memory. Writes OUT.json and prints a table; under 8 minutes on one H200.
# Installs nothing and downloads nothing (it draws its own JPEGs); stops at once, exit 3, where there is no GPU.
# --dry runs every function of the check on the CPU at 224 px with a narrow DeiT and writes the JSON (one to two minutes on 2 busy cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: bash scripts/gpu_check.sh OUT.json [--dry]   (--dry: every function of the check on the CPU, 224 px, a narrow DeiT)" >&2
    exit 2
fi
[ -x "$PY" ] || { echo "gpu_check: $PY not found; run bash scripts/install.sh first (or set PYTHON=...)" >&2; exit 2; }
exec timeout --signal=INT 470 "$PY" -m deit_ablate.bench.gpu_check "$@"

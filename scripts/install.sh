#!/usr/bin/env bash
# Create .venv and install deit-ablate with everything it needs (PyTorch first, from pip's local wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# torch/torchvision before the project, pinned, so pip never resolves a different (multi-GB) build.
.venv/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
# [dali]: NVIDIA DALI for the opt-in data.backend=dali (about 200 MB; runs on the CPU too, so its tests run everywhere)
.venv/bin/python -m pip install --quiet -e ".[dev,dali]" --config-settings editable_mode=compat  # hydra_plugins/ on sys.path for SLURM jobs
echo "deit-ablate installed in .venv ($(.venv/bin/python -c 'import torch, timm; print(f"torch {torch.__version__}, timm {timm.__version__}")'))"

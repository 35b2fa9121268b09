#!/usr/bin/env bash
# Create .venv and install deit-ablate with everything it needs (PyTorch first, from pip's local wheels).
# DEIT_INSTALL_DRY=1: say which PyTorch build it would install and why, print the commands, and run none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

run() {
    if [ -n "${DEIT_INSTALL_DRY:-}" ]; then echo "+ $*"; else "$@"; fi
}

# One build for every machine: PyPI's torchvision wheels for x86_64 Linux are CUDA builds (their ops library needs
# torch's libc10_cuda.so), so beside a CPU-only torch `import torchvision` fails ('operator torchvision::nms does not
# exist'), and PyPI has no CPU build of either; the CUDA build runs on the CPU too.
if nvidia-smi -L >/dev/null 2>&1 || [ -e /dev/nvidia0 ]; then
    why="a GPU is visible (nvidia-smi -L or /dev/nvidia0)"
else
    why="no GPU is visible: it runs on the CPU (PyPI has no CPU build of torchvision for x86_64, README 'Quickstart')"
fi
echo "PyTorch: torch 2.14.1 / torchvision 0.29.1, PyPI's CUDA 13 build (6.5 GB in .venv); $why"

[ -x .venv/bin/python ] || run "$PYTHON" -m venv .venv
run .venv/bin/python -m pip install --quiet --upgrade pip
# torch/torchvision before the project, pinned, so pip never resolves a different (multi-GB) build.
run .venv/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1"
# [analysis]: the aggregator's scipy and matplotlib; [dali]: NVIDIA DALI for the opt-in data.backend=dali (about
# 200 MB; runs on the CPU too, so its tests run everywhere). An editable install whose .pth puts the checkout on
# sys.path (pyproject.toml: package-dir "" = "."), so that hydra_plugins/ is found by Hydra and by SLURM jobs as
# deit_ablate is.
run .venv/bin/python -m pip install --quiet -e ".[analysis,dev,dali]"
[ -n "${DEIT_INSTALL_DRY:-}" ] && exit 0
echo "deit-ablate installed in .venv ($(.venv/bin/python -c 'import torch, timm; print(f"torch {torch.__version__}, timm {timm.__version__}")'))"

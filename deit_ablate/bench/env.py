"""The device a benchmark runs on: a description, a timer that waits for the device, its matmul rate."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Iterator
from typing import Any

import torch


def cpu_name() -> str:
    """The CPU model name from /proc/cpuinfo, or the platform's processor string."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe(device: torch.device) -> dict[str, Any]:
    """What the figures were measured on: device, cores, library versions."""
    import PIL
    import timm
    import torchvision

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: dict[str, Any] = {
        "device": str(device), "cpu": cpu_name(), "cores": cores, "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "torchvision": torchvision.__version__, "timm": timm.__version__,
        "pillow": PIL.__version__, "python": platform.python_version(),
        "load_avg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_count"] = torch.cuda.device_count()
        info["summary"] = f"{info['gpu']} (1 of {info['gpu_count']}), torch {torch.__version__}"
    else:
        info["summary"] = f"CPU {info['cpu']}, {cores} cores, torch {torch.__version__}"
    return info


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Hold torch to `threads` intra-op threads inside the block (None: leave them as they are)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def synchronize(device: torch.device) -> None:
    """Wait for queued work on `device` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds `fn()` takes, including the device work it queues."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def matmul_rate(device: torch.device, n: int | None = None, repeats: int = 10) -> dict[str, Any]:
    """Measured dense matmul FLOP/s: bf16 on GPU (the tensor-core rate MFU is quoted against), fp32 on CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    seconds = [timed(lambda: a @ b, device) for _ in range(repeats)]
    best = min(seconds)
    return {"flops_per_s": 2 * n**3 / best, "dtype": str(dtype).replace("torch.", ""), "n": n,
            "samples_flops_per_s": [2 * n**3 / s for s in seconds]}

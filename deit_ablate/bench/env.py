"""The device a benchmark runs on: a description, a timer that waits for the device, its matmul rate, and the CUDA
calls the benchmarks make (`DeviceCalls`), each with a CPU equivalent so that the code around it runs on the CPU."""

from __future__ import annotations

import contextlib
import os
import platform
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

SYNC_WARNING = "called a synchronizing"  # how CUDA's sync debug mode words its warning, and HostReads too


def cpu_name() -> str:
    """The CPU model name from /proc/cpuinfo, or the platform's processor string."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


class HostReads(TorchFunctionMode):
    """The CPU's equivalent of CUDA's sync debug mode ("warn"): a warning at each call that reads a tensor's value on
    the host, the calls that make the host wait for a GPU (.item(), bool(), .tolist(), .cpu(), nonzero, ...)."""

    READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
                       torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
                       torch.Tensor.cpu, torch.Tensor.numpy})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            warnings.warn(f"{SYNC_WARNING} operation: {func.__name__} (HostReads, on the CPU)", stacklevel=2)
        return func(*args, **(kwargs or {}))


@dataclass
class _HostReadsSwitch:
    """set_sync_debug_mode's CPU equivalent: "warn" enters HostReads, "default" leaves it."""

    _mode: HostReads | None = field(default=None, init=False)

    def __call__(self, mode: str) -> None:
        if mode == "warn" and self._mode is None:
            self._mode = HostReads()
            self._mode.__enter__()
        elif mode == "default" and self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None


@dataclass(frozen=True)
class DeviceCalls:
    """The CUDA calls the benchmarks make, one per field, so that the code around each runs on the CPU too:
    `device_calls` gives torch.cuda's on a GPU and CPU equivalents on the CPU; a test hands in its own stand-ins."""

    synchronize: Callable[[], None]  # wait for queued work
    reset_peak_memory: Callable[[], None]
    peak_memory_bytes: Callable[[], int | None]  # since the last reset; None: not tracked
    empty_cache: Callable[[], None]  # hand cached blocks back
    sync_debug_mode: Callable[[str], None]  # "warn": a warning at each host-device sync; "default": none
    accelerator: Callable[[], tuple[str, int] | None]  # (name, count) of the GPUs; None on the CPU


def cuda_calls(device: torch.device) -> DeviceCalls:
    """torch.cuda's calls for `device`, one per field: the only lines of the benchmarks that need a GPU."""
    return DeviceCalls(
        synchronize=lambda: torch.cuda.synchronize(device),
        reset_peak_memory=lambda: torch.cuda.reset_peak_memory_stats(device),
        peak_memory_bytes=lambda: torch.cuda.max_memory_allocated(device),
        empty_cache=torch.cuda.empty_cache,
        sync_debug_mode=torch.cuda.set_sync_debug_mode,
        accelerator=lambda: (torch.cuda.get_device_name(device), torch.cuda.device_count()))


def cpu_calls() -> DeviceCalls:
    """The CPU's equivalents: nothing is queued or cached, peak memory is not tracked, host reads warn (HostReads)."""
    return DeviceCalls(synchronize=lambda: None, reset_peak_memory=lambda: None, peak_memory_bytes=lambda: None,
                       empty_cache=lambda: None, sync_debug_mode=_HostReadsSwitch(), accelerator=lambda: None)


def device_calls(device: torch.device) -> DeviceCalls:
    """The calls for `device`: torch.cuda's on a GPU, the CPU's equivalents elsewhere."""
    return cuda_calls(device) if device.type == "cuda" else cpu_calls()


def describe(device: torch.device, calls: DeviceCalls | None = None) -> dict[str, Any]:
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
    accelerator = (calls or device_calls(device)).accelerator()
    if accelerator is not None:
        info["gpu"], info["gpu_count"] = accelerator
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
    device_calls(device).synchronize()


def timed(fn, device: torch.device) -> float:
    """Seconds `fn()` takes, including the device work it queues."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def matmul_setting(device: torch.device) -> tuple[torch.dtype, int]:
    """The dtype and size matmul_rate measures on `device`: bf16 at 8192 on a GPU (the tensor-core rate MFU is quoted
    against), fp32 at 1024 on the CPU."""
    return (torch.bfloat16, 8192) if device.type == "cuda" else (torch.float32, 1024)


def matmul_rate(device: torch.device, n: int | None = None, repeats: int = 10,
                dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Measured dense matmul FLOP/s, in matmul_setting's dtype and size unless given."""
    default_dtype, default_n = matmul_setting(device)
    dtype, n = dtype or default_dtype, n or default_n
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    seconds = [timed(lambda: a @ b, device) for _ in range(repeats)]
    best = min(seconds)
    return {"flops_per_s": 2 * n**3 / best, "dtype": str(dtype).replace("torch.", ""), "n": n,
            "samples_flops_per_s": [2 * n**3 / s for s in seconds]}

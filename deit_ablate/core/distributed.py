"""Process groups from torchrun or SLURM/submitit: NCCL on GPUs, Gloo on CPU."""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from deit_ablate.core.errors import ConfigError, RunError


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its rank, the world size and the device it drives."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    host: str = field(default_factory=socket.gethostname)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def _export_slurm_env() -> None:
    """Under SLURM without torchrun, derive RANK/WORLD_SIZE/MASTER_ADDR from submitit's view of the job."""
    if "RANK" in os.environ or "SLURM_JOB_ID" not in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def choose_device(requested: str, local_rank: int) -> torch.device:
    """`auto`: this rank's GPU when there is one, else the CPU."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device(requested)


def process_group_backend(device: torch.device) -> str:
    """NCCL between GPUs, Gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def bind_device(device: torch.device, set_device: Callable[[torch.device], None] = torch.cuda.set_device) -> None:
    """Make `device` this process's current GPU (NCCL and CUDA's defaults follow it); nothing on the CPU."""
    if device.type == "cuda":
        set_device(device)


def device_generator(device: torch.device, cuda_generators: Sequence[torch.Generator] | None = None) -> torch.Generator:
    """The default random generator of `device` (what its random ops draw from): its GPU's, or the CPU's."""
    if device.type != "cuda":
        return torch.default_generator
    generators = torch.cuda.default_generators if cuda_generators is None else cuda_generators
    return generators[device.index if device.index is not None else torch.cuda.current_device()]


def init_distributed(requested_device: str = "auto") -> DistInfo:
    """Join the process group the launcher set up (torchrun or SLURM), or run alone."""
    _export_slurm_env()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = choose_device(requested_device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        bind_device(device)
        backend = process_group_backend(device)
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        print(f"[dist] rank {rank} of {world_size} (local rank {local_rank} on {socket.gethostname()}) joined the "
              f"process group ({backend}, {device})", flush=True)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum a tensor over ranks (a no-op alone)."""
    if info.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_tensors(tensors: list[torch.Tensor], info: DistInfo) -> None:
    """Make each tensor rank 0's, in place, on every rank (a no-op alone)."""
    if info.enabled:
        for tensor in tensors:
            dist.broadcast(tensor, src=0)


def barrier(info: DistInfo) -> None:
    """Wait for every rank (a no-op alone)."""
    if info.enabled:
        dist.barrier()


def broadcast_object(value, info: DistInfo):
    """Rank 0's value on every rank."""
    if not info.enabled:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def gather_objects(value, info: DistInfo) -> list:
    """Every rank's value, in rank order, on every rank."""
    if not info.enabled:
        return [value]
    out = [None] * info.world_size
    dist.all_gather_object(out, value)
    return out


def placement(info: DistInfo) -> dict[str, list[int]]:
    """Which ranks ran on which host, on every rank: the run's record of its nodes."""
    hosts: dict[str, list[int]] = {}
    for rank, host in enumerate(gather_objects(info.host, info)):
        hosts.setdefault(host, []).append(rank)
    return hosts


def cleanup(info: DistInfo) -> None:
    """Leave the process group."""
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def portable_error(error: ConfigError | RunError) -> ConfigError | RunError:
    """`error` itself when it comes back whole from pickling (its type and message), else a ConfigError or RunError
    carrying its text: what another rank can be sent and raise."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and str(copy) == str(error):
            return error
    except Exception:  # noqa: BLE001 - an error class that does not pickle (a local class, unpicklable state)
        pass
    return (ConfigError if isinstance(error, ConfigError) else RunError)(str(error))


def agree(info: DistInfo, decide: Callable[[], Any]) -> Any:
    """Rank 0 decides; every rank gets its answer, or raises the ConfigError/RunError it raised (the error object
    itself, pickled: its class, message and attributes; see portable_error). Any other error of rank 0 stops the
    others with a RunError, instead of leaving them waiting for its answer."""
    outcome: tuple = ("ok", None)
    failed: BaseException | None = None
    if info.is_main:
        try:
            outcome = ("ok", decide())
        except (ConfigError, RunError) as error:
            if not info.enabled:
                raise
            failed, outcome = error, ("error", portable_error(error))
        except Exception as error:
            stop = RunError(f"rank 0 failed ({type(error).__name__}: {error}); see its log")
            broadcast_object(("error", stop), info)
            raise
    outcome = broadcast_object(outcome, info)
    if failed is not None:
        raise failed
    if outcome[0] == "error":
        raise outcome[1]
    return outcome[1]


def peer_lost(error: RuntimeError) -> str | None:
    """How a collective failed if it failed because another rank is gone (it crashed or stopped on an error of its
    own), else None."""
    for sign in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"):
        if sign in str(error):
            return sign
    return type(error).__name__ if isinstance(error, dist.DistError) else None


def stopped_by_peer(error: RuntimeError, info: DistInfo) -> RunError | None:
    """The RunError to stop this rank with when `error` means another rank left the process group, else None."""
    sign = peer_lost(error) if info.enabled else None
    if sign is None:
        return None
    return RunError(f"rank {info.rank} stopped because another rank left the process group mid-run ({sign}). The "
                    "rank that stopped first says why in its own output; the run's checkpoints are intact, and "
                    "relaunching the same command resumes it.")

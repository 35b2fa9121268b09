"""What a GPU run resolves by itself (docs/gpu.md's table), checked on a stand-in CUDA device on the CPU."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.data import Dataset

from deit_ablate.config.schema import Precision
from deit_ablate.data.loader import build_loader, device_type_of, loader_settings
from deit_ablate.run.assemble import amp_dtype
from deit_ablate.train.optim import build_optimizer
from tests.conftest import REPO, compose_config

GPU_DOC = REPO / "docs" / "gpu.md"


def _table() -> dict[str, tuple[str, str]]:
    """docs/gpu.md's table: setting -> (on a GPU, on a CPU)."""
    rows = {}
    for line in GPU_DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and not set(cells[1]) <= {"-", " "} and cells[0] != "setting":
            rows[re.sub(r" \(.*\)$", "", cells[0])] = (cells[1], cells[2])
    return rows


def _runtime(*overrides: str):
    return compose_config(["preset=paper", *overrides]).runtime


def test_the_resolved_gpu_defaults_are_what_docs_gpu_md_says():
    table = _table()
    runtime = _runtime()
    gpu = loader_settings(runtime, "cuda", cores=16)
    cpu = loader_settings(runtime, "cpu", cores=16)
    on = {True: "on", False: "off"}
    assert table["loader workers"] == (str(gpu.workers), str(cpu.workers)) == ("14", "16")
    assert table["training-process torch threads"] == (str(gpu.main_threads), "torch's default")
    assert cpu.main_threads is None
    assert table["pinned memory"] == (on[gpu.pin_memory], on[cpu.pin_memory])
    assert table["batches prefetched per worker"] == (str(gpu.prefetch_factor), str(cpu.prefetch_factor))
    assert table["persistent workers"] == (on[gpu.persistent_workers], on[cpu.persistent_workers])
    assert table["evaluation batch"] == (str(runtime.eval_batch),) * 2
    assert table["`runtime.compile`"] == (on[runtime.compile],) * 2
    train = compose_config(["preset=paper"]).train
    assert train.amp == Precision.auto
    assert amp_dtype(train.amp, torch.device("cuda")) == torch.bfloat16
    assert amp_dtype(train.amp, torch.device("cpu")) is None
    assert table["precision"] == ("bf16 autocast", "fp32")
    optimizer = build_optimizer(torch.nn.Linear(4, 2), "adamw", 1e-3, 0.05)
    assert optimizer.defaults["fused"] is True and table["AdamW"] == ("fused", "fused")


def test_a_rank_shares_its_node_and_what_the_command_line_sets_wins():
    runtime = _runtime()
    eight_ranks = loader_settings(runtime, "cuda", cores=128, sharing=8)  # torchrun: 8 ranks in one task
    assert (eight_ranks.workers, eight_ranks.main_threads) == (14, 2)
    few = loader_settings(runtime, "cuda", cores=2)
    assert (few.workers, few.main_threads) == (1, 1)
    given = loader_settings(_runtime("runtime.num_workers=10", "runtime.cpu_threads=4"), "cuda", cores=16)
    assert (given.workers, given.main_threads) == (10, 4)
    none = loader_settings(_runtime("runtime.num_workers=0"), "cuda", cores=16)
    assert (none.workers, none.prefetch_factor, none.persistent_workers, none.main_threads) == (0, None, False, 16)
    assert loader_settings(runtime, "cpu", cores=16, sharing=8).workers == 16  # a CPU run keeps every core


class Threads(Dataset):
    """Each item is the torch thread count of the process that loads it."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(torch.get_num_threads())


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_a_cuda_run_builds_its_loaders_from_the_rank_cores(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "16")  # the cores of this rank, as SLURM gives them
    loader = build_loader(Threads(), [0, 1], 2, _runtime("runtime.device=cuda"), train=False)
    assert (loader.num_workers, loader.pin_memory, loader.prefetch_factor) == (14, True, 2)
    assert loader.persistent_workers
    one_worker = build_loader(Threads(), [0, 1], 2, _runtime("runtime.num_workers=1", "runtime.device=cpu"),
                              train=False)
    assert [int(value) for batch in one_worker for value in batch] == [1, 1]  # torch threads in a worker


def test_auto_is_a_gpu_where_torch_sees_one(monkeypatch: pytest.MonkeyPatch):
    assert device_type_of(_runtime("runtime.device=auto")) == "cpu"  # this machine: no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a stand-in for the one CUDA query
    assert device_type_of(_runtime("runtime.device=auto")) == "cuda"
    assert device_type_of(_runtime("runtime.device=cpu")) == "cpu"

"""Multi-node for real: the two namespace nodes of scripts/slurm_up.sh (n1 and n2, each its own network and UTS
namespace, partition `multi`) run 16 Gloo ranks, 8 per node, through the SLURM launcher and through torchrun."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deit_ablate.analysis.aggregate.reader import read_offline
from deit_ablate.record.rundir import (
    HYDRA_CONFIG,
    IDENTITY,
    LAST,
    LOG,
    RESULT,
    SUBMITIT,
    WANDB,
    RunDir,
    rank_log_name,
    runs_root,
    wandb_root,
)
from deit_ablate.run.validate import plan_batch
from tests.conftest import REPO, compose_config, run_train, tiny_with

NODES = ("n1", "n2")
TWO_NODES = ["hydra/launcher=slurm_8gpu", "hydra.launcher.partition=multi", "hydra.launcher.nodes=2",
             "hydra.launcher.cpus_per_task=2", "hydra.launcher.timeout_min=20"]
ONE_NODE_16 = ["hydra/launcher=slurm_8gpu", "hydra.launcher.tasks_per_node=16", "hydra.launcher.cpus_per_task=1",
               "hydra.launcher.timeout_min=20"]
# One update at the peak lr (no warm-up): AdamW's first step moves every weight by about lr = 2.5e-4 (4e-3 x 32 / 512)
# in the sign of its gradient, so a 1e-6 tolerance catches any gradient that differs (a rank on other data, a
# missing rank, a wrong average). The full recipe stays on: each rank's augmentation must match too.
FIRST_UPDATE = ["train.max_steps=1", "optimizer.warmup_epochs=0"]
TINY = tiny_with(2)  # 16 micro-batches of 2: one per rank of two nodes of 8
AUDIT = REPO / "tests" / "write_audit"


def on_two_nodes(test):
    """Mark a test for the two-node cluster: `slurm`, skipped only without sbatch, failing without partition multi."""
    no_sbatch = pytest.mark.skipif(shutil.which("sbatch") is None,
                                   reason="no sbatch: start the cluster with scripts/slurm_up.sh")
    return pytest.mark.slurm(no_sbatch(pytest.mark.usefixtures("two_node_partition")(test)))


@pytest.fixture(scope="module")
def two_node_partition():
    """The `multi` partition must be up wherever sbatch is: these tests fail, never skip, on a one-node cluster."""
    nodes = subprocess.run(["sinfo", "-h", "-p", "multi", "-o", "%N %T"], capture_output=True, text=True).stdout
    assert "n[1-2]" in nodes, f"no two-node partition `multi` ({nodes!r}): bring it up with scripts/slurm_up.sh"


def _audited(tmp_path: Path) -> dict[str, str]:
    """Environment that records every file each process writes under tmp_path/outputs (tests/write_audit)."""
    (tmp_path / "audit").mkdir()
    return {"PYTHONPATH": os.pathsep.join([str(AUDIT), os.environ.get("PYTHONPATH", "")]),
            "DEIT_WRITE_AUDIT": str(tmp_path / "audit"), "DEIT_WRITE_AUDIT_UNDER": str(tmp_path / "outputs")}


def _writes(tmp_path: Path) -> list[tuple[str, str, str, Path]]:
    """(rank, host, event, path) of every audited write."""
    rows = []
    for record in (tmp_path / "audit").glob("*.txt"):
        for line in record.read_text().splitlines():
            rank, host, event, path = line.split(" ", 3)
            rows.append((rank, host, event, Path(path)))
    return rows


def _run_folder(cwd: Path) -> Path:
    (folder,) = [p.parent for p in (runs_root(cwd / "outputs")).glob(f"*/{RESULT}")]
    return folder


def _first_update(cwd: Path) -> dict[str, torch.Tensor]:
    state = torch.load(RunDir(_run_folder(cwd)).last_checkpoint, weights_only=True)
    assert state["step"] == 1
    return state["model"]


def _assert_same_update(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.allclose(tensor, b[name], atol=1e-6, rtol=0), (name, (tensor - b[name]).abs().max().item())


def _assert_on_both_nodes(cwd: Path) -> None:
    result = json.loads(RunDir(_run_folder(cwd)).result.read_text())
    assert result["nodes"] == {"n1": list(range(8)), "n2": list(range(8, 16))}, result["nodes"]


@pytest.fixture(scope="module")
def one_node_update(tmp_path_factory, data_cache) -> dict[str, torch.Tensor]:
    """The reference: the same run as 16 ranks on one node."""
    cwd = tmp_path_factory.mktemp("one_node_16")
    run_train(["-m", *FIRST_UPDATE, *ONE_NODE_16, *TINY], cwd, data_cache, timeout=900)
    result = json.loads(RunDir(_run_folder(cwd)).result.read_text())
    assert result["nodes"] == {subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip():
                               list(range(16))}
    return _first_update(cwd)


@on_two_nodes
def test_two_nodes_make_the_first_update_of_16_ranks_on_one_and_only_rank_0_writes(tmp_path, data_cache,
                                                                                   one_node_update):
    proc = run_train(["-m", *FIRST_UPDATE, *TWO_NODES, *TINY], tmp_path, data_cache, extra_env=_audited(tmp_path),
                     timeout=900)
    logs = "\n".join(p.read_text() for p in (runs_root(tmp_path / "outputs") / SUBMITIT).rglob("*_log.out"))
    for rank in range(16):  # one process group of 16 over both nodes, each rank in its own node's namespace
        node, local = NODES[rank // 8], rank % 8
        assert f"[dist] rank {rank} of 16 (local rank {local} on {node}) joined the process group (gloo, cpu)" in logs
    assert "global batch 32 = 16 micro-batches of 2 (virtual slots), 1 per rank and step" in logs, proc.stdout[-2000:]
    _assert_on_both_nodes(tmp_path)
    _assert_same_update(_first_update(tmp_path), one_node_update)

    # One writer: global rank 0 writes the checkpoints, result.json, the run's .hydra/ files and the wandb run;
    # every other rank writes only its own log (and submitit its own result pickle).
    run_folder = _run_folder(tmp_path)
    writes = _writes(tmp_path)
    by_rank = {rank for rank, *_ in writes}
    assert {str(r) for r in range(16)} <= by_rank  # every rank was audited
    for rank, host, event, path in writes:
        if rank in ("0", "-"):
            continue
        assert host == NODES[int(rank) // 8]
        own = {run_folder / rank_log_name(rank)}
        assert path in own or path == run_folder or SUBMITIT in path.parts, (rank, host, event, path)
    rank0 = {path.name for rank, _, _, path in writes if rank == "0"}
    assert {LAST, RESULT, IDENTITY, HYDRA_CONFIG, LOG} <= rank0
    assert any(path.parts[-2:] == (WANDB, path.name) for rank, _, _, path in writes if rank == "0")
    runs = read_offline(wandb_root(tmp_path / "outputs"))
    assert len(runs) == 1 and runs[0].summary["world_size"] == 16


@on_two_nodes
def test_torchrun_across_two_namespaces_makes_the_same_first_update(tmp_path, data_cache, one_node_update):
    env = {**os.environ, "DEIT_ABLATE_CACHE": str(data_cache), "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=8",
                "--master_addr=n1", "--master_port=29561"]
    train = [str(REPO / "train.py"), *FIRST_UPDATE, *TINY]
    procs = []
    for node_rank, node in enumerate(NODES):  # the user's two machines: one torchrun per node, in its namespaces
        inner = " ".join([*torchrun, f"--node_rank={node_rank}", *train])
        command = ["nsenter", f"--net=/run/netns/deit-{node}", "unshare", "--uts", "sh", "-c",
                   f"hostname {node} && exec {inner}"]
        procs.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=600)[0])
        finally:
            proc.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert "(local rank 7 on n2) joined the process group" in outputs[1]
    _assert_on_both_nodes(tmp_path)
    _assert_same_update(_first_update(tmp_path), one_node_update)


def _task_pid(job_id: str, rank: int) -> int | None:
    """The pid of one task's Python process of a running job (all nodes share this machine's process table);
    not `srun`, which would forward a signal to every task."""
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            variables = dict(item.split("=", 1) for item in environ.read_text().split("\0") if "=" in item)
            argv = (environ.parent / "cmdline").read_text().split("\0")
        except OSError:
            continue
        if (variables.get("SLURM_JOB_ID") == job_id and variables.get("SLURM_PROCID") == str(rank)
                and "python" in Path(argv[0]).name and "submitit.core._submit" in argv):
            return int(environ.parent.name)
    return None


@on_two_nodes
def test_a_signalled_two_node_job_is_requeued_and_both_nodes_resume_to_the_same_step_count(tmp_path, data_cache):
    tiny = [o for o in TINY if o != "train.epochs=1"]
    args = ["-m", "runtime.checkpoint_every_steps=1", "train.epochs=4", *TWO_NODES, *tiny]
    env = {**os.environ, "DEIT_ABLATE_CACHE": str(data_cache), "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    runs = runs_root(tmp_path / "outputs")
    job_id, step_at_signal = None, 0
    try:
        deadline = time.time() + 600
        while time.time() < deadline and driver.poll() is None and not step_at_signal:
            found = list(runs.glob(f"*/{LAST}"))
            jobs = [p.name for p in (runs / SUBMITIT).glob("[0-9]*")] if (runs / SUBMITIT).exists() else []
            if found and jobs:
                job_id = jobs[0]
                try:
                    step = torch.load(found[0], weights_only=True)["step"]
                except Exception:  # being replaced right now
                    step = 0
                pid = _task_pid(job_id, 0) if step >= 3 else None
                if pid is not None:  # the preemption signal (USR2), to node n1's rank-0 task only
                    os.kill(pid, signal.SIGUSR2)
                    step_at_signal = step
            time.sleep(0.5)
        assert step_at_signal, "the two-node job never reached step 3"
        output, _ = driver.communicate(timeout=900)
    finally:
        driver.kill()
        if job_id:
            subprocess.run(["scancel", job_id], check=False)
    assert driver.returncode == 0, output[-5000:]
    folder = _run_folder(tmp_path)
    result = json.loads(RunDir(folder).result.read_text())
    steps_per_epoch = 8  # 300 images over 16 ranks (18 each, cut to whole batches of 2 ... 16) / 2 per rank
    assert result["status"] == "finished" and result["steps_done"] == 4 * steps_per_epoch
    assert result["nodes"] == {"n1": list(range(8)), "n2": list(range(8, 16))}
    submitit_log = "\n".join(p.read_text() for p in (runs / SUBMITIT).rglob("*_log.*"))
    assert "Caught signal SIGUSR2 on n1: this job is preempted" in submitit_log
    assert "Caught signal SIGUSR2 on n2" not in submitit_log  # one node's task only: rank 0 requeued the job
    assert f"Requeued job {job_id}" in submitit_log
    # Every rank of both nodes came back and resumed from the same checkpoint step.
    resumed = {}
    for rank in range(16):
        text = (folder / rank_log_name(rank)).read_text()
        steps = re.findall(r"\[run\] resuming .* step (\d+)", text)
        assert steps, f"rank {rank} did not resume"
        resumed[rank] = int(steps[-1])
    assert len(set(resumed.values())) == 1 and resumed[0] >= 3, resumed
    assert "(rank 15 on n2)" in (folder / rank_log_name(15)).read_text()
    runs_logged = read_offline(wandb_root(tmp_path / "outputs"))
    assert len({r.run_id for r in runs_logged}) == 1  # one wandb run across both attempts


def test_the_released_finetune_layout_splits_512_over_two_nodes_of_8():
    cfg = compose_config(["preset=paper", "stage=finetune", "data.root=/data/imagenet"])
    assert cfg.finetune.global_batch == 512
    plan = plan_batch(cfg, world_size=2 * 8)
    assert plan.per_rank_batch == 32  # the released command: --nodes 2, 8 GPUs, --batch-size 32


@on_two_nodes
def test_the_finetune_stage_runs_on_two_nodes_at_the_released_batch_layout(tmp_path, data_cache):
    # 1,600 images: 100 per rank, three batches of 32 per rank at the fine-tune's global batch of 512.
    data = ["data.builtin.train_per_class=160"]
    args = ["-m", "stage=pretrain,finetune", "train.max_steps=3", "finetune.global_batch=512", *TWO_NODES,
            *tiny_with(2, finetune_micro=32), *data]
    proc = run_train(args, tmp_path, data_cache, timeout=900)
    assert re.search(r"#1 : stage=finetune .* waits for job \d+", proc.stderr + proc.stdout, re.S)
    logs = "\n".join(p.read_text() for p in (runs_root(tmp_path / "outputs") / SUBMITIT).rglob("*_log.out"))
    assert re.search(r"finetune at 48px of deit_tiny_patch16_224 \(patch 8, width 32, depth 1, heads 2, [\d.]+ M "
                     r"params\) \(in eval mode\), world size 16, global batch 512 = 16 micro-batches of 32 "
                     r"\(virtual slots\), 1 per rank and step", logs)
    results = [json.loads(p.read_text()) for p in (runs_root(tmp_path / "outputs")).glob(f"*/{RESULT}")]
    assert len(results) == 2
    assert all(r["status"] == "finished" and r["steps_done"] == 3 and set(r["nodes"]) == set(NODES) for r in results)

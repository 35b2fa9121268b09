"""Stopping a run: SIGTERM (a scheduler's kill) and Ctrl-C on real train.py processes, and the evaluation size
checked before training. Marked `faults` (real signals to real subprocesses; run in CI by .ci/run)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deit_ablate.record.rundir import RunDir, runs_root, wandb_root
from tests.conftest import REPO, TINY, run_train

SLOW_EVAL = ["data.builtin.val_per_class=150", "runtime.eval_batch=1"]  # 1,500 single-image evaluations


def start(args: list[str], cwd: Path, cache: Path) -> subprocess.Popen:
    """train.py in the background, in its own session (a signal reaches it alone), outputs under `cwd`."""
    env = {**os.environ, "DEIT_ABLATE_CACHE": str(cache), "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_for(condition, timeout: float = 300.0, every: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)


def run_folder(cwd: Path) -> Path:
    folders = list((runs_root(cwd / "outputs")).glob("*-*"))
    return folders[0] if len(folders) == 1 else None


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def assert_one_line_stop(code: int, err: str, expected: int, signame: str) -> None:
    assert code == expected, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[run] ")]
    assert lines and lines[-1].startswith(f"stopped by {signame} at step "), err[-2000:]
    assert "the same command resumes it from" in lines[-1]


@pytest.mark.faults
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_epoch_saves_the_step_releases_the_lock_and_the_relaunch_finishes(tmp_path, data_cache, signum,
                                                                                       code):
    args = TINY + ["train.epochs=30"]  # 8 steps an epoch (256 of 300 images), 240 in all: seconds of training
    proc = start(args, tmp_path, data_cache)
    wait_for(lambda: run_folder(tmp_path) is not None and RunDir(run_folder(tmp_path)).metrics.exists())
    os.kill(proc.pid, signum)  # after epoch 0: mid-training
    returned, _, err = finish(proc)
    assert_one_line_stop(returned, err, code, signal.Signals(signum).name)
    folder = run_folder(tmp_path)
    state = torch.load(RunDir(folder).last_checkpoint, weights_only=True)
    stopped_at = int(err.split("at step ")[-1].split(";")[0])
    assert state["step"] == stopped_at >= 8  # the step it stopped at, saved: nothing trained is lost
    assert not RunDir(folder).lock.exists() and not RunDir(folder).result.exists()
    relaunch = run_train(args, tmp_path, data_cache)
    assert f"step {stopped_at}" in relaunch.stdout  # resumed there, not from the last epoch's end
    assert torch.load(RunDir(folder).last_checkpoint, weights_only=True)["step"] == 240


@pytest.mark.faults
def test_sigterm_during_evaluation_keeps_the_epoch_it_evaluates(tmp_path, data_cache):
    args = TINY + SLOW_EVAL + ["train.epochs=2"]
    proc = start(args, tmp_path, data_cache)
    wait_for(lambda: run_folder(tmp_path) is not None and RunDir(run_folder(tmp_path)).last_checkpoint.exists())
    os.kill(proc.pid, signal.SIGTERM)  # the epoch's end is saved; its evaluation is running
    returned, _, err = finish(proc)
    assert_one_line_stop(returned, err, 143, "SIGTERM")
    state = torch.load(RunDir(run_folder(tmp_path)).last_checkpoint, weights_only=True)
    assert (state["epoch"], state["step"], state["batches_done"]) == (1, 8, 0)  # epoch 0 whole, not lost
    relaunch = run_train(args, tmp_path, data_cache)
    assert "resuming" in relaunch.stdout and "epoch 2 (batch 0), step 8" in relaunch.stdout
    assert torch.load(RunDir(run_folder(tmp_path)).last_checkpoint, weights_only=True)["step"] == 16


@pytest.mark.faults
def test_a_second_ctrl_c_stops_at_once_with_one_line(tmp_path, data_cache):
    args = TINY + SLOW_EVAL + ["train.epochs=2"]
    proc = start(args, tmp_path, data_cache)
    wait_for(lambda: run_folder(tmp_path) is not None and RunDir(run_folder(tmp_path)).last_checkpoint.exists())
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # the first one waits for the evaluation to end
    os.kill(proc.pid, signal.SIGINT)  # still evaluating: the second one does not wait for the next step
    returned, _, err = finish(proc)
    assert returned == 130 and "Traceback" not in err, err[-3000:]
    assert "stopped at once (a second Ctrl-C)" in err
    folder = run_folder(tmp_path)
    assert not RunDir(folder).lock.exists()
    state = torch.load(RunDir(folder).last_checkpoint, weights_only=True)
    assert (state["epoch"], state["step"], state["evaluated"]) == (1, 8, False)
    relaunch = run_train(args, tmp_path, data_cache)  # evaluates epoch 1 first, then trains epoch 2
    assert re.search(r"\[epoch 1\] train loss [0-9.]+ \| val top-1", relaunch.stdout + relaunch.stderr)  # its row again
    assert torch.load(RunDir(folder).last_checkpoint, weights_only=True)["step"] == 16


@pytest.mark.slow
def test_an_eval_size_a_vit_cannot_take_is_refused_before_training(tmp_path, data_cache):
    proc = run_train(TINY + ["resolution.train_size=8"], tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "resolution.train_size=8 but resolution.eval_size=32" in proc.stderr
    assert "Set resolution.eval_size=8" in proc.stderr
    assert not list((tmp_path / "outputs").glob("runs/*"))  # nothing trained, nothing left
    run_train(TINY + ["resolution.train_size=8", "resolution.eval_size=8", "train.max_steps=1"], tmp_path,
              data_cache)  # the fix works


@pytest.mark.faults
def test_a_wandb_folder_removed_mid_run_is_noticed_and_logged_again(tmp_path, data_cache):
    import json
    import shutil

    from deit_ablate.analysis.aggregate.reader import read_offline

    args = TINY + ["train.epochs=6"]
    proc = start(args, tmp_path, data_cache)
    wait_for(lambda: run_folder(tmp_path) is not None and RunDir(run_folder(tmp_path)).metrics.exists())
    shutil.rmtree(wandb_root(tmp_path / "outputs"))  # while epoch 1 trains
    returned, out, err = finish(proc)
    assert returned == 0, err[-3000:]
    assert "was removed while the run trained: logged its result and epochs again" in out + err
    result = json.loads(RunDir(run_folder(tmp_path)).result.read_text())
    (run,) = read_offline(wandb_root(tmp_path / "outputs"), history=True)
    assert run.run_id == result["run_id"] and run.summary["top1"] == result["top1"]
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", run.config["git_commit"])  # the code that trained it
    assert [row["epoch"] for row in run.history] == list(range(6))  # every epoch, from metrics.csv

    shutil.rmtree(wandb_root(tmp_path / "outputs"))  # gone after the run: the relaunch logs it again
    relaunch = run_train(args, tmp_path, data_cache)
    assert "skipping" in relaunch.stdout
    assert "is missing: logged its result and epochs again" in relaunch.stdout + relaunch.stderr
    (again,) = read_offline(wandb_root(tmp_path / "outputs"))
    assert again.summary["top1"] == result["top1"] and again.summary["status"] == "finished"
    third = run_train(args, tmp_path, data_cache)
    assert "logged its result" not in third.stdout + third.stderr  # once is enough


# A signal to the whole process group (what `timeout`, SLURM at a time limit or preemption and systemd send; a
# terminal's Ctrl-C): the loader workers get it too. Each trial stops a run with 2 workers at one moment, then
# relaunches it to the end.
GROUP_ARGS = [o for o in TINY if not o.startswith("runtime.num_workers=")] + [
    "runtime.num_workers=2", "train.epochs=3", "runtime.checkpoint_every_steps=2"]
GROUP_SEED = int(os.environ.get("DEIT_FAULT_SEED", str(int(time.time()) % 100_000)))


def _checkpoint_temp(name: str) -> bool:
    return name.startswith(".checkpoint-last.pt.") and name.endswith(".tmp")


def _wait_alive(proc: subprocess.Popen, condition, timeout: float = 900.0) -> bool:
    """Wait for `condition` while `proc` runs; False when it ended first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return True


def _group_gone(pgid: int, timeout: float = 15.0) -> bool:
    """Whether every process of the group (loader workers, the wandb service) has ended within `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _stop_group_at(moment: str, rng, run_dir: Path, proc: subprocess.Popen) -> None:
    """Wait for `moment` of the run in `run_dir` (the trials' moments, below) plus a random delay."""
    from tests.test_faults import Watch

    folder = RunDir(run_dir)
    if moment == "imports":
        time.sleep(rng.uniform(0.2, 3.0))
    elif moment == "start-up":
        _wait_alive(proc, lambda: folder.log.exists())
        time.sleep(rng.uniform(0.0, 0.5))
    elif moment in ("first steps", "checkpoint write"):
        run_dir.mkdir(parents=True, exist_ok=True)
        watch = Watch(run_dir)
        try:
            watch.wait_for(proc, _checkpoint_temp, 1 if moment == "first steps" else rng.randint(2, 10))
        finally:
            watch.close()
        time.sleep(rng.uniform(0.0, 0.3) if moment == "first steps" else 0.0)
    elif moment in ("mid-training", "evaluation"):  # after epoch 0's row; after an epoch's end is saved
        done = folder.metrics if moment == "mid-training" else folder.last_checkpoint
        _wait_alive(proc, lambda: done.exists())
        time.sleep(rng.uniform(0.0, 0.6))
    os.killpg(proc.pid, signal.SIGTERM if moment != "ctrl-c" else signal.SIGINT)


@pytest.mark.faults
@pytest.mark.parametrize("moment", ["imports", "start-up", "first steps", "checkpoint write", "mid-training",
                                    "evaluation", "ctrl-c"])
def test_a_signal_to_the_process_group_stops_with_one_line_and_the_relaunch_finishes(tmp_path, data_cache, moment):
    import random

    rng = random.Random(GROUP_SEED * 100 + len(moment))
    args = GROUP_ARGS + (SLOW_EVAL if moment == "evaluation" else [])
    # Stopped after epoch 0's row: later epochs of 8 tiny steps take a tenth of a second, so the run gets more of
    # them for the signal to land in training, not after it (where a run finishes: docs/reliability.md)
    epochs = 12 if moment in ("mid-training", "ctrl-c") else 3
    args += [f"train.epochs={epochs}"]
    run_dir = runs_root(tmp_path / "outputs") / "run"
    args += [f"hydra.run.dir={run_dir}"]
    proc = start(args, tmp_path, data_cache)
    if moment == "ctrl-c":
        _wait_alive(proc, lambda: RunDir(run_dir).metrics.exists())
        time.sleep(rng.uniform(0.0, 0.6))
    _stop_group_at(moment, rng, run_dir, proc)
    returned, _, err = finish(proc)
    signame = "SIGINT" if moment == "ctrl-c" else "SIGTERM"
    where = f"{moment} (seed {GROUP_SEED})"
    assert "Traceback" not in err and "killed by signal" not in err, f"{where}:\n{err[-3000:]}"
    stop_lines = [line for line in err.splitlines() if line.startswith("stopped by ")]
    assert len(stop_lines) == 1 and stop_lines[0].startswith(f"stopped by {signame} "), f"{where}:\n{err[-3000:]}"
    assert returned == 128 + signal.Signals[signame].value, f"{where}: exit {returned}\n{err[-2000:]}"
    assert _group_gone(proc.pid), f"{where}: a process of the group outlived the run"  # workers, wandb service
    folder = RunDir(run_dir)
    assert not folder.lock.exists() and not folder.result.exists(), where
    if "nothing to save" in stop_lines[0]:
        assert not folder.last_checkpoint.exists(), where
        stopped_at = None
    else:
        stopped_at = int(stop_lines[0].split("at step ")[-1].split(";")[0])
        assert torch.load(folder.last_checkpoint, weights_only=True)["step"] == stopped_at, where
    relaunch = run_train(args, tmp_path, data_cache, check=False)
    assert relaunch.returncode == 0 and "Traceback" not in relaunch.stderr, f"{where}:\n{relaunch.stderr[-3000:]}"
    if stopped_at is not None:
        assert f"step {stopped_at}" in relaunch.stdout, where  # resumed where it stopped
    assert torch.load(folder.last_checkpoint, weights_only=True)["step"] == 8 * epochs, where
    assert '"status": "finished"' in folder.result.read_text(), where


@pytest.mark.faults
def test_loader_workers_killed_during_a_stop_end_as_the_stop(tmp_path, data_cache):
    args = [o for o in GROUP_ARGS if not o.startswith("runtime.checkpoint_every")] + SLOW_EVAL  # epoch ends only
    proc = start(args, tmp_path, data_cache)
    _wait_alive(proc, lambda: run_folder(tmp_path) is not None and
                RunDir(run_folder(tmp_path)).last_checkpoint.exists())
    os.killpg(proc.pid, signal.SIGTERM)  # epoch 0's end is saved, its evaluation runs on 2 workers
    time.sleep(0.5)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    workers = [pid for pid in children if "train.py" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert workers, children
    for pid in workers:  # killed anyway (SIGKILL, the OOM killer) while the stop waits for the evaluation's end
        os.kill(int(pid), signal.SIGKILL)
    returned, _, err = finish(proc)
    assert "Traceback" not in err and returned == 143, err[-3000:]  # it was torch's `DataLoader worker ... exited`
    stop_lines = [line for line in err.splitlines() if line.startswith("stopped by ")]
    assert len(stop_lines) == 1 and stop_lines[0].startswith("stopped by SIGTERM at step 8;"), err[-3000:]
    state = torch.load(RunDir(run_folder(tmp_path)).last_checkpoint, weights_only=True)
    assert (state["epoch"], state["step"], state["batches_done"]) == (1, 8, 0)


@pytest.mark.faults
def test_a_loader_worker_killed_with_no_stop_is_one_line_and_the_relaunch_resumes(tmp_path, data_cache):
    args = [o for o in TINY if not o.startswith("runtime.num_workers=")] + ["runtime.num_workers=2",
                                                                              "train.epochs=4"]
    proc = start(args, tmp_path, data_cache)
    assert _wait_alive(proc, lambda: run_folder(tmp_path) is not None and RunDir(run_folder(tmp_path)).metrics.exists())
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    workers = [pid for pid in children if "train.py" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert workers, children
    os.kill(int(workers[0]), signal.SIGKILL)  # what the kernel's out-of-memory killer does, with no stop asked
    returned, _, err = finish(proc)
    lines = [line for line in err.splitlines() if line.strip()]
    assert returned == 1 and "Traceback" not in err, err[-3000:]  # it was `DataLoader worker ... is killed by signal`
    assert re.fullmatch(rf"error: a loader worker \(pid {workers[0]}\) was killed by SIGKILL at step \d+, with no "
                        r"stop asked .* step \d+ is saved and the same command resumes the run from .*", lines[-1])
    stopped_at = int(lines[-1].split("at step ")[1].split(",")[0])
    folder = RunDir(run_folder(tmp_path))
    assert torch.load(folder.last_checkpoint, weights_only=True)["step"] == stopped_at >= 8
    assert not folder.lock.exists() and not folder.result.exists()
    relaunch = run_train(args, tmp_path, data_cache)
    assert f"step {stopped_at}" in relaunch.stdout and "Traceback" not in relaunch.stderr  # resumed there
    assert torch.load(folder.last_checkpoint, weights_only=True)["step"] == 32
    assert '"status": "finished"' in folder.result.read_text()


def test_a_worker_death_seen_first_as_a_reset_connection_is_named_once_the_worker_ends():
    """A killed worker's sockets close before it can be reaped: the training process may see the resource sharer's
    ConnectionResetError while the worker has no exit code yet (before: a traceback, in 1 of a few CI runs)."""
    import threading

    from deit_ablate.core.stopping import WorkerDeaths
    from deit_ablate.data.loader import build_loader, describe_lost_worker, end_workers
    from tests.conftest import compose_config

    runtime = compose_config(["runtime.num_workers=1"]).runtime
    data = torch.utils.data.TensorDataset(torch.arange(64.0))
    loader = build_loader(data, torch.utils.data.SequentialSampler(data), 4, runtime, train=False)
    try:
        with WorkerDeaths():  # as the run's loop holds it: torch's SIGCHLD error deferred to the step boundaries
            next(iter(loader))
            worker = loader._iterator._workers[0]
            threading.Timer(0.3, os.kill, (worker.pid, signal.SIGKILL)).start()
            assert describe_lost_worker(ConnectionResetError(104, "Connection reset by peer")) == \
                f"a loader worker (pid {worker.pid}) was killed by SIGKILL"
    finally:
        end_workers(loader)

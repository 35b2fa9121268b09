"""Fault injection on real train.py processes: kill -9 at random points (during a checkpoint write, between
the final checkpoint and result.json), an unreadable image, a truncated checkpoint, two launches of one run,
a full disk (a small tmpfs). Every relaunch must end with the same step count, one wandb id and a full result.

Marked `faults` (run in CI by .ci/run; about 3 minutes on 2 cores). DEIT_FAULT_TRIALS sets the number of
random kill trials (default 3), DEIT_FAULT_SEED their seed. Kill points are found with Linux inotify (a
checkpoint's temp file appearing) and a FIFO in place of result.json's temp file (the run blocks exactly
between its final checkpoint and its result); nothing in the trainer knows it is being tested.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deit_ablate.analysis.aggregate.reader import read_offline
from deit_ablate.data.builtin import ensure_builtin_dataset
from deit_ablate.record.rundir import LAST, PREV, RESULT, RunDir, runs_root, wandb_root
from deit_ablate.record.runlock import LOCK_NAME
from deit_ablate.record.tracking import read_epoch_rows
from tests.conftest import REPO, TINY, mounted_tmpfs, run_train

pytestmark = [pytest.mark.faults,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify and /proc: Linux only")]

EPOCHS, STEPS_PER_EPOCH = 3, 8
ARGS = TINY + [f"train.epochs={EPOCHS}", "runtime.checkpoint_every_steps=2"]
TRIALS = int(os.environ.get("DEIT_FAULT_TRIALS", "3"))
SEED = int(os.environ.get("DEIT_FAULT_SEED", str(int(time.time()) % 100_000)))
IN_CREATE, IN_MOVED_TO = 0x100, 0x80
SUMMARY: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def print_summary(request):
    """The trials and their outcomes, printed at the end of the module (shown even when output is captured)."""
    started = time.perf_counter()
    yield
    lines = [f"fault injection (seed {SEED}, {time.perf_counter() - started:.0f} s):", *SUMMARY]
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print("\n" + "\n".join(lines))


class Watch:
    """Linux inotify on one folder: the names created or renamed into it, as they happen."""

    def __init__(self, folder: Path) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or self.libc.inotify_add_watch(self.fd, str(folder).encode(), IN_CREATE | IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), "inotify")

    def names(self, timeout: float) -> list[str]:
        """Names seen within `timeout` seconds (empty when none)."""
        if not select.select([self.fd], [], [], timeout)[0]:
            return []
        data, names, offset = os.read(self.fd, 65536), [], 0
        while offset < len(data):
            _, _, _, length = struct.unpack_from("iIII", data, offset)
            names.append(data[offset + 16: offset + 16 + length].rstrip(b"\0").decode())
            offset += 16 + length
        return names

    def wait_for(self, proc: subprocess.Popen, match, count: int = 1, timeout: float = 120) -> bool:
        """Block until `count` names matching `match` appeared (False if the process ended or time ran out)."""
        deadline = time.monotonic() + timeout
        while count > 0 and time.monotonic() < deadline and proc.poll() is None:
            count -= sum(1 for name in self.names(0.5) if match(name))
        return count <= 0

    def close(self) -> None:
        os.close(self.fd)


def _env(cache: Path) -> dict:
    return {**os.environ, "DEIT_ABLATE_CACHE": str(cache), "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1"}


def launch(args: list[str], cwd: Path, cache: Path, stdout=subprocess.PIPE) -> subprocess.Popen:
    """train.py in its own process group (the wandb service with it), output kept for the checks."""
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=_env(cache),
                            stdout=stdout, stderr=subprocess.PIPE, text=True, start_new_session=True)


def kill9(proc: subprocess.Popen) -> None:
    """SIGKILL the whole process group, as a node or the OOM killer would, and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate(timeout=60)


def is_checkpoint_temp(name: str) -> bool:
    return name.startswith(f".{LAST}.") and name.endswith(".tmp")


def check_complete(cwd: Path, run_dir: Path, proc: subprocess.CompletedProcess) -> dict:
    """The relaunch finished the run: full step count, a full result, one wandb id, nothing half-written left."""
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads(RunDir(run_dir).result.read_text())
    assert result["status"] == "finished" and "top1" in result and "top5_final" in result, result
    assert (result["steps_done"], result["epochs_done"]) == (EPOCHS * STEPS_PER_EPOCH, EPOCHS), result
    state = torch.load(RunDir(run_dir).last_checkpoint, weights_only=True)
    assert state["step"] == EPOCHS * STEPS_PER_EPOCH and state["training_complete"]
    assert not list(run_dir.glob(".*.tmp")) and not (run_dir / LOCK_NAME).exists()
    runs = read_offline(wandb_root(cwd / "outputs"), warn=lambda message: None)  # killed logs are cut mid-record
    assert {r.run_id for r in runs} == {result["run_id"]}, [r.run_id for r in runs]
    assert any(r.summary.get("status") == "finished" and r.summary.get("top1") == result["top1"] for r in runs)
    return result


def killed_run(tmp_path: Path, cache: Path, name: str, kill_at: int, delay: float,
               args: list[str] | None = None) -> tuple[Path, str, bool]:
    """Launch, kill -9 at the `kill_at`-th checkpoint temp file plus `delay` s; (run folder, where, mid-write)."""
    run_dir = runs_root(tmp_path / name / "outputs") / "run"
    run_dir.mkdir(parents=True)
    watch = Watch(run_dir)
    proc = launch((args or ARGS) + [f"hydra.run.dir={run_dir}"], run_dir.parents[2], cache)
    try:
        reached = watch.wait_for(proc, is_checkpoint_temp, kill_at)
        time.sleep(delay)
    finally:
        kill9(proc)
        watch.close()
    mid_write = bool(list(run_dir.glob(f".{LAST}*.tmp")))
    where = f"checkpoint write #{kill_at} + {delay * 1000:.0f} ms" if reached else "after the run ended"
    return run_dir, where, mid_write


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The tiny built-in dataset, drawn once for the module."""
    cache = Path(os.environ.get("DEIT_ABLATE_CACHE") or tmp_path_factory.mktemp("cache"))
    ensure_builtin_dataset(cache / "builtin", 40, 30, 10, 0)
    return cache


@pytest.mark.parametrize("trial", range(TRIALS))
def test_kill_at_a_random_point_then_relaunch(tmp_path, cache, trial):
    rng = random.Random(SEED * 1000 + trial)
    during_write = trial < 2 or rng.random() < 0.3  # the first two trials kill inside a checkpoint write
    kill_at = rng.randint(3 if trial == 1 else 1, 14)  # trial 1 truncates the newest checkpoint: let two exist
    run_dir, where, mid_write = killed_run(tmp_path, cache, f"t{trial}", kill_at,
                                           0.0 if during_write else rng.uniform(0.0, 0.4))
    truncated = trial == 1 and RunDir(run_dir).last_checkpoint.exists()
    if truncated:  # and the newest checkpoint is damaged too: the relaunch falls back to the copy before it
        last = RunDir(run_dir).last_checkpoint
        last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    proc = run_train(ARGS + [f"hydra.run.dir={run_dir}"], run_dir.parents[2], cache, check=False)
    result = check_complete(run_dir.parents[2], run_dir, proc)
    if mid_write:
        assert "removed .checkpoint-" in proc.stdout  # the temp file of the write it cut
    if truncated and RunDir(run_dir).previous_checkpoint.exists():
        assert f"Falling back to {PREV}" in proc.stderr
    SUMMARY.append(f"  kill -9 at {where}{' (inside the write)' if mid_write else ''}"
                   f"{', checkpoint-last.pt then truncated' if truncated else ''} -> relaunch: "
                   f"{result['status']}, {result['steps_done']} steps, top-1 {result['top1']:.1f}, 1 wandb id")


def test_kill_between_the_final_checkpoint_and_the_result(tmp_path, cache):
    run_dir = runs_root(tmp_path / "outputs") / "run"
    run_dir.mkdir(parents=True)
    watch = Watch(run_dir)
    proc = launch(ARGS + [f"hydra.run.dir={run_dir}"], tmp_path, cache)
    try:
        assert watch.wait_for(proc, is_checkpoint_temp), "no checkpoint was written"
        # Once training runs (stale temp files are removed at the start), result.json's temp file becomes a
        # FIFO: writing the result blocks right after the final checkpoint, until the kill.
        os.mkfifo(run_dir / f".{RESULT}.tmp")
        deadline = time.monotonic() + 120
        while Path(f"/proc/{proc.pid}/wchan").read_text() != "wait_for_partner" and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        state = torch.load(RunDir(run_dir).last_checkpoint, weights_only=True)
        assert state["training_complete"] and not RunDir(run_dir).result.exists()
    finally:
        kill9(proc)
        watch.close()
    relaunch = run_train(ARGS + [f"hydra.run.dir={run_dir}"], tmp_path, cache, check=False)
    result = check_complete(tmp_path, run_dir, relaunch)
    assert "training was complete at step 24" in relaunch.stdout and f"removed .{RESULT}.tmp" in relaunch.stdout
    SUMMARY.append(f"  kill -9 between the final checkpoint and result.json -> relaunch evaluates: "
                   f"{result['status']}, {result['steps_done']} steps, top-1 {result['top1']:.1f}, 1 wandb id")


def test_unreadable_image_survives_a_kill(tmp_path, cache):
    root = tmp_path / "folder"
    shutil.copytree(ensure_builtin_dataset(cache / "builtin", 40, 30, 10, 0), root,
                    ignore=shutil.ignore_patterns("*.json"))
    for folder in (root / "train").iterdir():  # 270 + 1 images: 8 steps of 32 an epoch, as in the other trials
        for image in sorted(folder.iterdir())[:3]:
            image.unlink()
    bad = root / "train" / "ring" / "garbage.JPEG"
    bad.write_bytes(os.urandom(2000))
    # One copy per image, so an epoch reads all but its last 15 images (with repeated augmentation an epoch reads a
    # third of them, and whether the file is among them would depend on the seed's permutations)
    args = ["data=imagefolder", f"data.root={root}", "data.num_classes=10", "augment.repeated_aug=1"] + ARGS
    run_dir, where, _ = killed_run(tmp_path, cache, "img", 6, 0.1, args)
    proc = run_train(args + [f"hydra.run.dir={run_dir}"], run_dir.parents[2], cache, check=False)
    result = check_complete(run_dir.parents[2], run_dir, proc)
    assert result["data/bad_images"] == 1 and f"unreadable image {bad}" in RunDir(run_dir).log.read_text()
    SUMMARY.append(f"  unreadable JPEG, kill -9 at {where} -> relaunch: {result['steps_done']} steps, "
                   f"data/bad_images {result['data/bad_images']}, named in train.log")


def test_two_launches_of_one_run(tmp_path, cache):
    run_dir = runs_root(tmp_path / "outputs") / "run"
    run_dir.mkdir(parents=True)
    args = ARGS + [f"hydra.run.dir={run_dir}"]
    watch = Watch(run_dir)
    first = launch(args, tmp_path, cache)
    waiting_out = tmp_path / "waiting.out"
    try:
        assert watch.wait_for(first, lambda name: name == LOCK_NAME), "the first launch never took the lock"
        while not (run_dir / LOCK_NAME).read_text():  # created empty, then written (an empty lock is a live one)
            time.sleep(0.01)
        os.killpg(first.pid, signal.SIGSTOP)  # hold it there, lock taken, while two more launches start
        second = launch(args, tmp_path, cache)
        with open(waiting_out, "w") as out:
            waiting = launch(args + ["runtime.wait_for_lock=true"], tmp_path, cache, stdout=out)
        _, err = second.communicate(timeout=300)
        assert second.returncode == 1 and "Traceback" not in err, err[-3000:]
        assert f"is in use by another launch of the same run: pid {first.pid} on host" in err
        deadline = time.monotonic() + 300
        while "waiting for the run folder" not in waiting_out.read_text() and time.monotonic() < deadline:
            assert waiting.poll() is None, waiting.communicate()[1][-3000:]
            time.sleep(0.5)
    finally:
        os.killpg(first.pid, signal.SIGCONT)
        watch.close()
    first_out, first_err = first.communicate(timeout=300)
    _, wait_err = waiting.communicate(timeout=300)
    result = check_complete(tmp_path, run_dir, subprocess.CompletedProcess([], first.returncode, first_out, first_err))
    assert waiting.returncode == 0 and "already finished" in waiting_out.read_text(), wait_err[-3000:]
    assert len(list((wandb_root(tmp_path / "outputs")).glob("offline-run-*"))) == 1  # only the holder trained

    # Two launches started at the same moment: one trains, the other stops or finds it finished; never both.
    pair_dir = tmp_path / "pair"
    pair_dir.mkdir()
    pair = [launch(ARGS + ["hydra.run.dir=outputs/runs/run"], pair_dir, cache) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in pair]
    codes = sorted(p.returncode for p in pair)
    trained = [out for out, _ in outs if "status    finished after 24 steps" in out]
    assert len(trained) == 1 and codes in ([0, 0], [0, 1]), [err[-2000:] for _, err in outs]
    assert len(list((wandb_root(pair_dir / "outputs")).glob("offline-run-*"))) == 1
    SUMMARY.append(f"  two launches of one run: the second exits 1 naming the holder; with runtime.wait_for_lock it "
                   f"waits, then skips the finished run; started together: one trains (exit codes {codes}); "
                   f"{result['steps_done']} steps, 1 wandb id")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 700 KiB tmpfs (room for two checkpoints of the tiny model, not three), unmounted afterwards."""
    yield from mounted_tmpfs(tmp_path, "700k")


def test_disk_full_while_saving(tmp_path, cache, small_tmpfs):
    run_dir = small_tmpfs / "run"
    args = ARGS + [f"hydra.run.dir={run_dir}"]  # checkpoints on the tmpfs, wandb under ./outputs
    proc = run_train(args, tmp_path, cache, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"no space left on the device while writing {RunDir(run_dir).last_checkpoint}" in proc.stderr
    assert "free of" in proc.stderr and f"The previous {LAST} is intact" in proc.stderr
    kept = torch.load(RunDir(run_dir).last_checkpoint, weights_only=True)["step"]  # loadable
    assert 0 < kept < EPOCHS * STEPS_PER_EPOCH and not list(run_dir.glob(".*.tmp"))
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_tmpfs)], check=True)  # space freed
    relaunch = run_train(args, tmp_path, cache, check=False)
    assert f"step {kept}" in relaunch.stdout
    result = check_complete(tmp_path, run_dir, relaunch)
    SUMMARY.append(f"  disk full (700 KiB tmpfs) at step {kept + 2}: exit 1 with the path and free space, "
                   f"step {kept} kept -> relaunch after freeing space: {result['steps_done']} steps, 1 wandb id")


def test_disk_full_at_an_epochs_end_save_then_a_resume_logs_the_epochs_true_loss(tmp_path, cache, small_tmpfs):
    # 2 steps an epoch and a checkpoint every step: the epoch-end save of epoch 0 is the first write that needs a
    # third checkpoint-sized file (last, previous, its temp file), so the disk fills there and the relaunch resumes
    # from the mid-epoch checkpoint of the epoch's last batch: batch 2 of 2, no batch left to train.
    args = TINY + ["train.epochs=2", "train.global_batch=128", "runtime.checkpoint_every_steps=1"]
    run_dir = small_tmpfs / "run"
    proc = run_train(args + [f"hydra.run.dir={run_dir}"], tmp_path, cache, check=False)
    assert proc.returncode == 1 and f"while writing {RunDir(run_dir).last_checkpoint}" in proc.stderr, proc.stderr
    kept = torch.load(RunDir(run_dir).last_checkpoint, weights_only=True)
    assert (kept["epoch"], kept["batches_done"], kept["step"]) == (0, 2, 2)
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_tmpfs)], check=True)
    relaunch = run_train(args + [f"hydra.run.dir={run_dir}"], tmp_path, cache)
    assert "step 2" in relaunch.stdout
    straight = tmp_path / "straight"
    run_train(args + [f"hydra.run.dir={straight}"], tmp_path, cache)
    resumed, expected = (read_epoch_rows(RunDir(folder).metrics) for folder in (run_dir, straight))
    assert [row["epoch"] for row in resumed] == [0, 1]
    loss, true_loss = resumed[0]["train/epoch_loss"], expected[0]["train/epoch_loss"]
    assert loss == pytest.approx(true_loss, rel=1e-5), (loss, true_loss)  # it was logged as 0.0
    SUMMARY.append(f"  disk full at the epoch-end save, resumed at batch 2 of 2: epoch 0's train loss {loss:.4f} "
                   f"(straight run: {true_loss:.4f})")


def test_a_kill_after_an_evaluated_epoch_keeps_its_rows_for_the_aggregator(tmp_path, cache):
    proc = launch(ARGS, tmp_path, cache)  # the run folder under outputs/runs/<name>, where the reader looks for it
    deadline = time.monotonic() + 900
    folders: list[Path] = []
    while not (folders and RunDir(folders[0]).metrics.exists()):  # epoch 0 evaluated and logged
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        folders = list(runs_root(tmp_path / "outputs").glob("*-*"))
        time.sleep(0.01)
    kill9(proc)  # at once: wandb's service had no time to write the row it was just given
    (folder,) = folders
    run_id = RunDir(folder).read_identity()["run_id"]
    warnings: list[str] = []
    runs = read_offline(wandb_root(tmp_path / "outputs"), history=True, warn=warnings.append)
    assert [r.run_id for r in runs] == [run_id], warnings  # the killed launch's log holds its run
    assert [row["epoch"] for row in runs[0].history] == [0], runs[0].history
    assert runs[0].history[0]["val/top1"] == read_epoch_rows(RunDir(folder).metrics)[0]["val/top1"]
    SUMMARY.append(f"  kill -9 of the group right after epoch 0's row: the reader has the run and epoch 0 "
                   f"(top-1 {runs[0].history[0]['val/top1']:.1f}), {len(warnings)} warning(s) on the cut log")

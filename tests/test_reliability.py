"""Bad input and faults, one case each (issue 14): a clear message or a recovery, never a traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from deit_ablate.analysis.aggregate.reader import MAX_LOG_BYTES, read_offline
from deit_ablate.core.errors import ConfigError
from deit_ablate.data.bad_images import MAX_TRIES, BadImageError, DataGoneError, SkippingImageFolder, stop_error
from deit_ablate.data.builtin import ensure_builtin_dataset
from deit_ablate.record.rundir import LAST, PREV, UNREADABLE, RunDir, runs_root, wandb_root
from deit_ablate.record.runlock import LOCK_NAME, STALE_AFTER_S, RunLock, this_process
from deit_ablate.run.validate import validate_config
from deit_ablate.train.teacher import load_teacher
from tests.conftest import REPO, TINY, compose_config, run_train, two_epochs


def _no_run_left(cwd: Path, output_root: str = "outputs") -> bool:
    """No run folder and no wandb run under `output_root`: nothing was written for the run."""
    return not list((cwd / output_root).glob("runs/*")) and not list((cwd / output_root).glob("wandb/*run-*"))


@pytest.mark.parametrize(("override", "expected"), [
    ("optimizer.lr=-1", "optimizer.lr=-1.0 must be > 0"),
    ("optimizer.lr=0", "optimizer.lr=0.0 must be > 0"),
    ("runtime.eval_batch=0", "runtime.eval_batch=0 must be >= 1"),
    ("runtime.num_workers=-1", "runtime.num_workers=-1 must be >= 0"),
    ("train.epochs=0", "train.epochs=0 must be >= 1"),
    ("train.epochs=-3", "train.epochs=-3 must be >= 1"),
    ("finetune.epochs=0", "finetune.epochs=0 must be >= 1"),
    ("train.max_steps=0", "train.max_steps=0 must be >= 1"),
    ("runtime.tracking.project=../..", "runtime.tracking.project=../.. is not a safe name"),
    ("runtime.tracking.project=a/b", "runtime.tracking.project=a/b is not a safe name"),
    ("augment.auto_augment=rand-m9-mstd0.5-inc", "section 'inc' has no valid value for 'inc'"),
    ("augment.auto_augment=rand-m9-mstd0.5-inc2", "section 'inc2' has no valid value"),
    ("augment.auto_augment=rand-x9", "section 'x9' is not one of"),
    ("augment.auto_augment=rand-m9-tweight", "section 'tweight' names no transform set"),
    ("augment.auto_augment=randaugment", "'randaugment' is not a policy kind"),
    ("augment.auto_augment=original-m9", "section 'm9' is not one of mstd"),
])
def test_out_of_range_values_are_refused_naming_the_key(override, expected):
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config([override]))
    assert expected in str(error.value)


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5-inc1", "rand-m9-n3-mstd0.5", "rand-mstd1-tweights",
                                    "original", "v0r-mstd0.5", "3a", "augmix-m5-w4-d2", None])
def test_timm_policy_strings_pass(policy):
    validate_config(compose_config([f"augment.auto_augment={policy if policy else 'null'}"]))


@pytest.mark.parametrize(("override", "expected"), [  # the other values take the same path (checked above)
    ("runtime.tracking.project=../..", "runtime.tracking.project=../.. is not a safe name"),
    ("augment.auto_augment=rand-m9-mstd0.5-inc", "Expected rand-m<magnitude>[-n<ops>]"),
])
def test_bad_values_exit_2_with_one_line_and_leave_nothing(tmp_path, data_cache, override, expected):
    proc = run_train(TINY + [override], tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
    assert _no_run_left(tmp_path)


def test_imagefolder_split_without_class_folders_is_refused(tmp_path):
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(["data=imagefolder", f"data.root={tmp_path}", "data.num_classes=1"]))
    assert f"{tmp_path / 'train'} is not an ImageFolder split: it holds no class folder" in str(error.value)


def test_imagefolder_with_an_empty_class_folder_is_the_clear_data_root_error(tmp_path, data_cache):
    root = tmp_path / "data"
    for split in ("train", "val"):
        (root / split / "cat").mkdir(parents=True)
    (root / "val" / "cat" / "a.png").write_bytes(b"")
    proc = run_train(["data=imagefolder", f"data.root={root}", "data.num_classes=1"] + TINY, tmp_path, data_cache,
                     check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{root / 'train'} is not an ImageFolder split: its class folder(s) cat hold no image" in proc.stderr
    assert _no_run_left(tmp_path)


def _run_dir(cwd: Path) -> Path:
    (run_dir,) = [p for p in (runs_root(cwd / "outputs")).iterdir() if p.is_dir()]
    return run_dir


def _result(cwd: Path) -> dict:
    return json.loads(RunDir(_run_dir(cwd)).result.read_text())


def test_train_log_holds_the_start_line_every_epoch_the_summary_and_warnings(straight_runs):
    run = straight_runs(0)  # two epochs, optimizer.min_lr=0.5: min lr > peak, it warns
    proc, log = run.proc, (run.cwd / "straight" / "train.log").read_text()
    assert "pretrain at 32px" in log and "global batch 32 = 4 micro-batches of 8" in log  # the start line
    assert "[epoch 1] train loss" in log and "[epoch 2] train loss" in log
    assert "status    finished after 16 steps" in log and "top-1" in log
    assert "WARNING py.warnings" in log and "is above the peak lr" in log  # warnings reach the run's own log
    assert "status    finished after 16 steps" in proc.stdout and "[epoch 2]" in proc.stdout  # and the console


def test_epochs_done_counts_only_completed_epochs_after_max_steps(stopped_at_step_3):
    stopped, _ = stopped_at_step_3  # TINY (8 steps an epoch) stopped by train.max_steps=3
    result = json.loads((stopped.cwd / "run" / "result.json").read_text())
    assert (result["epochs_done"], result["steps_done"]) == (0, 3) and "top1" in result


def test_relaunch_after_the_final_checkpoint_evaluates_and_sums_train_seconds(tmp_path, data_cache, tiny_run):
    tiny_run.copy_into(tmp_path)  # TINY, trained once
    run_dir = _run_dir(tmp_path)
    first = json.loads(RunDir(run_dir).result.read_text())
    # What a kill between the final checkpoint and result.json leaves; earlier launches took 1000 s.
    RunDir(run_dir).result.unlink()
    state = torch.load(RunDir(run_dir).last_checkpoint, weights_only=True)
    assert state["training_complete"] and state["step"] == 8
    state["train_seconds"] = 1000.0
    torch.save(state, RunDir(run_dir).last_checkpoint)
    proc = run_train(TINY, tmp_path, data_cache)
    assert "training was complete at step 8" in proc.stdout
    result = json.loads(RunDir(run_dir).result.read_text())
    assert result["status"] == "finished" and (result["steps_done"], result["epochs_done"]) == (8, 1)
    assert result["top1"] == first["top1"] and result["top1_final"] == first["top1_final"]
    assert 1000.0 <= result["train_seconds"] < 1000.0 + 600
    runs = read_offline(wandb_root(tmp_path / "outputs"))
    assert len({r.run_id for r in runs}) == 1 and runs[-1].summary["top1"] == first["top1"]


@pytest.mark.slow
def test_damaged_result_json_is_named_and_the_run_resumes(tmp_path, data_cache, tiny_run):
    tiny_run.copy_into(tmp_path)  # TINY, trained once: 8 steps
    run_dir = _run_dir(tmp_path)
    for garbage in ("{not json", "[1, 2]"):
        RunDir(run_dir).result.write_text(garbage)
        proc = run_train(TINY, tmp_path, data_cache)
        assert "Traceback" not in proc.stderr
        assert f"{RunDir(run_dir).result} is not a run result" in proc.stderr
        assert "Treated as unfinished" in proc.stderr
        result = _result(tmp_path)
        assert result["status"] == "finished" and result["steps_done"] == 8 and "top1" in result


@pytest.mark.slow
def test_unreadable_last_checkpoint_falls_back_to_the_previous_copy(tmp_path, data_cache, straight_runs):
    run_dir = tmp_path / "straight"
    shutil.copytree(straight_runs(0).cwd / "straight", run_dir)  # two epochs, finished
    args = two_epochs(0) + [f"hydra.run.dir={run_dir}"]
    assert torch.load(RunDir(run_dir).previous_checkpoint, weights_only=True)["step"] == 8  # one older good copy
    RunDir(run_dir).result.unlink()
    last = RunDir(run_dir).last_checkpoint
    last.write_bytes(last.read_bytes()[:1000])  # truncated
    stale = run_dir / f".{LAST}.k1ll3d.tmp"  # what a writer killed mid-save leaves
    stale.write_bytes(b"\0" * 4096)
    proc = run_train(args, tmp_path, data_cache)
    assert "Traceback" not in proc.stderr
    assert f"{LAST} cannot be read" in proc.stderr and f"Falling back to {PREV}" in proc.stderr
    assert "epoch 2 (batch 0), step 8" in proc.stdout and not stale.exists()
    assert (run_dir / UNREADABLE.format(LAST)).exists()
    result = json.loads(RunDir(run_dir).result.read_text())
    assert (result["steps_done"], result["epochs_done"]) == (16, 2) and "top1" in result
    assert "cannot be read" in RunDir(run_dir).log.read_text()

    RunDir(run_dir).result.unlink()
    for name in (LAST, PREV):
        (run_dir / name).write_bytes(b"garbage")
    proc = run_train(args, tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot resume: no checkpoint there can be read" in proc.stderr
    assert f"rm '{RunDir(run_dir).last_checkpoint}' '{RunDir(run_dir).previous_checkpoint}'" in proc.stderr


def test_garbage_teacher_checkpoint_names_the_file_and_never_suggests_unsafe_loading(tmp_path):
    garbage = tmp_path / "teacher.pth"
    garbage.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(ConfigError) as error:
        load_teacher("resnet10t", garbage, 10)
    assert f"The teacher checkpoint {garbage} cannot be read" in str(error.value)
    assert "weights_only" not in str(error.value)


def _image_folder(data_cache: Path, target: Path) -> Path:
    """A copy of the tiny built-in set as a plain ImageFolder tree."""
    source = ensure_builtin_dataset(data_cache / "builtin", 40, 30, 10, 0)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.json"))
    return target



@pytest.mark.slow
def test_a_finished_run_is_not_skipped_after_its_val_images_are_rewritten_in_place(tmp_path, data_cache):
    from tests.test_fingerprint import age, rewrite_in_place

    root = _image_folder(data_cache, tmp_path / "folder")
    age(root)  # data that has settled: its fingerprint is cached
    args = ["data=imagefolder", f"data.root={root}", "data.num_classes=10", *TINY, "train.max_steps=1"]
    run_train(args, tmp_path, data_cache)
    first = _result(tmp_path)
    rewrite_in_place(sorted((root / "val").rglob("*.png")))  # other sizes, same inodes, folder mtimes untouched
    proc = run_train(args, tmp_path, data_cache, check=False)
    assert "skipping" not in proc.stdout, proc.stdout[-2000:]  # it skipped as finished, with the old data's result
    assert proc.returncode == 2 and "holds this experiment trained on other data" in proc.stderr, proc.stderr
    assert f"digest {first['data_fingerprint']['digest']}" in proc.stderr and "Traceback" not in proc.stderr
    assert first["status"] == "finished"

def test_unreadable_image_is_replaced_named_once_and_counted(tmp_path, data_cache):
    root = _image_folder(data_cache, tmp_path / "folder")
    bad = root / "train" / "disc" / "garbage.JPEG"
    bad.write_bytes(b"this is not a JPEG" * 50)
    args = ["data=imagefolder", f"data.root={root}", "data.num_classes=10"] + TINY + [
        "train.epochs=2", "runtime.num_workers=2"]  # found in a loader worker: the training process names and counts it
    proc = run_train(args, tmp_path, data_cache)
    assert "Traceback" not in proc.stderr
    result = _result(tmp_path)
    assert result["status"] == "finished" and result["data/bad_images"] == 1 and "top1" in result
    log = RunDir(_run_dir(tmp_path)).log.read_text()
    assert log.count(f"unreadable image {bad}") == 1  # named once, though read in both epochs
    assert (read_offline(wandb_root(tmp_path / "outputs"))[0].summary["data/bad_images"]) == 1

    proc = run_train(args + ["runtime.on_bad_image=fail", "runtime.output_root=failing"], tmp_path, data_cache,
                     check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{bad} cannot be read as an image" in proc.stderr and "runtime.on_bad_image=skip" in proc.stderr


def test_an_unreadable_image_under_ddp_stops_every_rank_with_one_line_each(tmp_path, data_cache):
    # runtime.on_bad_image=fail stops the rank that read the file; the other rank's collective then fails, and it
    # says so in one line instead of Gloo's traceback (torchrun's own summary of the failed children stays).
    root = _image_folder(data_cache, tmp_path / "folder")
    bad = root / "train" / "disc" / "garbage.JPEG"
    bad.write_bytes(b"this is not a JPEG" * 50)
    # One copy per image: the file is on one rank only (with repeated augmentation both ranks may read a copy)
    args = ["data=imagefolder", f"data.root={root}", "data.num_classes=10", "runtime.on_bad_image=fail",
            "augment.repeated_aug=1"] + TINY
    # torchrun kills the other worker once one has failed; checking on them every 5 s (not 0.1 s) leaves the other
    # rank the time to find its peer gone at its next collective even on a loaded machine, which is what is tested
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29535",
                "--monitor-interval=5", str(REPO / "train.py")]
    proc = run_train(args, tmp_path, data_cache, module=torchrun, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"error: {bad} cannot be read as an image" in output, output[-4000:]
    # how the lost peer shows depends on when the other rank meets it: closed, reset, or a broken pipe
    assert re.search(r"stopped because another rank left the process group mid-run \((Connection closed by peer|"
                     r"Connection reset by peer|Broken pipe)\)", output), output[-4000:]
    for ours in (REPO / "deit_ablate", REPO / "train.py"):  # no traceback through our code
        assert f'File "{ours}' not in output, output[-3000:]


def _lock_record(pid: int, host: str | None = None, **extra) -> str:
    record = {**this_process(), "pid": pid, "proc_start": None, "token": "theirs", **extra}
    if host is not None:
        record["host"] = host
    return json.dumps(record)


@pytest.fixture
def sleeper():
    """A live process on this host that is not this one."""
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def test_run_lock_is_held_by_a_live_process_and_taken_over_when_it_is_gone(tmp_path, sleeper):
    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text(_lock_record(sleeper.pid))
    holder = RunLock(tmp_path).try_acquire()
    assert holder is not None and f"pid {sleeper.pid} on host {socket.gethostname()}" in holder
    sleeper.kill()
    sleeper.wait()
    lock = RunLock(tmp_path)
    assert lock.try_acquire() is None and f"pid {sleeper.pid} is gone" in lock.taken_over[0]
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    lock.release()
    assert not lock_file.exists() and not list(tmp_path.iterdir())  # nothing left beside it either


def test_run_lock_from_another_host_counts_as_stale_only_when_not_refreshed(tmp_path):
    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text(_lock_record(1, host="elsewhere"))
    assert "on host elsewhere" in RunLock(tmp_path).try_acquire()
    old = time.time() - STALE_AFTER_S - 60
    os.utime(lock_file, (old, old))
    lock = RunLock(tmp_path)
    assert lock.try_acquire() is None and "not refreshed" in lock.taken_over[0]
    lock.release()


def test_run_lock_of_an_earlier_attempt_of_the_same_slurm_job_is_taken_over(tmp_path, monkeypatch):
    lock_file = tmp_path / LOCK_NAME
    lock_file.write_text(_lock_record(1, host="node7", slurm_job="4242", slurm_restart="0"))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert "SLURM job 4242" in RunLock(tmp_path).try_acquire()  # the same attempt: not ours to take
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the requeued attempt, maybe on another node
    lock = RunLock(tmp_path)
    assert lock.try_acquire() is None and "earlier attempt of SLURM job 4242" in lock.taken_over[0]
    lock.release()


def test_run_lock_release_leaves_a_lock_that_is_not_ours(tmp_path):
    lock = RunLock(tmp_path)
    assert lock.try_acquire() is None
    (tmp_path / LOCK_NAME).write_text(_lock_record(1, host="elsewhere"))  # taken over by another launch
    lock.release()
    assert (tmp_path / LOCK_NAME).exists()


def test_run_lock_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    # A launch killed while writing its lock record must not leave an empty lock (which would block the run for
    # STALE_AFTER_S): the record is written aside and linked into place, so the lock is complete when it exists.
    real_link = os.link
    seen = []

    def link(src, dst):
        real_link(src, dst)
        seen.append(json.loads(Path(dst).read_text()))

    monkeypatch.setattr(os, "link", link)
    lock = RunLock(tmp_path)
    assert lock.try_acquire() is None
    assert seen == [lock.me]  # complete at the instant it appeared
    assert [p.name for p in tmp_path.iterdir()] == [LOCK_NAME]  # no staged file left beside it
    lock.release()

    def killed_while_writing(*args, **kwargs):
        raise KeyboardInterrupt  # stands in for the kill: the process dies inside the write

    monkeypatch.setattr(json, "dumps", killed_while_writing)
    with pytest.raises(KeyboardInterrupt):
        RunLock(tmp_path).try_acquire()
    assert not list(tmp_path.iterdir())  # no lock, empty or not


def test_second_launch_of_a_running_run_names_the_holder_and_exits(tmp_path, data_cache, sleeper, tiny_run):
    tiny_run.copy_into(tmp_path)  # TINY, trained once
    run_dir = _run_dir(tmp_path)
    RunDir(run_dir).result.unlink()
    (run_dir / LOCK_NAME).write_text(_lock_record(sleeper.pid, proc_start=None))
    before = sorted(p.name for p in (wandb_root(tmp_path / "outputs")).iterdir())
    proc = run_train(TINY, tmp_path, data_cache, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"is in use by another launch of the same run: pid {sleeper.pid} on host" in proc.stderr
    assert "runtime.wait_for_lock=true" in proc.stderr and f"delete {run_dir / LOCK_NAME}" in proc.stderr
    assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == sleeper.pid  # untouched
    assert sorted(p.name for p in (wandb_root(tmp_path / "outputs")).iterdir()) == before  # no new wandb run
    assert not RunDir(run_dir).result.exists()


WANDB_WRITER = r"""
import os, sys
os.environ["WANDB_SILENT"] = "true"
import wandb
run = wandb.init(project="p", dir=sys.argv[1], mode="offline", id="real", config={"ablation": "baseline"},
                 settings=wandb.Settings(x_disable_stats=True, console="off", save_code=False, disable_git=True))
run.summary.update({"status": "finished", "top1": 50.0})
run.finish()
"""

READER = r"""
import json, sys
from deit_ablate.analysis.aggregate.reader import MAX_LOG_BYTES, read_offline
from deit_ablate.data.bad_images import MAX_TRIES, BadImageError, DataGoneError, SkippingImageFolder, stop_error
print(json.dumps([run.run_id for run in read_offline(sys.argv[1], jobs=1)]))
"""


def test_aggregator_reads_regular_files_only_and_reports_each_skipped_path(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline"}
    subprocess.run([sys.executable, "-c", WANDB_WRITER, str(tmp_path)], check=True, env=env, timeout=120)
    wandb_dir = wandb_root(tmp_path)
    (real,) = wandb_dir.glob("offline-run-*-real/run-real.wandb")
    outside = tmp_path / "outside" / "run-other.wandb"
    outside.parent.mkdir()
    shutil.copy(real, outside)
    planted = {}
    for name in ("fifo", "zero", "out", "huge"):
        folder = wandb_dir / f"offline-run-20260101_000000-{name}"
        folder.mkdir()
        planted[name] = folder / f"run-{name}.wandb"
    os.mkfifo(planted["fifo"])
    planted["zero"].symlink_to("/dev/zero")
    planted["out"].symlink_to(outside)
    with open(planted["huge"], "wb") as handle:  # sparse: no disk space used
        handle.truncate(MAX_LOG_BYTES + 1)
    proc = subprocess.run([sys.executable, "-c", READER, str(wandb_dir)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["real"]
    assert f"{planted['fifo']}: skipped, not a regular file" in proc.stderr
    assert f"{planted['zero']}: skipped, a symlink to /dev/zero, outside {wandb_dir.resolve()}" in proc.stderr
    assert f"{planted['out']}: skipped, a symlink to {outside.resolve()}, outside" in proc.stderr
    assert f"{planted['huge']}: skipped, {MAX_LOG_BYTES + 1} bytes, above the" in proc.stderr


PAUSE = REPO / "tests" / "pause_at_open"


@pytest.mark.slow
def test_the_builtin_cache_removed_mid_run_is_named_and_a_relaunch_draws_it_again(tmp_path, data_cache):
    """#26 point 10: the run paused at its first image read (tests/pause_at_open), its built-in cache deleted, then
    let go: it must say what happened, not blame runtime.on_bad_image=fail while skip is in effect."""
    cache = tmp_path / "cache"
    shutil.copytree(ensure_builtin_dataset(data_cache / "builtin", 40, 30, 10, 0).parent, cache / "builtin")
    drawn = ensure_builtin_dataset(cache / "builtin", 40, 30, 10, 0)
    pause = tmp_path / "pause"
    pause.mkdir()
    env = {**os.environ, "DEIT_ABLATE_CACHE": str(cache), "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(PAUSE), "DEIT_PAUSE_UNDER": str(drawn / "train"),
           "DEIT_PAUSE_DIR": str(pause)}
    args = TINY + ["train.epochs=2"]
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not (pause / "ready").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (pause / "ready").exists(), "the run never read an image"
        shutil.rmtree(cache)
        (pause / "go").touch()
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert f"the files under {drawn} are gone: the built-in cache was removed while the run used it" in err
    assert "on_bad_image" not in err and "unreadable image" not in err + out
    proc = run_train(args, tmp_path, cache)  # the same command draws it again and trains the run to its end
    assert "drawing the built-in dataset" in proc.stdout and _result(tmp_path)["steps_done"] == 16


def test_a_vanished_split_stops_at_once_and_too_many_bad_images_under_skip_do_not_blame_fail(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    for i in range(3):
        Image.new("L", (4, 4)).save(tmp_path / "train" / "a" / f"{i}.png")
    dataset = SkippingImageFolder(str(tmp_path / "train"))
    shutil.rmtree(tmp_path / "train")
    with pytest.raises(DataGoneError):
        dataset[0]
    assert not dataset.bad_paths()  # nothing counted as an unreadable image
    assert str(stop_error([dataset])).startswith(f"the files under {tmp_path} are gone: it was moved or deleted")

    (tmp_path / "train" / "a").mkdir(parents=True)
    for i in range(MAX_TRIES + 1):
        (tmp_path / "train" / "a" / f"{i:03d}.png").write_bytes(b"not a PNG")
    dataset = SkippingImageFolder(str(tmp_path / "train"), "skip")
    with pytest.raises(BadImageError):
        dataset[0]
    error = str(stop_error([dataset]))
    assert f"{MAX_TRIES} images in a row under {tmp_path / 'train'} cannot be read" in error
    assert "too many for runtime.on_bad_image=skip to replace" in error and "=fail" not in error

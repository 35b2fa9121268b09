"""The run folder's layout is rundir's alone; one atomic write; one name per value in identity.json and result.json
(folders written with the old names still resume, skip and replay their result)."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
import yaml

from deit_ablate.analysis.aggregate.reader import read_offline
from deit_ablate.core import atomic
from deit_ablate.core.errors import ConfigError, RunError
from deit_ablate.record import checkpoint as ckpt
from deit_ablate.record import rundir
from deit_ablate.record.identity import RunIdentity
from deit_ablate.record.rundir import RunDir, rank_log_name, runs_root, wandb_root
from tests.conftest import CONF, REPO, TINY, compose_config, run_train

IDENTITY = RunIdentity(name="model=x-0123456789", run_id="abcdef0123456789", group="g", digest="0123456789")
DATA = {"digest": "feedfacefeedface", "classes": 10}


def _old_identity(data: dict) -> dict:
    """identity.json as runs before the renaming wrote it."""
    return {"name": IDENTITY.name, "run_id": IDENTITY.run_id, "digest": IDENTITY.digest, "data": data}


class Boom(Exception):
    pass


class Unpicklable:
    def __reduce__(self):
        raise Boom


def _fail_midway(handle) -> None:
    handle.write(b"half of the new ")
    raise Boom


@pytest.mark.parametrize("how", ["unique temp", "named temp", "keep previous"])
def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temp_file(tmp_path, how):
    target = tmp_path / "file.json"
    target.write_text("old")
    options = {"named temp": {"temp": tmp_path / ".file.json.tmp"},
               "keep previous": {"keep_previous": tmp_path / "file.prev"}}.get(how, {})
    with pytest.raises(Boom):
        atomic.atomic_write(target, _fail_midway, **options)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.json"]  # no temp file, nothing set aside


def test_a_full_disk_is_named_with_the_old_file_intact(tmp_path):
    target = tmp_path / "result.json"
    target.write_text("old")

    def full(handle) -> None:
        handle.write(b"x" * 2048)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(RunError, match=r"no space left on the device while writing .*result.json \(the write stopped "
                                       r"at 2.0 KiB\).*previous result.json is intact"):
        atomic.atomic_write(target, full)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_writes_replace_whole_files_and_keep_the_previous_copy(tmp_path):
    target = tmp_path / "checkpoint-last.pt"
    atomic.write_text_atomic(target, "one")
    atomic.write_bytes_atomic(target, b"two", keep_previous=tmp_path / "checkpoint-prev.pt")
    assert target.read_text() == "two" and (tmp_path / "checkpoint-prev.pt").read_text() == "one"
    atomic.write_json_atomic(target, {"a": 1}, indent=None)
    assert target.read_text() == '{"a": 1}' and len(list(tmp_path.iterdir())) == 2


def test_an_exclusive_write_never_replaces_and_leaves_no_temp_file(tmp_path):
    target = tmp_path / "run.lock"
    atomic.write_text_atomic(target, "mine", exclusive=True)
    with pytest.raises(FileExistsError):
        atomic.write_text_atomic(target, "theirs", exclusive=True)
    assert target.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["run.lock"]


def test_a_pipe_or_device_is_written_through_never_replaced(tmp_path):
    # `--out /dev/null` as root: a rename onto it would replace the device with a regular file (a FIFO stands in)
    import os
    import stat
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    atomic.write_text_atomic(fifo, "table")
    reader.join(timeout=10)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and received == [b"table"]
    assert list(tmp_path.iterdir()) == [fifo]  # no temp file beside it


def test_a_folder_is_made_whole_or_not_at_all(tmp_path):
    target = tmp_path / "set"

    def fill(staging: Path) -> None:
        (staging / "a").write_text("a")
        raise Boom

    with pytest.raises(Boom):
        atomic.atomic_folder(target, fill, complete=lambda: False)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its staging folder
    target.mkdir()
    (target / "half").write_text("")  # an earlier attempt's incomplete folder is replaced
    atomic.atomic_folder(target, lambda staging: (staging / "done").write_text("1"),
                         complete=lambda: (target / "done").exists())
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["done", "set"]


def test_a_checkpoint_save_that_fails_leaves_the_last_one(tmp_path):
    run = RunDir(tmp_path)
    ckpt.save_atomic({"step": 1}, run.last_checkpoint)
    with pytest.raises(Boom):
        ckpt.save_atomic({"step": 2, "bad": Unpicklable()}, run.last_checkpoint, keep_previous=run.previous_checkpoint)
    assert ckpt.load(run.last_checkpoint)["step"] == 1 and not run.previous_checkpoint.exists()
    assert [p.name for p in tmp_path.iterdir()] == [rundir.LAST]


def test_stale_temp_files_are_those_of_the_atomic_files_never_the_lock_being_staged(tmp_path):
    run = RunDir(tmp_path)
    stale = [f".{rundir.LAST}.k1ll3d.tmp", f".{rundir.RESULT}.tmp", f".{rundir.METRICS}.x1.tmp",
             f".{rundir.IDENTITY}.tmp"]
    kept = [f".{rundir.LOCK}.abc.tmp", rundir.LAST, "notes.tmp"]
    for name in stale + kept:
        (tmp_path / name).write_text("x")
    assert sorted(p.name for p in run.stale_temp_files()) == sorted(stale)
    assert sorted(p.name for p in ckpt.remove_stale_temp_files(tmp_path)) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    assert run.temp_for(run.result).name == f".{rundir.RESULT}.tmp"  # what a kill between checkpoint and result leaves


def test_the_roots_and_the_names_come_from_rundir(tmp_path):
    assert runs_root(tmp_path) == tmp_path / rundir.RUNS and wandb_root(tmp_path) == tmp_path / rundir.WANDB
    run = RunDir.under(tmp_path, "r")
    assert run.path == runs_root(tmp_path) / "r" and run.hydra_config == run.path / ".hydra" / "config.yaml"
    assert run.rank_log(0) == run.log and rank_log_name(0) == rundir.LOG and rank_log_name(3) == "train-rank3.log"
    (run.path / rundir.HYDRA).mkdir(parents=True)
    run.rank_log(2).write_text("")
    run.discard_if_empty()
    assert not run.path.exists()  # only Hydra's files and its logs: nothing of its own


def test_hydra_writes_the_run_folders_under_rundirs_runs_root():
    """conf/config.yaml spells the runs/ root for Hydra (a YAML interpolation); it must agree with RunDir's."""
    hydra = yaml.safe_load((CONF / "config.yaml").read_text())["hydra"]
    assert hydra["run"]["dir"] == f"${{runtime.output_root}}/{rundir.RUNS}/${{run_name:}}"
    assert hydra["sweep"]["dir"] == f"${{runtime.output_root}}/{rundir.RUNS}"


LITERALS = re.compile(r"""["'](checkpoint-(last|prev|best)\.pt|result\.json|identity\.json|metrics\.csv|run\.lock|"""
                      r"""train\.log|predictions\.npz|runs|wandb)["']""")


# Modules whose "wandb" is the Python package's name, not the run folder's wandb/ (core/imports.py keeps it out of timm)
NAMES_A_MODULE = ("imports.py",)


def test_no_other_module_spells_a_run_folder_name():
    spelled = []
    code = [REPO / "train.py"] + [path for folder in ("deit_ablate", "hydra_plugins", "scripts")
                                  for path in sorted((REPO / folder).rglob("*.py"))]
    for path in code:
        if path.name == "rundir.py" or path.name in NAMES_A_MODULE:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if LITERALS.search(line) and not re.search(r"[\"']runs[\"']\s*:|\[[\"']runs[\"']\]", line):  # a key
                spelled.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert spelled == []


def test_identity_and_result_name_each_value_once(tmp_path):
    run = RunDir(tmp_path)
    run.record_identity(IDENTITY, DATA)
    run.record_identity(IDENTITY, {"digest": "other"})  # once: the first record stays
    written = json.loads(run.identity.read_text())
    assert written == {"name": IDENTITY.name, "run_id": IDENTITY.run_id, "experiment_digest": IDENTITY.digest,
                       "data_fingerprint": DATA}
    run.record_result(IDENTITY, DATA, {"status": "finished", "top1": 50.0})
    result = json.loads(run.result.read_text())
    assert result["experiment_digest"] == written["experiment_digest"] and result["data_fingerprint"] == DATA
    assert "digest" not in result and "data" not in result and "digest" not in written and "data" not in written
    assert run.read_summary() == {"status": "finished", "top1": 50.0}


def test_a_teacher_is_recorded_and_its_own_digest_keeps_its_name(tmp_path):
    run = RunDir(tmp_path)
    teacher = {"run": "t", "digest": "a" * 40}
    run.record_identity(RunIdentity(IDENTITY.name, IDENTITY.run_id, IDENTITY.group, IDENTITY.digest, teacher), DATA)
    assert run.read_identity()["teacher"] == teacher and run.read_identity()["experiment_digest"] == IDENTITY.digest


def test_old_names_are_read_as_the_new_ones(tmp_path):
    run = RunDir(tmp_path)
    run.identity.write_text(json.dumps(_old_identity(DATA)))
    assert run.read_identity() == {"name": IDENTITY.name, "run_id": IDENTITY.run_id,
                                   "experiment_digest": IDENTITY.digest, "data_fingerprint": DATA}
    assert run.recorded_data() == DATA
    run.write_identity(_old_identity(DATA))  # a payload in the old names is written in the new ones
    assert set(json.loads(run.identity.read_text())) == {"name", "run_id", "experiment_digest", "data_fingerprint"}


def _old_folder(tmp_path: Path, data: dict) -> RunDir:
    """A finished run's folder as runs before the renaming left it."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.identity.write_text(json.dumps(_old_identity(data)))
    run.result.write_text(json.dumps({"run_id": IDENTITY.run_id, "name": IDENTITY.name, "status": "finished",
                                      "top1": 12.5, "experiment_digest": IDENTITY.digest, "data_fingerprint": data}))
    return run


def test_a_folder_with_the_old_names_skips_and_still_refuses_other_data(tmp_path):
    from deit_ablate.core.distributed import DistInfo
    from deit_ablate.data.datasets import data_fingerprint
    from deit_ablate.run.lifecycle import launch_plan
    from deit_ablate.run.plan import data_identity, make_plan

    cfg = compose_config(TINY + [f"runtime.output_root={tmp_path}"])
    current = data_fingerprint(cfg.data)
    run = _old_folder(tmp_path, current)
    assert data_identity(cfg, run) == current  # the same data: the run is this one
    assert launch_plan(make_plan(cfg, DistInfo(), run, [])) == "skip (already finished)"
    assert run.read_summary() == {"status": "finished", "top1": 12.5}  # what a lost wandb log is replayed from
    (tmp_path / "o").mkdir()
    other = _old_folder(tmp_path / "o", {**current, "digest": "0" * 16})
    with pytest.raises(ConfigError, match="other data"):
        data_identity(cfg, other)


@pytest.mark.slow
def test_a_trained_folder_with_the_old_names_resumes_skips_and_aggregates(tmp_path, data_cache):
    run_train(TINY, tmp_path, data_cache)
    [run] = [RunDir(p) for p in runs_root(tmp_path / "outputs").iterdir() if p.is_dir()]
    recorded = json.loads(run.identity.read_text())
    old = {**{k: v for k, v in recorded.items() if k not in ("experiment_digest", "data_fingerprint")},
           "digest": recorded["experiment_digest"], "data": recorded["data_fingerprint"]}
    run.identity.write_text(json.dumps(old))  # identity.json as runs before the renaming wrote it
    run.result.unlink()  # what a kill between the final checkpoint and result.json leaves: the relaunch resumes
    proc = run_train(TINY, tmp_path, data_cache)
    assert "training was complete at step" in proc.stdout and "other data" not in proc.stderr
    result = run.read_result()
    assert result["status"] == "finished" and result["run_id"] == recorded["run_id"]
    assert json.loads(run.identity.read_text()) == old  # written once, when the run first trained
    assert "already finished" in run_train(TINY, tmp_path, data_cache).stdout
    logged = read_offline(wandb_root(tmp_path / "outputs"), warn=lambda message: None)
    assert {r.run_id for r in logged} == {recorded["run_id"]}
    assert any(r.summary.get("status") == "finished" and r.summary.get("top1") == result["top1"] for r in logged)


def test_a_later_launch_keeps_the_first_launchs_hydra_records_and_is_noted_beside(tmp_path):
    # A shared pre-training (ablation=baseline and sgd_finetune's) resumed by the second row's launch: its .hydra/
    # files were rewritten with that row's overrides; they say how the run was first made, the resume is noted beside.
    run = RunDir(tmp_path / "run")
    run.record_launch("seed: 0\n", "hydra: {}\n", "- ablation=baseline\n", at="t0")
    run.record_launch("seed: 0\n", "hydra: {row: 2}\n", "- ablation=sgd_finetune\n- seed=0\n", at="t1")
    run.record_launch("seed: 0\n", None, None, at="t2")  # a launch without Hydra
    assert run.hydra_overrides.read_text() == "- ablation=baseline\n"
    assert run.hydra_settings.read_text() == "hydra: {}\n"
    later = yaml.safe_load(run.hydra_later.read_text())
    assert later == [{"at": "t1", "overrides": ["ablation=sgd_finetune", "seed=0"]}, {"at": "t2", "overrides": []}]


def test_the_first_launch_writes_what_an_interrupted_first_launch_left_unwritten(tmp_path):
    run = RunDir(tmp_path / "run")
    run.record_launch("seed: 0\n", None, None)  # its overrides never written
    run.record_launch("seed: 0\n", "hydra: {}\n", "- seed=0\n")
    assert run.hydra_overrides.read_text() == "- seed=0\n" and run.hydra_settings.exists()

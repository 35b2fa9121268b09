"""Run folders with a damaged file (issue 46, points 11 and 12): `deit-status` shows such a run as one `damaged` row
naming the file and its problem, the other rows as they are (--json too), and a relaunch of the run ends with one
error line naming the file and the fix; neither ends in a traceback, nor waits on a FIFO where a file belongs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from deit_ablate.analysis.status.cli import main
from deit_ablate.record.rundir import RunDir, runs_root
from tests.conftest import REPO, TINY, run_train


def set_json(path: Path, **values) -> None:
    """Set `values` in the JSON file `path` (json.dumps writes Infinity and NaN as a hand edit could)."""
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def a_folder(path: Path) -> None:
    """Put a folder where the file `path` is."""
    path.unlink()
    path.mkdir()


def a_fifo(path: Path) -> None:
    """Put a FIFO where the file `path` is: a reader that opens it waits for a writer that never comes."""
    path.unlink()
    os.mkfifo(path)


def stopped(run: RunDir) -> RunDir:
    """The finished run made a stopped one (no result.json, progress.json says stopped), whose progress is shown."""
    run.result.unlink()
    set_json(run.progress, state="stopped")
    return run


def no_result(run: RunDir) -> RunDir:
    run.result.unlink()
    return run


@dataclass(frozen=True)
class Damage:
    """One damaged run folder: what is done to a copy of a finished run, and the detail its status row says."""

    name: str
    damage: Callable[[RunDir], object]
    detail: str


DAMAGES = [
    Damage("progress_epoch_infinity", lambda r: set_json(stopped(r).progress, epoch=float("inf")),
           "progress.json: epoch is inf, not a finite number"),
    Damage("progress_step_nan", lambda r: set_json(stopped(r).progress, step=float("nan")),
           "progress.json: step is nan, not a finite number"),
    Damage("progress_elapsed_infinity", lambda r: set_json(stopped(r).progress, elapsed_s=float("inf")),
           "progress.json: elapsed_s is inf, not a finite number"),
    Damage("progress_epoch_a_string", lambda r: set_json(stopped(r).progress, epoch="abc"),
           "progress.json: epoch is 'abc', not a number"),
    Damage("progress_step_a_string", lambda r: set_json(stopped(r).progress, step="abc"),
           "progress.json: step is 'abc', not a number"),
    Damage("progress_a_list", lambda r: stopped(r).progress.write_text("[1, 2]"),
           "progress.json: a list, not a progress record"),
    Damage("result_seconds_infinity", lambda r: set_json(r.result, train_seconds=float("inf")),
           "result.json: train_seconds is inf, not a finite number"),
    Damage("result_seconds_nan", lambda r: set_json(r.result, train_seconds=float("nan")),
           "result.json: train_seconds is nan, not a finite number"),
    Damage("result_top1_a_string", lambda r: set_json(r.result, top1="abc"),
           "result.json: top1 is 'abc', not a number"),
    Damage("result_a_folder", lambda r: a_folder(r.result), "result.json: a folder, not a file"),
    Damage("hydra_config_a_list", lambda r: r.hydra_config.write_text("- stage\n- seed\n"),
           ".hydra/config.yaml: a list, not a mapping"),
    Damage("hydra_a_file_not_a_folder", lambda r: (shutil.rmtree(r.hydra), r.hydra.write_text("x")),
           ".hydra: a file, not a folder"),
    Damage("checkpoint_cut_short", lambda r: no_result(r).last_checkpoint.write_bytes(b"PK\x03\x04 cut short"),
           "checkpoint-last.pt: not a whole zip archive"),
    Damage("checkpoint_a_fifo", lambda r: a_fifo(no_result(r).last_checkpoint),
           "checkpoint-last.pt: a FIFO (named pipe), not a file"),
]


def damaged_root(tiny_run, tmp_path: Path, damage: Callable[[RunDir], object]) -> Path:
    """An output root holding a copy of the tiny finished run, damaged, and a good copy (`good`) beside it."""
    runs = runs_root(tmp_path / "outputs")
    shutil.copytree(tiny_run.run_dir(), runs / "damaged")
    shutil.copytree(tiny_run.run_dir(), runs / "good")
    damage(RunDir(runs / "damaged"))
    return runs.parent


def no_constant(name: str):
    raise AssertionError(f"--json printed {name}, which is not JSON")


def status_subprocess(root: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m deit_ablate.status ROOT ARGS` in its own process (a FIFO that blocks it cannot hang the tests)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "deit_ablate.status", str(root), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)


@pytest.mark.parametrize("case", DAMAGES, ids=lambda c: c.name)
def test_a_damaged_run_is_one_row_naming_the_file_and_the_rest_stands(case, tiny_run, tmp_path, capsys):
    root = damaged_root(tiny_run, tmp_path, case.damage)
    if "fifo" in case.name:  # before the fix the status waited on it forever: its own process, with a timeout
        done = status_subprocess(root, "--json")
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
        printed, table_text = done.stdout, status_subprocess(root).stdout
    else:
        capsys.readouterr()
        assert main([str(root), "--json"]) == 0
        printed = capsys.readouterr().out
        assert main([str(root)]) == 0
        table_text = capsys.readouterr().out
    report = json.loads(printed, parse_constant=no_constant)  # strict JSON: no NaN or Infinity in it
    rows = {r["run"]: r for r in report["runs"]}
    assert rows["damaged"]["state"] == "damaged", rows["damaged"]
    assert rows["damaged"]["detail"].startswith(case.detail), rows["damaged"]
    assert rows["good"]["state"] == "finished" and rows["good"]["last_top1"] is not None, rows["good"]
    assert report["totals"]["states"] == {"damaged": 1, "finished": 1}
    assert "│ damaged" in table_text and "2 runs: 1 damaged, 1 finished" in table_text  # the table, whole


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a folder of mode 000 (.hydra_a_file_not_a_folder stands in)")
def test_an_unreadable_run_folder_is_one_damaged_row(tiny_run, tmp_path, capsys):
    root = damaged_root(tiny_run, tmp_path, lambda run: run.path.chmod(0))
    try:
        capsys.readouterr()
        assert main([str(root), "--json"]) == 0
        rows = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    finally:
        (runs_root(root) / "damaged").chmod(0o755)
    assert rows["damaged"]["state"] == "damaged" and "cannot be read" in rows["damaged"]["detail"], rows["damaged"]
    assert rows["good"]["state"] == "finished"


def test_a_watch_whose_output_root_is_deleted_ends_with_one_line(tiny_run, tmp_path):
    root = damaged_root(tiny_run, tmp_path, lambda run: None)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    watch = subprocess.Popen([sys.executable, "-m", "deit_ablate.status", str(root), "--watch", "--every", "0.2"],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not any(RunDir(p).progress.exists() for p in runs_root(root).iterdir()):
            time.sleep(0.1)
        time.sleep(3.0)  # its first table is up (the import takes about a second)
        shutil.rmtree(root)
        out, err = watch.communicate(timeout=60)
    finally:
        watch.kill()
    assert "finished" in out  # the table it showed before
    assert watch.returncode != 0 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: {root} is not a folder: the output root went away"), line


# --- a relaunch onto a damaged finished run ------------------------------------------------------------------------

def without_wandb(run: RunDir) -> None:
    """A binary metrics.csv and no wandb log left: the skip would log the run again from metrics.csv."""
    run.metrics.write_bytes(b"\x00\xff\xfe\x01" * 64)
    shutil.rmtree(run.path.parent.parent / "wandb")


RELAUNCHES = [
    Damage("result_a_folder", lambda r: a_folder(r.result), "result.json: a folder, not a file"),
    Damage("identity_garbage", lambda r: r.identity.write_bytes(b"\xff\x00{garbage"),
           "identity.json: binary data, not text"),
    Damage("metrics_binary_without_wandb", without_wandb, "metrics.csv: binary data, not text. Delete it"),
    Damage("checkpoint_a_fifo", lambda r: a_fifo(no_result(r).last_checkpoint),
           "checkpoint-last.pt: a FIFO (named pipe), not a file"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", RELAUNCHES, ids=lambda c: c.name)
def test_a_relaunch_onto_a_damaged_run_is_one_line_naming_the_file(case, tiny_run, tmp_path, data_cache):
    outputs = tiny_run.copy_into(tmp_path)
    run = RunDir(next(p for p in runs_root(outputs).iterdir() if p.is_dir()))
    case.damage(run)
    wait = 60 if "fifo" in case.name else 180  # a FIFO waited on: TimeoutExpired
    proc = run_train(TINY, tmp_path, data_cache, check=False, timeout=wait)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    file, problem = case.detail.split(": ", 1)
    assert line.startswith(f"error: {run.path / file}: {problem}"), line
    assert "delete it" in line.lower() and ("move the run folder" in line or "metrics" in file), line

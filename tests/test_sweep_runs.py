"""A sweep's runs side by side in one process and beside other sweeps: what one run leaves for the next (loader
workers), a run two rows share (its records, its status row), a run another sweep holds."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from rich.console import Console

from deit_ablate.analysis.status.cli import collect, main
from deit_ablate.analysis.status.sweep import PlannedRun, one_per_run, sweep_runs
from deit_ablate.analysis.status.view import table, totals, totals_line
from deit_ablate.core.atomic import write_json_atomic
from deit_ablate.record.progress import holder_facts, now_iso
from deit_ablate.record.rundir import RunDir, runs_root
from deit_ablate.record.runlock import _proc_start, this_process
from tests.conftest import REPO, TINY, identity_of, run_train

# Two DeiT III rows that differ only in their fine-tune (layer decay): one pre-training run for both.
SHARED = ["deit3=baseline,layer_decay_075", "stage=pretrain,finetune", *TINY, "train.max_steps=2"]
WATCHED = [*(o for o in SHARED if not o.startswith(("train.epochs=", "train.max_steps="))), "train.epochs=30",
           "train.max_steps=120"]  # each stage long enough for a few refreshes under way


def hydra_records(run: RunDir) -> dict[str, bytes]:
    """The run's .hydra/ files, as bytes."""
    return {path.name: path.read_bytes() for path in (run.hydra_config, run.hydra_overrides, run.hydra_settings)}


def test_a_launch_that_skips_a_finished_run_leaves_its_records_as_they_were(tmp_path, data_cache, tiny_run):
    tiny_run.copy_into(tmp_path)
    (run,) = [RunDir(p) for p in runs_root(tmp_path / "outputs").iterdir() if p.is_dir()]
    before = hydra_records(run)
    assert "runtime.log_interval=2" in before["overrides.yaml"].decode()  # written by the launch that trained it
    proc = run_train([*TINY, "runtime.log_interval=3"], tmp_path, data_cache)  # the same run: runtime.* names none
    assert "already finished" in proc.stdout + proc.stderr
    assert hydra_records(run) == before, yaml.safe_load(run.hydra_overrides.read_text())


def test_the_status_shows_a_run_two_rows_share_once_naming_both(tmp_path, capsys):
    shared, own_a, own_b = (RunDir(tmp_path / name) for name in ("pre", "ft-a", "ft-b"))
    planned = [PlannedRun(shared, ("deit3=baseline", "pretrain", 0)),
               PlannedRun(own_a, ("deit3=baseline", "finetune", 0)),
               PlannedRun(shared, ("deit3=layer_decay_075", "pretrain", 0)),
               PlannedRun(own_b, ("deit3=layer_decay_075", "finetune", 0))]
    runs = one_per_run(planned)
    assert [(r.run_dir, r.also) for r in runs] == [(shared, ("deit3=layer_decay_075",)), (own_a, ()), (own_b, ())]
    rows = collect(runs, stall_after=600.0)
    assert totals(rows)["runs"] == 3 and totals(rows)["states"] == {"planned": 3}
    out = io.StringIO()
    Console(file=out, width=200).print(table(rows, "sweep"))
    assert "also: deit3=layer_decay_075" in out.getvalue() and "3 runs: 3 planned" in out.getvalue()


@pytest.fixture
def holder():
    """A live process on this host that stands for another sweep's launch."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_run_two_rows_share_is_one_row_before_its_folder_exists_and_once_another_rows_launch_made_it(
        tmp_path, data_cache, tiny_data, holder, monkeypatch):
    """Planned once before any folder exists (as --watch plans), each row names the shared pre-training after its own
    overrides: one row, counted once in the totals and the sweep's ETA, in whichever row's folder it trains."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DEIT_ABLATE_CACHE", str(data_cache))
    planned = sweep_runs(SHARED)
    rows = collect(planned, stall_after=600.0)
    assert [(r.row, r.stage, r.also) for r in rows] == [
        ("deit3=baseline", "pretrain", ["deit3=layer_decay_075"]), ("deit3=baseline", "finetune", []),
        ("deit3=layer_decay_075", "finetune", [])], rows
    assert totals_line(rows).startswith("3 runs: 1 planned, 2 waiting |")
    # The second row's launch made the folder (a SLURM job that started first), under its own row's name.
    second = identity_of(["deit3=layer_decay_075", "stage=pretrain", *SHARED[2:]])
    made = RunDir.under(tmp_path / "outputs", second.name)
    assert made.name != rows[0].run and made.name.endswith(rows[0].run.rsplit("-", 1)[1])
    made.path.mkdir(parents=True)
    made.lock.write_text(json.dumps({**this_process(), "pid": holder.pid, "proc_start": _proc_start(holder.pid)}))
    write_json_atomic(made.progress, {  # 30 of 240 steps of 32 images in 60 s: 16 img/s, 210 steps left: 420 s
        "state": "running", "epoch": 4, "epochs": 30, "step": 30, "total_steps": 240, "images_per_step": 32,
        "img_per_s": 16.0, "elapsed_s": 60.0, "start_step": 0, "start_elapsed_s": 0.0, "started": now_iso(),
        "updated": now_iso(), **holder_facts(1), "pid": holder.pid})
    rows = collect(planned, stall_after=600.0)
    assert [(r.run, r.state) for r in rows] == [(made.name, "running"), (rows[1].run, "waiting"),
                                                (rows[2].run, "waiting")], rows
    assert rows[2].detail == rows[1].detail == f"its pre-training …-{made.name.rsplit('-', 1)[1]}"
    # The sweep's ETA: the run under way's 420 s, then two fine-tunes of the typical 60 + 420 s, one at a time.
    assert totals_line(rows) == "3 runs: 2 waiting, 1 running | sweep ETA 0:23:00"


@pytest.mark.slow
def test_a_sweeps_runs_start_with_no_loader_worker_of_the_runs_before(tmp_path, data_cache):
    counts = tmp_path / "forks.jsonl"
    tiny = [o for o in TINY if not o.startswith("runtime.num_workers=")]
    run_train(["-m", "seed=0,1,2", *tiny, "runtime.num_workers=2",
               "+hydra.callbacks.children._target_=child_count.ChildCount"], tmp_path, data_cache,
              extra_env={"CHILD_COUNT_FILE": str(counts), "PYTHONPATH": str(REPO / "tests")})
    seen = [json.loads(line) for line in counts.read_text().splitlines()]
    assert [(s["seed"], len(s["forks"])) for s in seen] == [(0, 0), (1, 0), (2, 0)], seen


@pytest.mark.slow
def test_a_pre_training_two_rows_share_keeps_its_first_rows_records_and_is_one_status_row_throughout(
        tmp_path, data_cache, tiny_data, capsys, monkeypatch):
    """The sweep watched as `deit-status --watch` watches it, planned once before it starts: 3 runs at every refresh,
    the pre-training under way counted once in the sweep's ETA; then its records and the status planned anew."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DEIT_ABLATE_CACHE", str(data_cache))
    planned = sweep_runs(WATCHED)
    env = {**os.environ, "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "sweep.log", "w+") as log:
        sweep = subprocess.Popen([sys.executable, str(REPO / "train.py"), "-m", *WATCHED], cwd=tmp_path, env=env,
                                 stdout=log, stderr=subprocess.STDOUT)
        refreshes = []
        while sweep.poll() is None:
            refreshes.append(collect(planned, stall_after=600.0))
            time.sleep(0.3)
        returned = sweep.wait()
        log.seek(0)
        output = log.read()
    assert returned == 0, output[-3000:]
    assert output.count("already finished") == 1  # the second row's pre-training
    assert {len(rows) for rows in refreshes} == {3}, [totals_line(rows) for rows in refreshes if len(rows) != 3]
    training = [rows for rows in refreshes if rows[0].state == "running" and rows[0].eta_s is not None]
    assert training and all(rows[1].state == rows[2].state == "waiting" for rows in training)
    for rows in training:  # what it has left, then two fine-tunes as long as it, one at a time
        pre = rows[0]
        assert totals(rows)["eta_s"] == pytest.approx(pre.eta_s + 2 * (pre.elapsed_s + pre.eta_s)), rows
    assert [r.state for r in collect(planned, stall_after=600.0)] == ["finished"] * 3
    pretrains = [RunDir(p) for p in runs_root(tmp_path / "outputs").iterdir()
                 if p.is_dir() and "stage=pretrain" in RunDir(p).hydra_overrides.read_text()]
    assert len(pretrains) == 1
    overrides = yaml.safe_load(pretrains[0].hydra_overrides.read_text())
    assert "deit3=baseline" in overrides and "deit3=layer_decay_075" not in overrides, overrides
    capsys.readouterr()
    assert main(["-m", *WATCHED, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [(r["row"], r["stage"], r["also"]) for r in shown["runs"]] == [
        ("deit3=baseline", "pretrain", ["deit3=layer_decay_075"]), ("deit3=baseline", "finetune", []),
        ("deit3=layer_decay_075", "finetune", [])], shown["runs"]
    assert shown["totals"]["runs"] == 3 and shown["totals"]["states"] == {"finished": 3}


@pytest.mark.slow
def test_a_sweep_goes_on_past_a_run_another_launch_holds_and_names_it_at_its_end(tmp_path, data_cache, holder):
    sweep = ["seed=0,1", "stage=pretrain,finetune", *TINY]
    held = RunDir.under(tmp_path / "outputs", identity_of(["seed=0", "stage=pretrain", *TINY]).name)
    held.path.mkdir(parents=True)
    held.lock.write_text(json.dumps({**this_process(), "pid": holder.pid, "proc_start": None, "token": "theirs"}))
    proc = run_train(["-m", *sweep], tmp_path, data_cache, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    trained = {tuple(yaml.safe_load(RunDir(p).hydra_overrides.read_text())[:2]) for p in held.path.parent.iterdir()
               if RunDir(p).result.exists()}
    assert trained == {("seed=1", "stage=pretrain"), ("seed=1", "stage=finetune")}, proc.stderr[-3000:]
    end = proc.stderr[proc.stderr.index("the sweep left"):]
    assert "the sweep left 2 of its 4 runs, in use by other launches" in end, proc.stderr[-3000:]
    assert f"seed=0 stage=pretrain {' '.join(TINY)}: the run folder {held.path} is in use by another launch of the " \
           f"same run: pid {holder.pid}" in end
    assert f"seed=0 stage=finetune {' '.join(TINY)}: its pre-training {held.name} is being trained by another " \
           f"launch: pid {holder.pid}" in end
    assert json.loads(held.lock.read_text())["pid"] == holder.pid  # untouched

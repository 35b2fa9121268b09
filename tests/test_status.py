"""deit-status (issue 38): each run's state from its folder, the dry run and the status agreeing on every run of a
half-finished sweep, --json carrying the table's rows, a killed run shown as stalled, SLURM's queue, and progress
that reads well in a log file (no carriage returns)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from deit_ablate.analysis.status.cli import collect, main
from deit_ablate.analysis.status.rows import ACTION_OF, STALL_AFTER_S, STATES, numbers
from deit_ablate.analysis.status.sweep import PlannedRun, folder_runs, sweep_runs
from deit_ablate.analysis.status.view import as_json, table
from deit_ablate.core.atomic import write_json_atomic, write_text_atomic
from deit_ablate.core.logs import PlainBar
from deit_ablate.record.progress import ProgressFile, read_progress
from deit_ablate.record.rundir import RunDir, runs_root
from deit_ablate.record.runlock import _proc_start, this_process
from deit_ablate.record.sweep_records import read_slurm_jobs
from deit_ablate.run.lifecycle import dry_run_line
from tests.conftest import REPO, TINY, run_train

SWEEP = ["-m", "seed=0,1,2,3", "stage=pretrain,finetune", *TINY]


def status_json(argv: list[str], capsys) -> dict:
    """`deit-status <argv> --json`, run in this process; its parsed output."""
    capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def clone(finished: RunDir, target: Path, keep_result: bool = False) -> RunDir:
    """A copy of a finished run's folder at `target`, its result.json removed unless `keep_result`."""
    shutil.copytree(finished.path, target)
    run = RunDir(target)
    if not keep_result:
        run.result.unlink()
    return run


@dataclass(frozen=True)
class HalfFinished:
    """TINY's sweep over 4 seeds x (pretrain, finetune), half done, in `cwd`, and its runs as the status plans them."""

    cwd: Path
    runs: list[PlannedRun]


@pytest.fixture(scope="module")
def half_finished(tmp_path_factory, tiny_run, data_cache, tiny_data) -> HalfFinished:
    """Seed 0 pre-trained (the shared tiny run), seed 1 stopped with a checkpoint to resume, seed 2 never started,
    seed 3 diverged (its result as the run writes it); the fine-tunes not started."""
    cwd = tmp_path_factory.mktemp("half_finished")
    tiny_run.copy_into(cwd)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        patch.setenv("DEIT_ABLATE_CACHE", str(data_cache))
        planned = sweep_runs(SWEEP[1:])
    runs = {(r.labels[2], r.labels[1]): r.run_dir for r in planned}
    finished = RunDir(cwd / "outputs" / "runs" / runs[0, "pretrain"].name)
    assert finished.result.exists()
    clone(finished, cwd / "outputs" / "runs" / runs[1, "pretrain"].name)  # its checkpoint, no result: resume
    diverged = RunDir(cwd / "outputs" / "runs" / runs[3, "pretrain"].name)
    diverged.path.mkdir()
    diverged.write_result({**finished.read_result(), "status": "diverged", "note": "training loss is nan at step 5"})
    return HalfFinished(cwd, planned)


EXPECTED = {(0, "pretrain"): "finished", (0, "finetune"): "planned", (1, "pretrain"): "preempted",
            (1, "finetune"): "waiting", (2, "pretrain"): "planned", (2, "finetune"): "waiting",
            (3, "pretrain"): "diverged", (3, "finetune"): "planned"}


def test_the_status_shows_what_the_dry_run_says_on_every_run_of_a_half_finished_sweep(half_finished, monkeypatch):
    monkeypatch.chdir(half_finished.cwd)
    rows = collect(half_finished.runs, STALL_AFTER_S)
    for run, row in zip(half_finished.runs, rows, strict=True):
        assert dry_run_line(run.plan).endswith(f": {row.action}"), row  # the dry run's words: one function for both
        assert row.action.split()[0] in ACTION_OF[row.state], row  # a state that launch action allows
    assert {(r.seed, r.stage): r.state for r in rows} == EXPECTED
    row = {(r.seed, r.stage): r for r in rows}
    assert row[1, "pretrain"].action.startswith("resume from step 8")
    assert row[3, "finetune"].action.startswith("record as diverged without training")
    assert row[2, "finetune"].detail == f"its pre-training …-{row[2, 'pretrain'].run.rsplit('-', 1)[1]}"


@pytest.mark.slow
def test_the_dry_run_command_and_deit_status_json_agree(half_finished, data_cache, capsys, monkeypatch):
    monkeypatch.chdir(half_finished.cwd)
    monkeypatch.setenv("DEIT_ABLATE_CACHE", str(data_cache))
    rows = status_json(SWEEP, capsys)["runs"]
    dry = run_train([*SWEEP, "runtime.dry_run=true"], half_finished.cwd, data_cache).stdout
    said = dict(re.findall(r"^\[dry run\] (\S+) \(wandb id [^)]*\): (.*)$", dry, re.M))
    assert len(said) == len(rows) == 8
    assert {r["run"]: r["action"] for r in rows} == said
    assert {(r["seed"], r["stage"]): r["state"] for r in rows} == EXPECTED


def test_an_output_root_shows_finished_running_stalled_failed_and_diverged_runs(tiny_run, tmp_path, capsys):
    outputs = tiny_run.copy_into(tmp_path)
    finished = RunDir(next(p for p in runs_root(outputs).iterdir() if p.is_dir()))
    runs = runs_root(outputs)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        running = clone(finished, runs / "running")  # held by a live process that wrote its progress just now
        write_text_atomic(running.lock, json.dumps({**this_process(), "pid": sleeper.pid,
                                                    "proc_start": _proc_start(sleeper.pid)}))
        record = ProgressFile(running, 8, 1, 32, 2, clock=lambda: 3.0)
        record.start(0, 2)
        record.update(pid=sleeper.pid)
        stalled = clone(finished, runs / "stalled")  # its lock's holder is gone (a kill -9)
        write_text_atomic(stalled.lock, json.dumps({**this_process(), "pid": gone.pid}))
        failed = clone(finished, runs / "failed")
        ProgressFile(failed, 8, 1, 32, 1, clock=lambda: 1.0).end("failed", 3, "RunError: no space left on the device")
        diverged = clone(finished, runs / "diverged", keep_result=True)
        diverged.write_result({**diverged.read_result(), "status": "diverged"})
        report = status_json([str(outputs)], capsys)
        quiet = {**read_progress(running), "updated": "2026-01-01T00:00:00+00:00"}  # its last write long ago
        write_json_atomic(running.progress, quiet)
        late = {r.run: r for r in collect(folder_runs(outputs), STALL_AFTER_S)}["running"]
    finally:
        sleeper.kill()
    assert late.state == "stalled" and f"stall bound {STALL_AFTER_S:.0f} s" in late.detail, late
    state = {Path(r["run"]).name: r for r in report["runs"]}
    assert {name: r["state"] for name, r in state.items()} == {
        finished.name: "finished", "running": "running", "stalled": "stalled", "failed": "failed",
        "diverged": "diverged"}
    assert state["running"]["detail"] == f"{this_process()['host']}, 2 ranks" and state["running"]["step"] == 2
    assert f"pid {gone.pid} is gone" in state["stalled"]["detail"]
    assert state["failed"]["detail"] == "RunError: no space left on the device"
    assert state["failed"]["log"] == str(failed.log)  # where the whole log is
    assert report["totals"]["states"] == {"running": 1, "stalled": 1, "failed": 1, "finished": 1, "diverged": 1}


def test_json_carries_the_rows_of_the_table(half_finished, monkeypatch):
    monkeypatch.chdir(half_finished.cwd)
    rows = collect(half_finished.runs, STALL_AFTER_S)
    printed = as_json(rows, "here")
    assert json.loads(json.dumps(printed)) == printed
    grid = table(rows, "here")
    columns = {c.header: [str(cell) for cell in c.cells] for c in grid.columns}
    assert columns["state"] == [r["state"] for r in printed["runs"]]
    assert columns["run"] == [r["row"] for r in printed["runs"]]
    assert set(printed["totals"]["states"]) <= set(STATES) and printed["totals"]["runs"] == len(rows)


def test_a_path_that_is_not_an_output_root_is_one_line_and_status_2(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not a folder" in err and "give an output root" in err
    assert main([str(tmp_path)]) == 2
    assert "holds no runs/ folder" in capsys.readouterr().err


def test_an_unknown_override_is_one_line_and_status_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["-m", "ablation=no_such_row"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no_such_row" in err, err


def test_a_run_logged_to_a_file_has_no_carriage_returns(tiny_run):
    output = tiny_run.proc.stdout + tiny_run.proc.stderr
    assert "\r" not in output
    assert re.search(r"^epoch 1: step \d+/8 \| loss [\d.]+ \| lr [\d.e+-]+ \| img/s \d+", tiny_run.proc.stderr, re.M)
    run = RunDir(tiny_run.run_dir())
    progress = read_progress(run)
    assert progress["state"] == "finished"
    assert progress["epoch"] == 1 and "[epoch 1] train loss" in run.log.read_text()  # the status's count is the log's


def test_images_per_second_and_the_eta_are_the_launchs_average_not_its_last_seconds(tmp_path):
    """A run resumed at step 100 after 400 s of training: 1,000 steps of 64 images in the 640 s since, the last 40 of
    them in 40 s (an evaluation's pause): 100 img/s, not the last window's 64, and its 1,900 steps left take 1,216 s.
    Finished after 3,000 steps in 1,920 s, it shows 100 img/s over its whole training, not its last seconds'."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    now = [400.0]
    record = ProgressFile(run, 3000, 30, 64, 1, clock=lambda: now[0], every_s=0.0)
    record.start(3, 100)
    now[0] = 1000.0
    record.step(3, 1060)  # 960 steps in 600 s: 102.4 img/s
    now[0] = 1040.0
    record.step(3, 1100)  # the last 40 steps in 40 s: 64 img/s
    written = read_progress(run)
    assert written["img_per_s"] == 100.0, written
    assert (written["start_step"], written["start_elapsed_s"], written["epoch"]) == (100, 400.0, 4)
    shown = numbers(written, None)
    assert (shown["img_per_s"], shown["eta_s"]) == (100.0, 1216.0), shown
    older = {k: v for k, v in written.items() if not k.startswith("start_")} | {"img_per_s": 32.0}
    assert numbers(older, None)["eta_s"] == 3800.0  # a record written before the start keys: its rate as written
    result = {"status": "finished", "steps_done": 3000, "epochs_done": 30, "train_seconds": 1920.0, "top1": 50.0}
    assert numbers(written | {"img_per_s": 41.0}, result)["img_per_s"] == 100.0  # 3,000 x 64 images in 1,920 s


def test_a_plain_bar_writes_lines_for_the_sharpness_measure_too():
    out = io.StringIO()
    bar = PlainBar(total=4, desc="sharpness", every_s=0.0, stream=out)
    for _ in range(4):
        bar.update()
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and lines[0].startswith("sharpness: step 1/4") and "took" in lines[-1]


def test_a_run_killed_with_kill_9_shows_as_stalled(tmp_path, data_cache, capsys):
    args = [a for a in TINY if a != "train.epochs=1"] + ["train.epochs=200"]
    env = {**os.environ, "DEIT_ABLATE_CACHE": str(data_cache), "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args, "runtime.tracking.mode=disabled"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not list(runs_root(tmp_path / "outputs").glob("*/progress.json")):
            time.sleep(0.2)
        (row,) = status_json([str(tmp_path / "outputs")], capsys)["runs"]
        assert row["state"] == "running", row
        (folder,) = [RunDir(p) for p in runs_root(tmp_path / "outputs").iterdir() if p.is_dir()]
        while time.time() < deadline and (read_progress(folder) or {}).get("step", 0) < 20:  # past 2 checkpoints
            time.sleep(0.2)
        proc.kill()
        proc.wait()
        (row,) = status_json([str(tmp_path / "outputs")], capsys)["runs"]
    finally:
        proc.kill()
    assert row["state"] == "stalled" and f"pid {proc.pid} is gone" in row["detail"], row
    reached = read_progress(folder)["step"]
    saved = re.match(r"resume from step (\d+) ", row["action"])  # its newest checkpoint's, as the dry run says
    start = int(saved.group(1)) if saved else 0
    said = f"resumes from step {start}" if saved else "no checkpoint yet: restarts from step 0"
    assert re.search(rf"; {said} \({max(reached - start, 0)} steps? to redo\)$", row["detail"]), (row, reached)


def test_a_stalled_run_says_what_a_relaunch_redoes(tmp_path, capsys):
    """Killed at step 56 after its checkpoint of step 39: the relaunch resumes there and trains 17 steps again; killed
    at step 17 before any checkpoint: it starts over."""
    import torch

    from deit_ablate.record.resume import RESUME_KEYS

    gone = subprocess.Popen(["true"])
    gone.wait()
    for name, reached, saved in (("checkpointed", 56, 39), ("unsaved", 17, None)):
        run = RunDir(tmp_path / "runs" / name)
        run.hydra_config.parent.mkdir(parents=True)
        run.hydra_overrides.write_text("[ablation=no_mixup]\n")
        run.hydra_config.write_text("{stage: pretrain, seed: 0}\n")
        if saved is not None:
            torch.save({key: {} for key in RESUME_KEYS} | {"epoch": 4, "step": saved}, run.last_checkpoint)
        record = ProgressFile(run, 240, 30, 32, 1, clock=lambda: 60.0, every_s=0.0)
        record.start(0, 0)
        record.step(6, reached)
        write_text_atomic(run.lock, json.dumps({**this_process(), "pid": gone.pid}))  # its holder killed
    rows = {r["run"]: r for r in status_json([str(tmp_path)], capsys)["runs"]}
    assert {name: r["state"] for name, r in rows.items()} == {"checkpointed": "stalled", "unsaved": "stalled"}
    assert rows["checkpointed"]["detail"].endswith(f"pid {gone.pid} is gone; resumes from step 39 (17 steps to redo)")
    assert rows["unsaved"]["detail"].endswith("; no checkpoint yet: restarts from step 0 (17 steps to redo)")


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch: start the cluster with scripts/slurm_up.sh")
def test_slurm_jobs_show_as_queued_running_on_their_node_and_requeued(tmp_path, data_cache, monkeypatch):
    from tests.conftest import tiny_with

    # Two 8-task jobs of 2 CPUs each: one fills the 16-CPU test node, the other waits for it.
    slurm = ["hydra/launcher=slurm_8gpu", "hydra.launcher.cpus_per_task=2", "hydra.launcher.timeout_min=20"]
    sweep = ["seed=0,1", *slurm, *[a for a in tiny_with(4) if a != "train.epochs=1"], "train.epochs=500"]
    env = {**os.environ, "DEIT_ABLATE_CACHE": str(data_cache), "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}  # the jobs too
    driver = subprocess.Popen([sys.executable, str(REPO / "train.py"), "-m", *sweep], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DEIT_ABLATE_CACHE", str(data_cache))
    planned, seen = sweep_runs(sweep), {}

    def watch_for(state: str) -> None:
        deadline = time.time() + 300
        while time.time() < deadline and state not in seen:
            for row in collect(planned, 600.0):
                if row.state != "running" or row.step:  # running: once it trains (its progress.json written)
                    seen.setdefault(row.state, row)
            time.sleep(1.0)

    try:
        watch_for("running")
        watch_for("queued")
        subprocess.run(["scontrol", "requeue", seen["running"].slurm_job], check=True)  # as a preemption does
        watch_for("requeued")
    finally:
        jobs = read_slurm_jobs(runs_root(tmp_path / "outputs"))  # what the launcher submitted
        subprocess.run(["scancel", *jobs], check=False)
        driver.kill()
    assert {"running", "queued", "requeued"} <= set(seen), {s: r.detail for s, r in seen.items()}
    assert seen["requeued"].run == seen["running"].run and seen["requeued"].step  # the run that had trained
    host = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    assert seen["running"].detail == f"{host}, 8 ranks", seen["running"]  # its node and ranks
    assert re.match(r"SLURM job \d+_\d+: (Resources|Priority|PENDING)", seen["queued"].detail), seen["queued"]


def test_slurm_pending_is_queued_or_requeued_and_an_ended_job_is_named():
    from deit_ablate.analysis.status.rows import ended_state, queued_state
    from deit_ablate.analysis.status.slurm import SlurmJob
    from deit_ablate.record.resume import LaunchAction

    pending = SlurmJob("7_1", "PENDING", "Resources")
    assert queued_state(pending, trained_before=False) == ("queued", "SLURM job 7_1: Resources")
    assert queued_state(pending, trained_before=True)[0] == "requeued"
    assert queued_state(SlurmJob("7_0", "RUNNING", "", "n1"), False) == ("running", "n1, SLURM job 7_0 starting")
    stopped = {"state": "stopped", "step": 9, "error": "stopped by SIGUSR2 at step 9; the same command resumes it"}
    assert ended_state(RunDir(Path("/nonexistent")), LaunchAction("resume", "resume from step 8"), stopped,
                       SlurmJob("7_0", "TIMEOUT")) == ("preempted", "stopped by SIGUSR2 at step 9 (SLURM: TIMEOUT)")


def test_a_progress_record_that_cannot_be_written_never_stops_the_training(tmp_path, caplog):
    record = ProgressFile(RunDir(tmp_path / "gone"), 8, 1, 32, 1, clock=lambda: 0.0)  # no such folder
    record.start(0, 0)
    record.end("finished", 8)
    assert not (tmp_path / "gone").exists()
    assert sum("cannot write" in r.message for r in caplog.records) == 1  # said once


@pytest.mark.slow
def test_a_run_that_fails_shows_its_error_line_and_its_log(tmp_path, data_cache, capsys):
    from deit_ablate.data.builtin import ensure_builtin_dataset

    root = tmp_path / "folder"
    shutil.copytree(ensure_builtin_dataset(data_cache / "builtin", 40, 30, 10, 0), root,
                    ignore=shutil.ignore_patterns("*.json"))
    bad = root / "train" / "disc" / "garbage.JPEG"
    bad.write_bytes(b"this is not a JPEG" * 50)
    args = ["data=imagefolder", f"data.root={root}", "data.num_classes=10", "runtime.on_bad_image=fail", *TINY]
    assert run_train(args, tmp_path, data_cache, check=False).returncode == 2
    (row,) = status_json([str(tmp_path / "outputs")], capsys)["runs"]
    assert row["state"] == "failed" and f"{bad} cannot be read as an image" in row["detail"], row
    assert row["log"] and f"{bad} cannot be read as an image" in Path(row["log"]).read_text()


def test_the_resume_step_is_read_without_torch_or_the_checkpoints_tensors(tmp_path, monkeypatch):
    """The status and the dry run name the step a run resumes from for every run of a sweep, on every refresh: a
    paper-scale checkpoint is about 1 GB, and torch takes about 1.3 s to import, so the step is read from the
    archive's pickle alone (before: torch.load of every checkpoint). What a launch could not read is still refused:
    a file cut short, a tensor record missing, a pickle naming anything but torch's own classes (never called)."""
    import zipfile

    import torch

    from deit_ablate.record.resume import RESUME_KEYS, folder_action

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    model = torch.nn.Linear(256, 256)  # a real state_dict: an OrderedDict with its _metadata, optimizer moments
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 256)).sum().backward()
    optimizer.step()
    state = {key: {} for key in RESUME_KEYS} | {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                                "epoch": 1, "step": 7}
    torch.save(state, run.last_checkpoint)
    whole = run.last_checkpoint.read_bytes()
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: calls.append(kwargs) or real_load(*args, **kwargs))
    action = folder_action(run)
    assert (action.kind, action.text) == ("resume", f"resume from step 7 ({run.last_checkpoint.name})")
    assert calls == []

    run.last_checkpoint.write_bytes(whole[:2000])  # cut short: refused, as the launch refuses it
    with pytest.raises(Exception, match="cannot resume"):
        folder_action(run)
    with zipfile.ZipFile(tmp_path / "pruned.pt", "w") as pruned, zipfile.ZipFile(io.BytesIO(whole)) as full:
        for name in full.namelist():
            if not name.endswith("/data/0"):  # the tensor's bytes gone
                pruned.writestr(name, full.read(name))
    run.last_checkpoint.write_bytes((tmp_path / "pruned.pt").read_bytes())
    with pytest.raises(Exception, match="storage 0 is missing"):
        folder_action(run)

    class Smuggled:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'executed'}",))

    torch.save(state | {"step": Smuggled()}, run.last_checkpoint)
    with pytest.raises(Exception, match="unsupported global"):
        folder_action(run)
    assert not (tmp_path / "executed").exists()

    torch.save(state, run.previous_checkpoint, _use_new_zipfile_serialization=False)  # torch's format before 1.6
    action = folder_action(run)  # the newer copy cannot be read: the one before it, read whole with torch
    assert (action.kind, action.text) == ("resume", f"resume from step 7 ({run.previous_checkpoint.name})")
    assert len(calls) == 1


def test_the_status_of_an_output_root_starts_without_the_training_code(tmp_path):
    """`deit-status <output root>` reads the run folders alone: no torch, timm or wandb imported (before: 5.2 s to
    start, most of it importing the training code)."""
    import torch

    run = RunDir(tmp_path / "runs" / "a-run")
    run.hydra_config.parent.mkdir(parents=True)
    run.hydra_overrides.write_text("[ablation=no_mixup, stage=pretrain]\n")
    run.hydra_config.write_text("{stage: pretrain, seed: 0}\n")
    torch.save({key: {} for key in ("model", "optimizer", "scheduler")} | {"epoch": 2, "step": 40},
               run.last_checkpoint)
    script = ("import json, sys; from deit_ablate.analysis.status.cli import main; main([sys.argv[1], '--json']); "
              "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'timm', 'wandb'})))")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    *table, loaded = done.stdout.strip().splitlines()
    assert json.loads(loaded) == []
    row, = json.loads("\n".join(table))["runs"]
    assert (row["state"], row["action"]) == ("preempted", f"resume from step 40 ({run.last_checkpoint.name})"), row
    assert row["detail"] == row["action"]  # no progress.json: the checkpoint's step, not "stopped at step ?"

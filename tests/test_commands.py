"""The command-line entry points as a user runs them, in subprocesses without this suite's set-up: Hydra overrides
Hydra cannot read (issue 39 point 8), Ctrl-C while a command writes (point 7), and every command on a finished run of
every study it applies to (point 10: nothing registers the resolvers for them but the commands themselves)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, compose_config, run_train, write_offline_runs
from test_aggregate import _done, _run

PAUSE = REPO / "tests" / "pause_at_write"
AGGREGATE = [sys.executable, str(REPO / "scripts" / "aggregate.py")]


def clean_env(cache: Path, **extra: str) -> dict[str, str]:
    """The environment of a user's shell: this checkout importable, nothing of the suite's."""
    return {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": str(REPO),
            "DEIT_ABLATE_CACHE": str(cache), "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", "WANDB_MODE": "offline",
            **extra}


def test_an_unquoted_equals_sign_names_the_override_and_its_quoting(tmp_path, data_cache):
    proc = run_train(["distill.teacher.checkpoint=/runs/a=b/t.pt"], tmp_path, data_cache, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "the override distill.teacher.checkpoint=/runs/a=b/t.pt" in lines[0]
    assert lines[0].endswith("""'distill.teacher.checkpoint="/runs/a=b/t.pt"'""")
    assert list(tmp_path.iterdir()) == []
    # the quoting it gives, as the shell hands it over, reads the path whole
    cfg = compose_config(['distill.teacher.checkpoint="/runs/a=b/t.pt"'])
    assert cfg.distill.teacher.checkpoint == "/runs/a=b/t.pt"


def interrupt_while_writing(command: list[str], name: str, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """Start `command`, pause it as it opens a file named like `name` for writing, send SIGINT, let it go on; its
    exit status and stderr."""
    pause = cwd / "pause"
    pause.mkdir(exist_ok=True)
    env = {**env, "PYTHONPATH": f"{PAUSE}{os.pathsep}{env['PYTHONPATH']}", "DEIT_PAUSE_WRITE": name,
           "DEIT_PAUSE_DIR": str(pause)}
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (pause / "ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    (pause / "go").touch()
    _, stderr = proc.communicate(timeout=60)
    return proc.returncode, stderr


def assert_stopped_quietly(status: int, stderr: str, name: str) -> None:
    """Exit status 130 and one line naming the command, no traceback."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert status == 130 and "Traceback" not in stderr, stderr
    assert lines[-1] == f"{name}: stopped by Ctrl-C; files it had not finished writing keep their previous version"


def test_ctrl_c_while_the_aggregator_writes_its_plot_keeps_the_previous_one(tmp_path, data_cache):
    write_offline_runs([_run("base-p0", "baseline", "pretrain", 0, _done(50.0)),
                        _run("sgd-p0", "sgd", "pretrain", 0, _done(40.0))], tmp_path)
    env = clean_env(data_cache)
    out = tmp_path / "out"
    command = [*AGGREGATE, str(tmp_path / "main" / "wandb"), "--plot", str(out / "plot.png"), "--out",
               str(out / "t.md"), "-q"]
    subprocess.run(command, check=True, env=env, cwd=tmp_path, timeout=120, capture_output=True)
    before = (out / "plot.png").read_bytes()
    assert before.startswith(b"\x89PNG")

    assert_stopped_quietly(*interrupt_while_writing(command, "plot.png", tmp_path, env), "deit-aggregate")
    assert (out / "plot.png").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["plot.png", "t.md"]  # no temp file left


# --- every command on a finished run of every study (slow: one tiny run per study, about a minute) ------------------
# The rows' runs, in the order their commands run: the teachers row trains its teacher first (-m), the transfer row
# needs its pre-training and fine-tune. The headline row keeps its own demo width and heads (TINY's would make it the
# baseline's run).
SHORT_STAGES = ["finetune.epochs=1", "finetune.global_batch=32", "transfer.epochs=1", "transfer.global_batch=32"]
STUDY_COMMANDS = {
    "ablation": [TINY],
    "cait": [[*TINY, "cait=depth12"]],
    "deit3": [[*TINY, "deit3=baseline"]],
    "headline": [[a for a in TINY if a.split("=")[0] not in ("model.kwargs.embed_dim", "model.kwargs.num_heads")]
                 + ["headline=deit_ti"]],
    "sam": [[*TINY, "sam=baseline"]],
    "teachers": [["-m", *TINY, "teachers=regnety_4gf"]],
    "transfer": [[*TINY, *SHORT_STAGES, row] for row in ("stage=pretrain", "stage=finetune", "transfer=builtin_b")],
}


@pytest.fixture(scope="module")
def study_runs(tmp_path_factory, data_cache) -> tuple[Path, dict[str, Path]]:
    """One folder holding a finished run of a row of every study; the folder and each study's run."""
    cwd = tmp_path_factory.mktemp("studies")
    runs_dir = cwd / "outputs" / "runs"
    found = {}
    for study, commands in STUDY_COMMANDS.items():
        before = set(runs_dir.glob("*")) if runs_dir.exists() else set()
        for args in commands:
            run_train(args, cwd, data_cache)
        new = [p for p in set(runs_dir.glob("*")) - before if p.is_dir()]
        (found[study],) = [p for p in new if p.name.startswith(f"{study}=")] or new
    return cwd, found


def test_every_study_has_a_run_here():
    from deit_ablate.config.studies import study_names

    assert sorted(STUDY_COMMANDS) == sorted(study_names())


def _command(name: str, study: str, run: Path, cwd: Path) -> list[str]:
    if name == "sharpness":
        return [sys.executable, "-m", "deit_ablate.sharpness", str(run), "--images", "16", "--batch-size", "16",
                "--iters", "2", "--draws", "1", *([] if study == "sam" else ["--no-wandb"])]
    if name == "disagreement":
        teacher = json.loads((run / "result.json").read_text()).get("teacher") or {}
        others = [str(run.parent / Path(teacher["run"]).name)] if teacher.get("run") else []
        return [sys.executable, "-m", "deit_ablate.disagreement", str(run), *others, "--out", str(cwd / study)]
    return [*AGGREGATE, str(cwd / "outputs"), "--rows", study, "--format", "html", "--out",
            str(cwd / study / "report.html"), "--plot", str(cwd / study / "plot.png")]


@pytest.mark.slow
@pytest.mark.parametrize("study", sorted(STUDY_COMMANDS))
@pytest.mark.parametrize("name", ["sharpness", "disagreement", "aggregate"])
def test_each_command_works_on_a_run_of_each_study_from_a_clean_shell(study_runs, data_cache, study, name):
    cwd, runs = study_runs
    (cwd / study).mkdir(exist_ok=True)
    proc = subprocess.run(_command(name, study, runs[study], cwd), cwd=cwd, env=clean_env(data_cache),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if name == "sharpness":
        assert "lambda_max" in json.dumps(json.loads((runs[study] / "result.json").read_text())["sharpness"])
    elif name == "disagreement":
        assert (cwd / study / "disagreement.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert "<h1>" in (cwd / study / "report.html").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sharpness", "disagreement"])
def test_ctrl_c_while_a_command_writes_keeps_its_previous_file(study_runs, data_cache, tmp_path, name):
    cwd, runs = study_runs
    target = runs["sam"] / "result.json" if name == "sharpness" else cwd / "sam" / "disagreement.png"
    command = _command(name, "sam", runs["sam"], cwd)
    if not target.exists():
        (cwd / "sam").mkdir(exist_ok=True)
        subprocess.run(command, cwd=cwd, env=clean_env(data_cache), check=True, capture_output=True, timeout=300)
    before = target.read_bytes()
    command = [part for part in command if part != "--no-wandb"] + (["--no-wandb"] if name == "sharpness" else [])
    status, stderr = interrupt_while_writing(command, target.name, tmp_path, clean_env(data_cache))
    assert_stopped_quietly(status, stderr, f"python -m deit_ablate.{name}")
    assert target.read_bytes() == before
    assert not [p for p in target.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("command, argv, option", [
    ("deit_ablate.analysis.sharpness", ["run", "--sigma", "nan"], "--sigma"),
    ("deit_ablate.analysis.sharpness", ["run", "--tol", "inf"], "--tol"),
    ("deit_ablate.analysis.sharpness", ["run", "--images", "-3"], "--images"),
    ("deit_ablate.analysis.status.cli", ["outputs", "--every", "nan"], "--every"),
    ("deit_ablate.analysis.status.cli", ["outputs", "--stall-after", "-1"], "--stall-after"),
    ("deit_ablate.analysis.aggregate.cli", ["outputs", "--digits", "-1"], "--digits"),
    ("deit_ablate.analysis.aggregate.cli", ["outputs", "--jobs", "0"], "--jobs"),
])
def test_a_numeric_option_out_of_range_is_an_argparse_error(capsys, command, argv, option):
    import importlib

    module = importlib.import_module(command)
    parse = getattr(module, "build_parser", None)
    with pytest.raises(SystemExit) as stop:  # it was parsed: `--sigma nan` measured and recorded nan, exit 0
        parse().parse_args(argv) if parse is not None else module.parse(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"argument {option}: {argv[2]} is out of range" in err, err


@pytest.mark.slow
@pytest.mark.parametrize("command", [[sys.executable, "-m", "deit_ablate.sharpness", "outputs/runs/x"],
                                     [sys.executable, "-m", "deit_ablate.status", "outputs"],
                                     [sys.executable, "-m", "deit_ablate.disagreement", "a", "b"], AGGREGATE + ["x"]])
def test_ctrl_c_during_a_commands_imports_is_one_line(tmp_path, data_cache, command):
    # torch, timm and wandb take seconds to import on the development machine; before 0.6 s a loaded machine may
    # still be starting the interpreter itself, where no program can take Ctrl-C over (Python's own traceback)
    for delay in (0.6, 1.2, 2.0):
        proc = subprocess.Popen(command, cwd=tmp_path, env=clean_env(data_cache), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the process group
        _, err = proc.communicate(timeout=120)
        if proc.returncode != 130:  # it ended before the signal came: nothing to check at this moment
            assert "Traceback" not in err, err[-3000:]
            continue
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "stopped by Ctrl-C" in lines[0], f"after {delay} s:\n{err[-3000:]}"

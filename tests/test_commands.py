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

from conftest import REPO, compose_config, run_train
from test_aggregate import WRITER, _done, _run

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
    spec = [{**run, "dir": str(tmp_path)} for run in (_run("base-p0", "baseline", "pretrain", 0, _done(50.0)),
                                                       _run("sgd-p0", "sgd", "pretrain", 0, _done(40.0)))]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = clean_env(data_cache)
    subprocess.run([sys.executable, "-c", WRITER, str(tmp_path / "spec.json")], check=True, env=env, timeout=120)
    out = tmp_path / "out"
    command = [*AGGREGATE, str(tmp_path / "wandb"), "--plot", str(out / "plot.png"), "--out", str(out / "t.md"), "-q"]
    subprocess.run(command, check=True, env=env, cwd=tmp_path, timeout=120, capture_output=True)
    before = (out / "plot.png").read_bytes()
    assert before.startswith(b"\x89PNG")

    assert_stopped_quietly(*interrupt_while_writing(command, "plot.png", tmp_path, env), "deit-aggregate")
    assert (out / "plot.png").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["plot.png", "t.md"]  # no temp file left

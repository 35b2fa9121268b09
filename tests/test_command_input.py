"""Paths and values the commands take as a user gives them (issue 52, point 7): an output root written `${HOME}`
(a config key to OmegaConf, which raised InterpolationKeyError from Hydra's run folder) is one line naming the key and
`${oc.env:HOME}`; a `deit-status` output root whose path holds `=` is a path, not an override."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from deit_ablate.analysis.status.cli import main as status
from deit_ablate.record.rundir import RunDir, runs_root
from tests.conftest import REPO


def train(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": str(cwd), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "offline", "DEIT_ABLATE_CACHE": str(cwd / "cache")}
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("sweep", [[], ["-m"]], ids=["run", "sweep"])
def test_an_output_root_written_dollar_home_is_one_line_naming_oc_env(tmp_path, sweep):
    done = train([*sweep, "runtime.output_root=${HOME}/out", "runtime.dry_run=true"], tmp_path)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("error: runtime.output_root=${HOME}/out does not resolve"), lines[0]
    assert "Interpolation key 'HOME' not found" in lines[0] and "'runtime.output_root=${oc.env:HOME}/out'" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written


def test_the_fix_it_names_launches(tmp_path):
    done = train(["runtime.output_root=${oc.env:HOME}/out", "runtime.dry_run=true"], tmp_path)
    assert done.returncode == 0 and "[dry run]" in done.stdout + done.stderr, done.stderr[-3000:]


def test_a_status_root_whose_path_holds_an_equals_sign_is_a_path(tmp_path, capsys):
    root = tmp_path / "lr=0.1"
    run = RunDir(runs_root(root) / "a-run")
    run.hydra.mkdir(parents=True)
    run.hydra_overrides.write_text("[ablation=no_mixup]\n")
    run.hydra_config.write_text("stage: pretrain\nseed: 0\n")
    capsys.readouterr()
    assert status([str(root), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["runs"]
    assert row["run"] == "a-run" and row["row"] == "ablation=no_mixup", row
    assert status([str(runs_root(root)), "--json"]) == 0  # its runs/ folder names it too
    assert json.loads(capsys.readouterr().out)["runs"] == [row]

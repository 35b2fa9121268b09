"""What a command imports before its first line (issue 47, point 10): a dry run and the skip of a finished run check
the launch, which builds the network with timm (so torch and timm), but log nothing (so no wandb); `deit-status` on
an output root reads folders (so no torch, timm or wandb). Each command runs for real, in a subprocess, and says at
its exit which of the heavy packages it had loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, TINY, run_train

HEAVY = ("torch", "torchvision", "timm", "wandb", "submitit", "matplotlib", "scipy")
# Run a script or a console script's function as the command line does; at exit, write which of HEAVY it loaded.
LOADED_AT_EXIT = """
import atexit, importlib, json, runpy, sys
out, heavy, target = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
atexit.register(lambda: open(out, "w").write(json.dumps([name for name in heavy if name in sys.modules])))
sys.argv = sys.argv[3:]
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    module, _, function = target.partition(":")
    sys.exit(getattr(importlib.import_module(module), function)())
"""


def loaded_by(target: str, args: list[str], cwd: Path, cache: Path) -> tuple[list[str], subprocess.CompletedProcess]:
    """Run `target` (a script, or "module:function") with `args` in `cwd`; the heavy packages it had loaded at its
    exit, and the finished process."""
    out = cwd / "loaded.json"
    command = [sys.executable, "-c", LOADED_AT_EXIT, str(out), ",".join(HEAVY), target]
    proc = run_train(args, cwd, cache, module=command, check=False)
    assert out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text()), proc


def test_a_dry_run_loads_torch_and_timm_for_the_launch_check_and_no_wandb(tmp_path, data_cache):
    loaded, proc = loaded_by(str(REPO / "train.py"), TINY + ["runtime.dry_run=true"], tmp_path, data_cache)
    assert proc.returncode == 0 and "[dry run]" in proc.stdout, proc.stderr[-3000:]
    assert loaded == ["torch", "torchvision", "timm"], loaded


def test_training_loads_neither_the_aggregators_scipy_nor_its_matplotlib(tmp_path, data_cache):
    """The analysis extra (pyproject.toml) is left out of a GPU node's wheelhouse (issue 53): a run that trains and
    logs must not need it."""
    loaded, proc = loaded_by(str(REPO / "train.py"), TINY + ["train.max_steps=2"], tmp_path, data_cache)
    assert proc.returncode == 0 and "top-1" in proc.stdout, proc.stderr[-3000:]
    assert {"torch", "timm", "wandb"} <= set(loaded) and not {"scipy", "matplotlib"} & set(loaded), loaded


def test_the_skip_of_a_finished_run_loads_no_wandb(tmp_path, data_cache, tiny_run):
    tiny_run.copy_into(tmp_path)  # the skip appends its line to the run's train.log
    loaded, proc = loaded_by(str(REPO / "train.py"), TINY, tmp_path, data_cache)
    assert proc.returncode == 0 and "already finished" in proc.stdout, proc.stderr[-3000:]
    assert loaded == ["torch", "torchvision", "timm"], loaded


def test_the_status_of_an_output_root_loads_none_of_them(tmp_path, data_cache, tiny_run):
    for root in (tiny_run.outputs, tmp_path / "empty"):
        root.mkdir(exist_ok=True)
        loaded, proc = loaded_by("deit_ablate.run.commands:deit_status", [str(root)], tmp_path, data_cache)
        assert proc.returncode == (0 if root == tiny_run.outputs else 2), proc.stderr[-3000:]
        assert loaded == [], (root, loaded)


def test_timm_comes_without_wandb_and_wandb_still_imports_after_it():
    script = ("import sys; from deit_ablate.core.imports import keep_wandb_out_of_timm as keep; keep(); keep(); "
              "import timm; print('wandb' in sys.modules); import wandb; print(wandb.Settings.__name__)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and proc.stdout.split() == ["False", "Settings"], (proc.stdout, proc.stderr[-3000:])


def test_an_analysis_command_without_its_extra_says_how_to_install_it(capsys):
    from deit_ablate.run.commands import ANALYSIS_EXTRA, run_entry

    assert ANALYSIS_EXTRA == ("scipy", "matplotlib")
    status = run_entry("deit-aggregate", "deit_ablate.analysis.aggregate.cli:main", needs=("no_such_package_53",))
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert "needs no_such_package_53" in err and "pip install 'deit-ablate[analysis]'" in err

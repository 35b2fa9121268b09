"""Team folders: what a run, the built-in data and the atomic writers create follows the umask (a teammate in the
same group can read it), and a folder this user may not read is one line, not a PermissionError traceback."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from deit_ablate.core.atomic import atomic_folder, write_text_atomic
from deit_ablate.data.builtin import ensure_builtin_dataset
from deit_ablate.record.checkpoint import save_atomic
from deit_ablate.record.rundir import RunDir, wandb_root
from deit_ablate.record.tracking import write_epoch_row
from tests.conftest import REPO, TINY

NOBODY = 65534


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@contextlib.contextmanager
def umask(value: int):
    """This process's umask set to `value` for the block (what a user's shell sets)."""
    before = os.umask(value)
    try:
        yield
    finally:
        os.umask(before)


@pytest.mark.parametrize(("mask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o002, 0o664, 0o775)])
def test_files_and_folders_follow_the_umask(tmp_path, mask, file_mode, dir_mode):
    with umask(mask):
        save_atomic({"step": torch.tensor(1)}, tmp_path / "run" / "checkpoint-last.pt")
        save_atomic({"step": torch.tensor(2)}, tmp_path / "run" / "checkpoint-last.pt",
                    keep_previous=tmp_path / "run" / "checkpoint-prev.pt")
        write_epoch_row(tmp_path / "run" / "metrics.csv", {"epoch": 0, "val/top1": 10.0})
        write_text_atomic(tmp_path / "run" / "result.json", "{}")
        made = atomic_folder(tmp_path / "made", lambda staging: (staging / "x").write_text("x"), lambda: False)
        data = ensure_builtin_dataset(tmp_path / "builtin", 16, 2, 1)
    files = [tmp_path / "run" / name for name in ("checkpoint-last.pt", "checkpoint-prev.pt", "metrics.csv",
                                                  "result.json")]
    files += [made / "x", *[p for p in data.rglob("*") if p.is_file()]]
    assert {str(p): oct(mode(p)) for p in files} == {str(p): oct(file_mode) for p in files}  # they were 0600
    folders = [made, data, *[p for p in data.rglob("*") if p.is_dir()]]
    assert {str(p): oct(mode(p)) for p in folders} == {str(p): oct(dir_mode) for p in folders}  # the data's 0700


def test_a_run_writes_its_checkpoints_and_metrics_for_the_group(tiny_run):
    mask = os.umask(0)
    os.umask(mask)
    run = RunDir(tiny_run.run_dir())
    for path in (run.last_checkpoint, run.best_checkpoint, run.metrics, run.result, run.identity):
        assert mode(path) == 0o666 & ~mask, (path, oct(mode(path)))


def _as_another_user() -> list[str] | None:
    """The command prefix that runs a command as a user who may not read root's 0700 folders (nobody, as root),
    [] when this process is not root (chmod stops it already), None when neither can be had."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        return None
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


@pytest.mark.slow
def test_a_teacher_run_or_logs_this_user_may_not_read_are_one_line(tiny_run):
    prefix = _as_another_user()
    if prefix is None:
        pytest.skip("needs root with setpriv, or a user other than root")
    shared = Path(tempfile.mkdtemp(prefix="team-"))  # pytest's own folders are 0700: nobody could reach anything
    try:
        os.chmod(shared, 0o755)
        teacher = shared / "teacher_run"
        shutil.copytree(tiny_run.run_dir(), teacher)
        shutil.copytree(wandb_root(tiny_run.outputs), shared / "wandb", symlinks=True)
        for top in (teacher, shared / "wandb"):
            for folder, _, _ in os.walk(top):
                os.chmod(folder, 0o700)  # as a teammate's umask 077 left them
        work = shared / "student"
        work.mkdir(mode=0o777)
        os.chmod(work, 0o777)
        env = {**os.environ, "HOME": str(work), "DEIT_ABLATE_CACHE": str(work / "cache"), "WANDB_SILENT": "true",
               "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        student = [*prefix, sys.executable, str(REPO / "train.py"), *TINY, "distill=hard", "train.max_steps=1",
                   f"distill.teacher.checkpoint={teacher}", "runtime.tracking.mode=disabled"]
        aggregate = [*prefix, sys.executable, "-m", "deit_ablate.analysis.aggregate.cli", str(shared / "wandb")]
        for command, named in ((student, teacher), (aggregate, shared / "wandb")):
            proc = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
            assert "PermissionError" not in proc.stderr, proc.stderr[-3000:]  # nor Hydra's callback warning
            assert f"error: {named}" in proc.stderr and "cannot be opened by this user (Permission denied)" in \
                proc.stderr, proc.stderr[-3000:]
    finally:
        shutil.rmtree(shared, ignore_errors=True)

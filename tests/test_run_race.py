"""Two launches of one experiment that start together, before either made its folder, under two folder names (the
same run spelled two ways: a row equal to the default, or two rows sharing a run): one trains it, the other waits
for it and skips, naming the folder that holds it (issue 52, point 10; record/runlock.py's experiment lock)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, TINY

from deit_ablate.record.rundir import RESULT, runs_root


@pytest.mark.slow  # about 13 s: two launches, the second polling the lock every 5 s
def test_two_launches_of_one_experiment_started_together_train_it_once(tmp_path, data_cache):
    env = {**os.environ, "DEIT_ABLATE_CACHE": str(data_cache), "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    args = [*TINY, "train.epochs=2", "runtime.cpu_threads=1", "runtime.tracking.mode=disabled",
            "runtime.wait_for_lock=true"]
    spellings = [args, [*args, "mix=mixup_cutmix"]]  # the default option named: one experiment, two folder names
    procs = [subprocess.Popen([sys.executable, str(REPO / "train.py"), *spelled], cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for spelled in spellings]
    outs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    folders = sorted(runs_root(tmp_path / "outputs").iterdir())
    results = [folder for folder in folders if (folder / RESULT).exists()]
    assert len(results) == 1, folders  # trained once: one folder holds the result
    skipped = [out for out, _ in outs if "already finished" in out + _]
    assert len(skipped) == 1 and results[0].name in "".join(skipped[0]), outs
    assert [folder.name for folder in folders if not folder.name.startswith(".")] == [results[0].name]  # no empty one

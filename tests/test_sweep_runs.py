"""A sweep's runs side by side in one process and beside other sweeps: what one run leaves for the next (loader
workers), a run two rows share (its records, its status row), a run another sweep holds."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, TINY, run_train


@pytest.mark.slow
def test_a_sweeps_runs_start_with_no_loader_worker_of_the_runs_before(tmp_path, data_cache):
    counts = tmp_path / "forks.jsonl"
    tiny = [o for o in TINY if not o.startswith("runtime.num_workers=")]
    run_train(["-m", "seed=0,1,2", *tiny, "runtime.num_workers=2",
               "+hydra.callbacks.children._target_=child_count.ChildCount"], tmp_path, data_cache,
              extra_env={"CHILD_COUNT_FILE": str(counts), "PYTHONPATH": str(REPO / "tests")})
    seen = [json.loads(line) for line in counts.read_text().splitlines()]
    assert [(s["seed"], len(s["forks"])) for s in seen] == [(0, 0), (1, 0), (2, 0)], seen

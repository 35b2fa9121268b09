"""One experiment, one run: launches whose overrides spell the same experiment differently train it once, in one
folder, and the dry run says which rows compute the same (issue: two folders trained twice, the aggregator then
dropping one as a duplicate)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO, TINY, run_train

# `ablation=baseline` is the default row: the same experiment as no row at all, under another folder name.
SPELLINGS = (["ablation=baseline"], [])


def test_two_launches_of_one_experiment_under_two_names_train_it_once(tmp_path, data_cache):
    env = {**os.environ, "DEIT_ABLATE_CACHE": str(data_cache), "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    args = [*TINY, "runtime.wait_for_lock=true"]
    run_train(["runtime.dry_run=true", *args], tmp_path, data_cache)  # the built-in data drawn before the race
    launches = [subprocess.Popen([sys.executable, str(REPO / "train.py"), *spelling, *args], cwd=tmp_path, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for spelling in SPELLINGS]
    outputs = [launch.communicate(timeout=300)[0] for launch in launches]
    assert [launch.returncode for launch in launches] == [0, 0], outputs
    folders = [p for p in (tmp_path / "outputs" / "runs").iterdir()]
    assert len(folders) == 1, (folders, outputs)  # the other name's empty folder removed, no lock folder left
    trained = [out for out in outputs if "[epoch 1]" in out]
    assert len(trained) == 1, outputs
    assert (folders[0] / "result.json").is_file()
    other = outputs[1 - outputs.index(trained[0])]
    assert "already finished" in other and folders[0].name in other, other


def test_the_dry_run_names_rows_that_compose_the_same_experiment(tmp_path, data_cache, monkeypatch):
    """`deit3=baseline` and `recipe=deit3 model=vit_base`: one experiment (one digest), two folder names."""
    from deit_ablate.config.compose import compose_run_config
    from deit_ablate.run.lifecycle import same_computation_lines
    from deit_ablate.run.preflight import sweep_plans

    monkeypatch.setenv("DEIT_ABLATE_CACHE", str(data_cache))
    rows = [["deit3=baseline", *TINY], ["recipe=deit3", "model=vit_base", *TINY], ["deit3=randaugment", *TINY]]
    configs = [compose_run_config([*row, f"runtime.output_root={tmp_path}"]) for row in rows]
    plans = list(sweep_plans(configs, [tmp_path / str(i) for i in range(len(rows))], job_log=False))
    assert plans[0].identity.digest == plans[1].identity.digest != plans[2].identity.digest
    lines = same_computation_lines(plans)
    assert len(lines) == 1 and "computes the same as row deit3=baseline" in lines[0], lines
    assert "the same experiment, composed from other options" in lines[0]


def test_a_launch_stopped_while_holding_the_experiment_lock_leaves_the_folder_lock_to_decide(tmp_path):
    """A launch stopped (SIGSTOP, a debugger) after taking its run folder's lock, before letting go of the experiment's:
    a second launch of the run goes on to the folder's lock, which names the holder, instead of waiting forever."""
    import threading

    from deit_ablate.core.distributed import DistInfo
    from deit_ablate.run.lifecycle import experiment_lock

    run_dir, digest = tmp_path / "runs" / "run", "0123456789"
    run_dir.mkdir(parents=True)
    hold = ("import sys, time; from pathlib import Path; from deit_ablate.record.runlock import RunLock; "
            "[RunLock(Path(p)).try_acquire() for p in sys.argv[1:]]; print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run_dir.parent / ".experiments" / digest), str(run_dir)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        (run_dir.parent / ".experiments" / digest).mkdir(parents=True)
        assert holder.stdout.readline() == "held\n"
        entered = threading.Event()

        def second_launch() -> None:
            with experiment_lock(run_dir, digest, DistInfo(), poll_s=0.01):
                entered.set()

        thread = threading.Thread(target=second_launch, daemon=True)
        thread.start()
        assert entered.wait(timeout=10), "the second launch waits on the experiment lock of a launch stopped there"
    finally:
        holder.kill()
        holder.wait()

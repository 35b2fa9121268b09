"""The SLURM launcher's own task wrapper, without a cluster: what a requeued task cleans up before it runs."""

from __future__ import annotations

from hydra_plugins.deit_ablate_launcher.slurm import _remove_stale_result_file

SLURM_TASK_5_OF_8 = {"SLURM_JOB_ID": "27", "SLURM_PROCID": "5", "SLURM_LOCALID": "5", "SLURM_NTASKS": "8",
                     "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "vm",
                     "SUBMITIT_EXECUTOR": "slurm"}


def test_a_requeued_task_removes_only_its_own_half_saved_result(tmp_path, monkeypatch):
    for key, value in {**SLURM_TASK_5_OF_8, "SUBMITIT_FOLDER": str(tmp_path)}.items():
        monkeypatch.setenv(key, value)
    own, other = tmp_path / "27_5_result.pkl.save_tmp", tmp_path / "27_4_result.pkl.save_tmp"
    own.write_bytes(b"")  # what a task killed while saving its result leaves behind (seen in a requeue test)
    other.write_bytes(b"")
    _remove_stale_result_file()
    assert not own.exists() and other.exists()


def test_outside_a_submitit_job_it_does_nothing(monkeypatch):
    monkeypatch.delenv("SUBMITIT_FOLDER", raising=False)
    for key in SLURM_TASK_5_OF_8:
        monkeypatch.delenv(key, raising=False)
    _remove_stale_result_file()  # no job at all
    for key, value in SLURM_TASK_5_OF_8.items():
        monkeypatch.setenv(key, value)
    _remove_stale_result_file()  # a SLURM task that submitit did not start (no SUBMITIT_FOLDER)

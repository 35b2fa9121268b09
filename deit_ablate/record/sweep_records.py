"""What a sweep leaves in its runs root beside the run folders: the SLURM job of each submitted run, the sweep's
config (file names in record/rundir.py)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from deit_ablate.core.atomic import write_json_atomic
from deit_ablate.record.rundir import SLURM_JOBS, SWEEP_RECORD
from deit_ablate.record.runfiles import DamagedRecord, read_json

if TYPE_CHECKING:
    from omegaconf import DictConfig


def slurm_jobs_file(runs_root: Path) -> Path:
    """`<runs root>/slurm-jobs.json`: the SLURM job id of each submitted run (its folder's name)."""
    return Path(runs_root) / SLURM_JOBS


def read_slurm_jobs(runs_root: Path) -> dict[str, str]:
    """SLURM job id -> run folder name, as the SLURM launcher recorded them (empty without a record)."""
    try:  # bounded, never waiting on a FIFO; a damaged record is no record (the status falls back on progress.json)
        jobs = read_json(slurm_jobs_file(runs_root))
    except (OSError, DamagedRecord):
        return {}
    return {str(k): str(v) for k, v in jobs.items()} if isinstance(jobs, dict) else {}


def record_slurm_jobs(runs_root: Path, jobs: Mapping[str, str]) -> None:
    """Add `jobs` (SLURM job id -> run folder name) to the runs root's record, atomically."""
    write_json_atomic(slurm_jobs_file(runs_root), {**read_slurm_jobs(runs_root), **jobs})


def keep_sweep_record(config: DictConfig) -> Path:
    """Save the sweep's config as `multirun-<start time>.yaml` in its sweep folder, never over another sweep's."""
    from omegaconf import OmegaConf

    sweep_dir = Path(str(config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    n = 1
    while True:
        path = sweep_dir / SWEEP_RECORD.format(stamp if n == 1 else f"{stamp}-{n}")
        try:
            with path.open("x") as file:
                OmegaConf.save(config, file)
            return path
        except FileExistsError:  # another sweep started in the same second
            n += 1

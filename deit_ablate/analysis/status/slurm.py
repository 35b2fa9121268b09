"""SLURM's view of a sweep's jobs: squeue for the queued and running ones, sacct for those that ended. Each query
has a short timeout; where the commands do not exist (no SLURM) or fail, the answer is simply empty."""

from __future__ import annotations

import getpass
import shutil
import subprocess
from collections.abc import Collection
from dataclasses import dataclass

SLURM_TIMEOUT_S = 5.0  # the longest a squeue or sacct call may take before the status goes on without it


@dataclass(frozen=True)
class SlurmJob:
    """One job as SLURM reports it: its state (PENDING, RUNNING, ...), the reason it waits, its nodes."""

    job_id: str
    state: str
    reason: str = ""
    nodes: str = ""


def _query(command: list[str]) -> list[list[str]]:
    """The `|`-separated lines a SLURM command prints; empty where it is missing, fails or takes too long."""
    if shutil.which(command[0]) is None:
        return []
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    return [line.split("|") for line in done.stdout.splitlines() if line.strip()]


def slurm_jobs(job_ids: Collection[str]) -> dict[str, SlurmJob]:
    """The jobs among `job_ids` that SLURM knows: queued or running (squeue), else ended (sacct)."""
    if not job_ids:
        return {}
    found = {}  # this user's jobs, not `-j <ids>`: squeue refuses a list holding a job it has forgotten
    for fields in _query(["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%i|%T|%r|%N"]):
        if len(fields) == 4 and fields[0] in job_ids:
            found[fields[0]] = SlurmJob(fields[0], fields[1], "" if fields[2] == "None" else fields[2], fields[3])
    missing = sorted(set(job_ids) - set(found))
    if missing:
        for fields in _query(["sacct", "-n", "-P", "-X", "-j", ",".join(missing), "-o", "JobID,State,NodeList"]):
            if len(fields) == 3 and fields[0] in job_ids:
                found[fields[0]] = SlurmJob(fields[0], fields[1].split()[0], "", fields[2])
    return found

"""One launch at a time per run folder: a lock file saying who trains the run, safe on shared file systems.

The lock (`run.lock` in the run folder) is written to a private file and hard-linked into place, which is atomic
(and fails if the lock exists) on local disks, NFS and Lustre, so it never exists half-written. It holds the
holder's host, pid, process start, start time and SLURM job. Its holder
refreshes its modification time every minute. A lock counts as stale, and is taken over, when
- it was left by an earlier attempt of the same SLURM job (a requeued job: same SLURM_JOB_ID, another
  SLURM_RESTART_COUNT; SLURM ends an attempt before it starts the next),
- or its holder ran on this host and that process is gone (or its pid now belongs to another process),
- or its holder ran on another host and it has not been refreshed for STALE_AFTER_S (a crashed node).
The same lock, in the runs root and named by the experiment's digest (EXPERIMENT_LOCK), covers every folder of one
experiment. A takeover renames the stale lock aside and checks that it moved the lock it judged, so two launches that
find the same stale lock do not both take it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from deit_ablate.core.atomic import write_text_atomic
from deit_ablate.record.rundir import LOCK, LOCK_ASIDE
from deit_ablate.record.runfiles import read_bytes

LOCK_NAME = LOCK  # the name older imports use; the folder's layout is rundir's
# The lock of an experiment in the runs root, by its digest: held by the launch that trains it under whatever folder
# name (a row spelled two ways, two rows sharing a run), from before it decides to train until it ends; two launches
# that start before either made its folder thus train it once.
EXPERIMENT_LOCK = ".experiment-{}.lock"
REFRESH_S = 60.0
STALE_AFTER_S = 600.0  # a lock from another host not refreshed for 10 minutes is stale


def _proc_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), or None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of the line, counted after the command name


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def this_process() -> dict[str, Any]:
    """What a lock records about its holder."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "proc_start": _proc_start(os.getpid()),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "slurm_job": os.environ.get("SLURM_JOB_ID"), "slurm_restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
            "token": uuid.uuid4().hex}


def describe(holder: dict[str, Any] | None, age_s: float) -> str:
    """`pid 12 on host n1 since 2026-... (SLURM job 7), refreshed 5 s ago` for a message."""
    if not holder:
        return f"a launch whose lock is still being written (age {age_s:.0f} s)"
    slurm = f" (SLURM job {holder['slurm_job']})" if holder.get("slurm_job") else ""
    return (f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('started')}{slurm}, "
            f"refreshed {age_s:.0f} s ago")


def stale_reason(holder: dict[str, Any] | None, age_s: float, me: dict[str, Any]) -> str | None:
    """Why a lock no longer protects a live launch (as seen by process `me`), or None while it does."""
    if not holder:
        return f"an empty lock not written for {age_s:.0f} s" if age_s > STALE_AFTER_S else None
    if holder.get("slurm_job") and holder.get("slurm_job") == me["slurm_job"] \
            and holder.get("slurm_restart") != me["slurm_restart"]:
        return f"an earlier attempt of SLURM job {me['slurm_job']} (requeued)"
    if holder.get("host") == me["host"]:
        pid = int(holder.get("pid", -1))
        if pid == me["pid"]:  # this process takes a run's lock once: an earlier holder with our pid is gone
            return f"pid {pid} is this process now"
        if not _pid_alive(pid):
            return f"pid {pid} is gone"
        start = _proc_start(pid)
        if holder.get("proc_start") and start and start != holder["proc_start"]:
            return f"pid {pid} is gone (the number now belongs to another process)"
        return None
    return f"not refreshed for {age_s:.0f} s" if age_s > STALE_AFTER_S else None


def read_lock(path: Path) -> tuple[str, dict[str, Any] | None, float]:
    """A lock's text, its parsed holder (None if empty or damaged) and its age in seconds (OSError when none)."""
    text = read_bytes(path).decode(errors="replace")  # never waits on a FIFO; a damaged lock has no holder
    age = max(time.time() - path.stat().st_mtime, 0.0)
    try:
        holder = json.loads(text)
    except ValueError:
        holder = None
    return text, holder if isinstance(holder, dict) else None, age


def live_holder(run_dir: Path) -> str | None:
    """The live launch that holds the lock of `run_dir`, described; None when none does (no lock, a stale one)."""
    try:
        _, holder, age = read_lock(Path(run_dir) / LOCK_NAME)
    except OSError:
        return None
    return describe(holder, age) if stale_reason(holder, age, this_process()) is None else None


class RunLock:
    """The lock of one run folder, taken by the main rank only; refreshed by a daemon thread while held."""

    def __init__(self, run_dir: Path, name: str = LOCK_NAME) -> None:
        self.path = Path(run_dir) / name
        self.me = this_process()
        self.taken_over: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> tuple[str, dict[str, Any] | None, float]:
        """read_lock of this lock."""
        return read_lock(self.path)

    def _create(self) -> bool:
        """Create the lock with our record; False if it exists. The record is written to a private file first
        and hard-linked into place (atomic, and fails if the lock exists), so a kill never leaves an empty lock."""
        try:
            write_text_atomic(self.path, json.dumps(self.me), exclusive=True)
        except FileExistsError:
            return False
        except OSError:  # a file system without hard links: exclusive create, then write (the old window)
            return self._create_in_place()
        return True

    def _create_in_place(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(self.me))
            handle.flush()
            os.fsync(handle.fileno())
        return True

    def _take_over(self, seen: str) -> None:
        """Move the stale lock aside; put it back if what moved is not the lock judged stale (a new holder's)."""
        aside = self.path.with_name(LOCK_ASIDE.format(self.me["token"]))
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if aside.read_text() != seen:
            try:
                os.link(aside, self.path)
            except OSError:
                pass
        aside.unlink(missing_ok=True)

    def try_acquire(self) -> str | None:
        """Take the lock; None when taken, else a description of the live holder."""
        for _ in range(5):
            if self._create():
                self._start_refresh()
                return None
            try:
                text, holder, age = self._read()
            except FileNotFoundError:
                continue
            reason = stale_reason(holder, age, self.me)
            if reason is None:
                return describe(holder, age)
            self.taken_over.append(f"{describe(holder, age)}: {reason}")
            self._take_over(text)
        return "another launch taking the same lock at the same moment"

    def _start_refresh(self) -> None:
        """Touch the lock every REFRESH_S while it is held, so other hosts see it alive."""
        def refresh() -> None:
            while not self._stop.wait(REFRESH_S):
                try:
                    os.utime(self.path)
                except OSError:
                    return
        self._thread = threading.Thread(target=refresh, name="run-lock-refresh", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop refreshing and delete the lock if it is still ours."""
        self._stop.set()
        try:
            if json.loads(self.path.read_text()).get("token") == self.me["token"]:
                self.path.unlink()
        except (OSError, ValueError, AttributeError):
            pass

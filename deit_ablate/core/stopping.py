"""SIGTERM (a scheduler's kill) and Ctrl-C stop a run at its next step with a checkpoint, instead of losing work.

The first SIGTERM or SIGINT asks the run to stop: it saves a resumable checkpoint at the next step (or keeps the
epoch-end one it has just written), releases its lock, prints how to resume and exits with 128 + the signal's
number. A second Ctrl-C stops at once. A stop asked before the first step saves nothing (there is nothing new) and
says so. The loader workers ignore both signals (data/loader.py), so a signal to the whole process group (what
`timeout`, SLURM and systemd send, and a terminal's Ctrl-C) stops the run the same way; once a stop is pending, a
worker killed anyway no longer raises torch's error in the middle of a step (its SIGCHLD handler is set aside) and
the loop stops on the loader's error instead (run/loop.py). A worker killed with no stop pending (SIGKILL from the
kernel's out-of-memory killer) is not raised wherever the main thread is either (a checkpoint's fsync, a backward
pass): torch's SIGCHLD handler is deferred to the loop's step boundaries (`WorkerDeaths`), where the run saves its
last finished step and ends in one line naming the worker and its signal. Inside a submitit job SIGTERM and USR2
are left to submitit, which checkpoints and requeues the job itself.
"""

from __future__ import annotations

import os
import signal
import threading

import torch

from deit_ablate.core.distributed import DistInfo
from deit_ablate.core.errors import RunError

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequested(Exception):
    """The run stopped on a signal, its state saved; the same command resumes it."""

    def __init__(self, signum: int, where: str = "") -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}{' ' + where if where else ''}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def in_submitit_job() -> bool:
    """Whether this process is a task of a submitit job (which handles SIGTERM and USR2 itself)."""
    return "SUBMITIT_EXECUTOR" in os.environ


class WorkerLost(RunError):
    """A loader worker died with no stop pending: the run saved its last finished step; the same command resumes it."""


class WorkerDeaths:
    """While entered, a loader worker's death is noted by SIGCHLD and raised (torch's `DataLoader worker (pid N) is
    killed by signal` RuntimeError) only where `check` is called: between steps, not inside a checkpoint write."""

    def __init__(self) -> None:
        self.noted = False
        self._previous: object | None = None

    def __enter__(self) -> WorkerDeaths:
        if hasattr(signal, "SIGCHLD") and threading.current_thread() is threading.main_thread():
            from torch.utils.data._utils import signal_handling

            signal_handling._set_SIGCHLD_handler()  # torch's, once per process: it installs no other after ours
            self._previous = signal.signal(signal.SIGCHLD, self._note)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None and signal.getsignal(signal.SIGCHLD) == self._note:  # not set aside by a stop
            signal.signal(signal.SIGCHLD, self._previous)
        self._previous = None

    def _note(self, signum: int, frame) -> None:
        self.noted = True

    def check(self) -> None:
        """Raise torch's error for a loader worker that died since the last check (other children are not its)."""
        if self.noted:
            self.noted = False
            from torch.utils.data._utils import signal_handling

            signal_handling._error_if_any_worker_fails()


class StopSignals:
    """While entered, SIGTERM and SIGINT set `requested`; a second SIGINT raises KeyboardInterrupt at once."""

    def __init__(self, info: DistInfo, every_steps: int = 10) -> None:
        self.info, self.every_steps = info, max(1, every_steps)
        self.requested: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in _SIGNALS:
                if signum == signal.SIGTERM and in_submitit_job():
                    continue
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.requested is None and self.info.is_main:
            name = signal.Signals(signum).name
            os.write(2, f"\n[run] {name} received: saving a checkpoint at the next step, then stopping "
                        "(Ctrl-C again stops at once)\n".encode())
        if self.requested is None:
            self._quiet_worker_deaths()
        self.requested = self.requested or signum

    def _quiet_worker_deaths(self) -> None:
        """Set aside torch's SIGCHLD handler, which raises a dead loader worker's error wherever the main thread is (in
        a backward pass, a checkpoint write, wandb's wait for its service at exit): during a stop the loader's own
        check raises it between steps. Not restored: the process is ending."""
        if hasattr(signal, "SIGCHLD"):
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    def before_training(self, resumed_from: object | None) -> None:
        """Raise StopRequested for a stop asked before the first step (on any rank: they agree, as at an epoch's end):
        nothing new to save, and the line says so."""
        signum = self.agreed()
        if signum is None:
            return
        where = (f"before the first step of this launch: nothing new to save; the same command resumes it from "
                 f"{resumed_from}" if resumed_from is not None else
                 "before the first step: nothing to save; the same command starts the run")
        raise StopRequested(signum, where)

    def agreed(self, step: int | None = None) -> int | None:
        """The signal every rank stops on, or None: each rank's own flag in one process; under DDP the ranks
        agree (one all-reduce) every `every_steps` steps and whenever `step` is None (an epoch's end)."""
        if not self.info.enabled:
            return self.requested
        if step is not None and step % self.every_steps:
            return None
        import torch.distributed as dist

        flag = torch.tensor([self.requested or 0], device=self.info.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None

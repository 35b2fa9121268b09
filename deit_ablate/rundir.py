"""The layout of a run folder: every module asks `RunDir` for its paths."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from deit_ablate.errors import ConfigError, RunError

# The files of a run folder.
LAST, PREV, BEST = "checkpoint-last.pt", "checkpoint-prev.pt", "checkpoint-best.pt"
RESULT, IDENTITY, METRICS, LOCK, LOG = "result.json", "identity.json", "metrics.csv", "run.lock", "train.log"
HYDRA = ".hydra"
# The folders a launch writes under runtime.output_root: Hydra's run folders, and wandb's logs.
RUNS, WANDB = "runs", "wandb"
SWEEP_RECORD = "multirun-{}.yaml"  # beside Hydra's multirun.yaml in the sweep folder, <output_root>/runs
RESULT_STATUSES = ("finished", "diverged", "failed")


def read_result(path: Path) -> dict[str, Any]:
    """A run's result.json; a ConfigError naming the file when it is not one this code wrote."""
    try:
        result = json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as error:
        problem = f"not JSON ({type(error).__name__}: {str(error)[:80]})"
    else:
        if isinstance(result, dict) and result.get("status") in RESULT_STATUSES:
            return result
        problem = (f"a {type(result).__name__}, not a result" if not isinstance(result, dict)
                   else f"no status of {', '.join(RESULT_STATUSES)} in it")
    raise ConfigError(f"{path} is not a run result ({problem}). Delete it: the run then resumes from its "
                      "checkpoint (or starts again) and writes it anew.")


def _human_bytes(count: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def no_space_error(path: Path, written: int | None = None) -> RunError:
    """The message for a full disk: the file, the free space there, what is intact and what to do."""
    usage = shutil.disk_usage(path.parent)
    needed = f" (the write stopped at {_human_bytes(written)})" if written else ""
    intact = (f"The previous {path.name} is intact, so nothing before it is lost. " if path.exists() else "")
    return RunError(f"no space left on the device while writing {path}{needed}: {_human_bytes(usage.free)} free of "
                    f"{_human_bytes(usage.total)} there now. {intact}Free some space (or point runtime.output_root "
                    "elsewhere) and launch the same command again: the run resumes from its last checkpoint.")


def is_no_space(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from, is ENOSPC (torch.save wraps the OSError of its write)."""
    for _ in range(4):
        if error is None:
            return False
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        error = error.__cause__ or error.__context__
    return False


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write a small JSON file via a temp file and a rename (a full disk is a RunError)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(payload, indent=2))
        tmp.replace(path)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        if is_no_space(error):
            raise no_space_error(path) from None
        raise


def folder_problem(path: Path) -> str | None:
    """Why a run could not create `path` or write into it (a file in the way, a read-only folder), or None."""
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if os.access(existing, os.W_OK | os.X_OK):  # root too: access() reports a read-only mount
        return None
    read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
    why = "read-only file system" if read_only else f"no write permission for this user (uid {os.geteuid()})"
    return f"{existing} is not writable ({why})"


def check_output_root(output_root: str | Path, tracking: bool = True) -> None:
    """runtime.output_root, its runs/ and (with tracking) its wandb/ can be made and written: else a ConfigError
    naming the folder and the fix, raised before anything is written."""
    root = Path(output_root)
    for path in (root, root / RUNS):
        problem = folder_problem(path)
        if problem is not None:
            raise ConfigError(f"runtime.output_root={output_root} cannot hold the run folders: {problem}. "
                              "Point runtime.output_root at a folder this user can write, e.g. "
                              "runtime.output_root=outputs (under the current folder).")
    problem = folder_problem(root / WANDB) if tracking else None
    if problem is not None:
        raise ConfigError(f"{root / WANDB}, where wandb writes the logs of runtime.output_root={output_root}, cannot "
                          f"be written: {problem}. Make it writable, point runtime.output_root elsewhere, or set "
                          "runtime.tracking.mode=disabled (no wandb log; metrics.csv is still written).")


@dataclass(frozen=True)
class RunDir:
    """One run's folder under <runtime.output_root>/runs: checkpoints, result, identity, logs, Hydra's config."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def last_checkpoint(self) -> Path:
        return self.path / LAST

    @property
    def best_checkpoint(self) -> Path:
        return self.path / BEST

    @property
    def previous_checkpoint(self) -> Path:
        return self.path / PREV

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def lock(self) -> Path:
        return self.path / LOCK

    @property
    def result(self) -> Path:
        return self.path / RESULT

    @property
    def identity(self) -> Path:
        return self.path / IDENTITY

    @property
    def hydra(self) -> Path:
        return self.path / HYDRA

    @property
    def log(self) -> Path:
        return self.path / LOG

    def read_result(self) -> dict[str, Any] | None:
        """The run's result.json, or None while it has none."""
        return read_result(self.result) if self.result.exists() else None

    def write_result(self, payload: dict[str, Any]) -> None:
        write_json_atomic(self.result, payload)

    def read_identity(self) -> dict[str, Any] | None:
        """What the run recorded about itself when it first started (digest, data fingerprint), or None."""
        return json.loads(self.identity.read_text()) if self.identity.exists() else None

    def write_identity(self, payload: dict[str, Any]) -> None:
        write_json_atomic(self.identity, payload)

    def weights(self) -> Path:
        """The checkpoint to take weights from (e.g. a teacher): the best one, else the last."""
        return self.best_checkpoint if self.best_checkpoint.exists() else self.last_checkpoint

    def discard_if_empty(self) -> None:
        """Remove the folder when it holds nothing of the run's own (only what Hydra wrote before it failed)."""
        own_logs = re.compile(r"train(-rank\d+)?\.log")
        if self.path.is_dir() and all(p.name == HYDRA or own_logs.fullmatch(p.name) for p in self.path.iterdir()):
            shutil.rmtree(self.path, ignore_errors=True)


def find_run(reference: Path, runs_root: Path) -> RunDir | None:
    """The run folder `reference` names: a folder, a run name under `runs_root`, or the start of exactly one run's
    name (its readable overrides without the hash, e.g. `outputs/runs/model=cnn_demo`); None if it names a file."""
    if reference.is_file():
        return None
    for candidate in (reference, runs_root / reference):
        if candidate.is_dir():
            return RunDir(candidate)
    places = [(reference.parent, reference.name)] + ([] if reference.is_absolute() else [(runs_root, str(reference))])
    for parent, stem in places:
        matches = sorted(parent.glob(f"{stem}-*")) if parent.is_dir() else []
        matches = [m for m in matches if m.is_dir() and len(m.name) == len(stem) + 11]  # stem + "-" + 10 hex
        if len(matches) == 1:
            return RunDir(matches[0])
    return None


def keep_sweep_record(config: DictConfig) -> Path:
    """Save the sweep's config as `multirun-<start time>.yaml` in its sweep folder, never over another sweep's."""
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

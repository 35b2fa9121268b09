"""The layout of a run folder, and its roots: every module asks this one for a path, none spells a name.

    <runtime.output_root>/
      runs/                       runs_root(): Hydra's run.dir and sweep.dir (conf/config.yaml, checked against
                                  RUNS by tests/test_rundir.py)
        multirun.yaml             Hydra's sweeper, at the start of each `-m` sweep (rewritten by every sweep)
        multirun-<time>.yaml      sweep_records.keep_sweep_record(), our sweeper: each sweep's own copy, never
                                  overwritten
        slurm-jobs.json           sweep_records.record_slurm_jobs(), the SLURM launcher: each submitted job's id ->
                                  its run folder's name (how the status finds a run's job while it is still queued)
        .submitit/<job>/          submitit's logs and pickles, SLURM sweeps only (conf/hydra/launcher/*.yaml)
        <run name>/               one RunDir; the name is identity.folder_name() (readable overrides + digest)
          .hydra/config.yaml      RunDir.record_launch (rank 0), by the first launch that trains the run or records
          .hydra/overrides.yaml   it without training, never by one that skips it (Hydra writes none: conf/config.yaml
          .hydra/hydra.yaml       hydra.output_subdir); read by teacher.py (a teacher run's model, the command that
                                  relaunches a run) and deit-status (a run's row, stage and seed)
          .hydra/later-launches.yaml  RunDir.record_launch: each later launch that trains the run (its time and
                                  overrides); the files above stay as the first launch wrote them
          train.log               logs.attach_run_log, from the start of run() to its end (rank 0; appended on
          train-rank<N>.log       each launch); the same for rank N > 0
          run.lock                runlock.RunLock, held while a launch trains the run (rank 0; refreshed every
                                  minute, deleted at the end); staged as .run.lock.<random>.tmp, moved aside to
                                  run.lock.stale-<token> while a stale one is taken over
          identity.json           RunDir.record_identity, once, when the run first trains (or is recorded without
                                  training): name, run_id, experiment_digest, data_fingerprint, teacher
          checkpoint-last.pt      checkpoint.save_atomic: every runtime.checkpoint_every_* and at each epoch's end
          checkpoint-prev.pt      the checkpoint-last.pt that the newest write replaced (one older good copy)
          checkpoint-best.pt      at the end of an epoch with a new best top-1 (a teacher's weights come from it)
          <checkpoint>.unreadable checkpoint.set_aside: a checkpoint a resume could not read, kept for a person
          metrics.csv             tracking.Tracker, one row per epoch (rows from before a resume replaced)
          progress.json           progress.ProgressFile (rank 0), while a launch trains: state, step of total,
                                  images/s, top-1, holder (pid, host, SLURM job); at most every few seconds, at
                                  each epoch's end and at the end (read by `deit-status`, never by the run)
          predictions.npz         RunDir.write_predictions, just before result.json (a finished run): each eval image's
                                  predicted class per head and its label, in dataset order, with the data
                                  fingerprint, split and checkpoint they are of (deit_ablate/record/predictions.py)
          result.json             RunDir.record_result, once the run ends (finished, diverged, failed) or is
                                  recorded without training; its presence makes a relaunch skip the run
          .<file>[.<random>].tmp  atomic.atomic_write's temp files (TEMP_PATTERNS); a killed writer's are removed by
                                  the next launch holding the lock (checkpoint.remove_stale_temp_files)
      wandb/                      wandb_root(): wandb's logs (offline-run-*/, run-*/), read by the aggregator

identity.json and result.json name a value once: `experiment_digest` and `data_fingerprint` (identity.json
written before said `digest` and `data`; read_record maps those old names, so old folders resume and skip).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deit_ablate.core.atomic import atomic_write, write_json_atomic, write_text_atomic
from deit_ablate.core.errors import ConfigError
from deit_ablate.record import runfiles
from deit_ablate.record.runfiles import DamagedRecord, folder_problem, not_a_file, read_json, read_json_mapping

if TYPE_CHECKING:  # the aggregator reads run folders without importing omegaconf

    from deit_ablate.record.identity import RunIdentity

# The files of a run folder.
LAST, PREV, BEST = "checkpoint-last.pt", "checkpoint-prev.pt", "checkpoint-best.pt"
RESULT, IDENTITY, METRICS, LOCK, LOG = "result.json", "identity.json", "metrics.csv", "run.lock", "train.log"
PREDICTIONS, PREDICTIONS_META = "predictions.npz", "meta"  # the file, and its array holding the JSON record
PROGRESS = "progress.json"  # where a launch stands (record/progress.py)
RANK_LOG = "train-rank{}.log"  # the log of rank N > 0
HYDRA, HYDRA_CONFIG, HYDRA_OVERRIDES, HYDRA_SETTINGS = ".hydra", "config.yaml", "overrides.yaml", "hydra.yaml"
HYDRA_LATER = "later-launches.yaml"  # the launches after the first, noted beside its records
UNREADABLE = "{}.unreadable"  # a checkpoint set aside
LOCK_ASIDE = LOCK + ".stale-{}"  # a stale lock being taken over, by the taker's token
# What a killed writer leaves: the temp files of the files written atomically (never the lock's staged file,
# which a launch waiting for the lock may be writing).
ATOMIC_FILES = (LAST, PREV, BEST, RESULT, IDENTITY, METRICS, PREDICTIONS, PROGRESS)
TEMP_PATTERNS = tuple(f".{name}*.tmp" for name in ATOMIC_FILES)
# The folders a launch writes under runtime.output_root: Hydra's run folders, and wandb's logs (the folder wandb
# itself makes under the `dir` it is given: tracking passes output_root).
RUNS, WANDB = "runs", "wandb"
DEFAULT_OUTPUT_ROOT = "outputs"  # runtime.output_root's default (config/schema.py): where `deit-status` looks
MULTIRUN, SWEEP_RECORD = "multirun.yaml", "multirun-{}.yaml"  # Hydra's sweep record, and ours beside it
EXPERIMENT_LOCKS = ".experiments"  # in the runs root: one folder per experiment digest, holding its launch lock
SLURM_JOBS = "slurm-jobs.json"  # in the runs root: SLURM job id -> run folder name, from the SLURM launcher
SUBMITIT = ".submitit"  # submitit's folder in the sweep folder (conf/hydra/launcher/*.yaml spell it too)
RESULT_STATUSES = ("finished", "diverged", "failed")
# The files a run folder holds that a launch or the status opens: each must be a regular file where it exists (a FIFO
# there would block the reader forever).
OWN_FILES = (*ATOMIC_FILES, LOCK, LOG)
# One name per value in identity.json and result.json; identity.json used to say `digest` and `data`.
DIGEST, DATA = "experiment_digest", "data_fingerprint"
OLD_NAMES = {"digest": DIGEST, "data": DATA}
IDENTITY_FIELDS = ("run_id", "name", DIGEST, DATA)  # what result.json holds beyond the run's summary


def runs_root(output_root: str | os.PathLike) -> Path:
    """`<output_root>/runs`, where every run folder lies."""
    return Path(output_root) / RUNS


def wandb_root(output_root: str | os.PathLike) -> Path:
    """`<output_root>/wandb`, where wandb writes the logs of the runs under `output_root`."""
    return Path(output_root) / WANDB


def rank_log_name(rank: int) -> str:
    """train.log for the main rank, train-rank<N>.log for the others."""
    return LOG if rank == 0 else RANK_LOG.format(rank)


def read_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """identity.json's or result.json's content under today's names (`digest` -> experiment_digest, `data` ->
    data_fingerprint), whichever names the file was written with."""
    return {(OLD_NAMES[key] if key in OLD_NAMES and OLD_NAMES[key] not in record else key): value
            for key, value in record.items()}


def identity_record(identity: RunIdentity, data: Mapping[str, Any]) -> dict[str, Any]:
    """What identity.json holds: the run's name, wandb id, experiment digest, data fingerprint, teacher and (a
    transfer) source."""
    return {"name": identity.name, "run_id": identity.run_id, DIGEST: identity.digest, DATA: dict(data),
            **({"teacher": identity.teacher} if identity.teacher else {}),
            **({"source": identity.source} if identity.source else {})}


def result_record(identity: RunIdentity, data: Mapping[str, Any], final: Mapping[str, Any]) -> dict[str, Any]:
    """What result.json holds: the run's summary `final` with its name, wandb id, digest and data fingerprint."""
    return {"run_id": identity.run_id, "name": identity.name, **final, DIGEST: identity.digest, DATA: dict(data)}


RESULT_FIX = "Delete it: the run then resumes from its checkpoint (or starts again) and writes it anew"


def read_result(path: Path) -> dict[str, Any]:
    """A run's result.json; a DamagedRecord naming the file when it is not one this code wrote."""
    try:
        result = read_json(Path(path))
    except DamagedRecord as error:
        if not_a_file(Path(path)) is not None:  # nothing a run can write over: the folder must change by hand
            raise
        raise DamagedRecord(path, f"not a run result ({error.problem})", RESULT_FIX) from None
    if isinstance(result, dict) and result.get("status") in RESULT_STATUSES:
        return read_record(result)
    problem = (f"a {type(result).__name__}, not a result" if not isinstance(result, dict)
               else f"no status of {', '.join(RESULT_STATUSES)} in it")
    raise DamagedRecord(path, f"not a run result ({problem})", RESULT_FIX)


def check_output_root(output_root: str | Path, tracking: bool = True) -> None:
    """runtime.output_root, its runs/ and (with tracking) its wandb/ can be made and written: else a ConfigError
    naming the folder and the fix, raised before anything is written."""
    root = Path(output_root)
    for path in (root, runs_root(root)):
        problem = folder_problem(path)
        if problem is not None:
            raise ConfigError(f"runtime.output_root={output_root} cannot hold the run folders: {problem}. "
                              "Point runtime.output_root at a folder this user can write, e.g. "
                              "runtime.output_root=outputs (under the current folder).")
    problem = folder_problem(wandb_root(root)) if tracking else None
    if problem is not None:
        raise ConfigError(f"{wandb_root(root)}, where wandb writes the logs of runtime.output_root={output_root}, "
                          f"cannot be written: {problem}. Make it writable, point runtime.output_root elsewhere, or "
                          "set runtime.tracking.mode=disabled (no wandb log; metrics.csv is still written).")


PREDICTIONS_FIX = ("Delete it and its result.json: a relaunch of the run's command resumes at its final checkpoint, "
                   "only evaluates, and writes both again")


@dataclass(frozen=True)
class RunDir:
    """One run's folder under <runtime.output_root>/runs: checkpoints, result, identity, logs, Hydra's config."""

    path: Path

    @classmethod
    def under(cls, output_root: str | os.PathLike, name: str) -> RunDir:
        """The folder of the run `name` under `output_root`."""
        return cls(runs_root(output_root) / name)

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
    def predictions(self) -> Path:
        return self.path / PREDICTIONS

    @property
    def lock(self) -> Path:
        return self.path / LOCK

    @property
    def progress(self) -> Path:
        """Where a launch stands while it trains (record/progress.py writes it, `deit-status` reads it)."""
        return self.path / PROGRESS

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
    def hydra_config(self) -> Path:
        """The run's composed config as Hydra saved it (`.hydra/config.yaml`)."""
        return self.path / HYDRA / HYDRA_CONFIG

    @property
    def hydra_overrides(self) -> Path:
        """The command-line overrides the run was launched with (`.hydra/overrides.yaml`)."""
        return self.path / HYDRA / HYDRA_OVERRIDES

    @property
    def hydra_settings(self) -> Path:
        """Hydra's own settings for the run (`.hydra/hydra.yaml`: the group choices, the job's overrides)."""
        return self.path / HYDRA / HYDRA_SETTINGS

    @property
    def hydra_later(self) -> Path:
        """Each launch after the first that trained the run: its time and overrides (`.hydra/later-launches.yaml`)."""
        return self.path / HYDRA / HYDRA_LATER

    @property
    def log(self) -> Path:
        return self.path / LOG

    def rank_log(self, rank: int) -> Path:
        """The log file of rank `rank` (train.log for rank 0)."""
        return self.path / rank_log_name(rank)

    def temp_for(self, file: Path) -> Path:
        """The temp file an atomic write of one of the run's own files goes through (`.<name>.tmp`)."""
        return file.with_name(f".{file.name}.tmp")

    def check_files(self) -> None:
        """A DamagedRecord for the first of the run's own files (OWN_FILES, the rank logs) that is there but no
        regular file: a launch or the status would block on a FIFO, or fail on a folder, where that file belongs."""
        rank_log = re.compile(re.escape(RANK_LOG).replace(r"\{\}", r"\d+"))
        with os.scandir(self.path) as entries:
            for entry in entries:
                if (entry.name in OWN_FILES or rank_log.fullmatch(entry.name)) and not entry.is_file():
                    problem = not_a_file(Path(entry.path)) or "a broken link, not a file"
                    raise DamagedRecord(Path(entry.path), problem)

    def stale_temp_files(self) -> list[Path]:
        """The temp files a killed writer left (TEMP_PATTERNS), to remove while holding the lock."""
        return [path for pattern in TEMP_PATTERNS for path in sorted(self.path.glob(pattern))]

    def read_result(self) -> dict[str, Any] | None:
        """The run's result.json under today's names, or None while it has none."""
        return read_result(self.result) if self.result.exists() else None

    def read_summary(self) -> dict[str, Any]:
        """The run's summary as result.json holds it, without the run's identity (empty while it has none)."""
        return {k: v for k, v in (self.read_result() or {}).items() if k not in IDENTITY_FIELDS}

    def write_result(self, payload: Mapping[str, Any]) -> None:
        """Write result.json as given (old names mapped); a run writes it through record_result."""
        write_json_atomic(self.result, read_record(payload), temp=self.temp_for(self.result))

    def record_result(self, identity: RunIdentity, data: Mapping[str, Any], final: Mapping[str, Any]) -> None:
        """Write the run's result.json: its summary `final`, named by its identity and data."""
        self.write_result(result_record(identity, data, final))

    def write_predictions(self, arrays: Mapping[str, Any], record: Mapping[str, Any]) -> None:
        """Write predictions.npz atomically: the integer `arrays` (numpy) and `record` (JSON) under `meta`."""
        import numpy as np

        payload = {**arrays, PREDICTIONS_META: np.array(json.dumps(dict(record)))}
        atomic_write(self.predictions, lambda handle: np.savez_compressed(handle, **payload),
                     temp=self.temp_for(self.predictions))

    def read_predictions(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """predictions.npz's arrays and record, or None when the run has none (it finished before runs kept them); a
        DamagedRecord when it is not what write_predictions writes (read within bounds: read_npz)."""
        if not self.predictions.exists():
            return None
        try:
            arrays = runfiles.read_npz(self.predictions, fix=PREDICTIONS_FIX)
            record = json.loads(str(arrays.pop(PREDICTIONS_META)))
        except DamagedRecord:
            raise
        except (OSError, ValueError, KeyError, EOFError, TypeError, OverflowError, RecursionError, NotImplementedError,
                zipfile.BadZipFile, zlib.error) as error:
            raise DamagedRecord(self.predictions, f"not a predictions file ({type(error).__name__}: "
                                                  f"{str(error)[:80]})", PREDICTIONS_FIX) from None
        if not isinstance(record, dict):
            raise DamagedRecord(self.predictions, "not a predictions file (its record is no mapping)", PREDICTIONS_FIX)
        return arrays, record

    def read_identity(self) -> dict[str, Any] | None:
        """What the run recorded about itself when it first started (identity_record), under today's names, or
        None; a DamagedRecord when identity.json is not that record."""
        record = read_json_mapping(self.identity, "the run's identity record")
        return read_record(record) if record is not None else None

    def recorded_data(self) -> dict[str, Any] | None:
        """The fingerprint of the data the run first trained on, as its identity.json records it, or None."""
        return (self.read_identity() or {}).get(DATA)

    def write_identity(self, payload: Mapping[str, Any]) -> None:
        """Write identity.json as given (old names mapped); a run writes it through record_identity."""
        write_json_atomic(self.identity, read_record(payload), temp=self.temp_for(self.identity))

    def record_identity(self, identity: RunIdentity, data: Mapping[str, Any]) -> None:
        """Write what this run is (its digest, its data and its teacher) into identity.json, once."""
        if not self.identity.exists():
            self.write_identity(identity_record(identity, data))

    def record_launch(self, config: str, settings: str | None, overrides: str | None, at: str = "") -> None:
        """Save a launch's composed config, Hydra's settings and its overrides (YAML, as Hydra writes them) in
        `.hydra/`, each file atomically; settings and overrides None (no Hydra job): the config alone.

        The records say how the run was first made: a later launch (a relaunch, or another sweep row sharing the
        run, whose overrides differ) writes none that exists and is noted in `hydra_later` instead, at time `at`."""
        self.hydra.mkdir(parents=True, exist_ok=True)
        first = not self.hydra_config.exists()
        texts = ((self.hydra_config, config), (self.hydra_settings, settings), (self.hydra_overrides, overrides))
        for path, text in texts:
            if text is not None and not path.exists():
                write_text_atomic(path, text, temp=self.temp_for(path))
        if first:
            return
        listed = "    []\n" if overrides is None else "".join(f"    {line}\n" for line in overrides.splitlines())
        entry = f"- at: '{at}'\n  overrides:\n{listed}"
        before = self.hydra_later.read_text() if self.hydra_later.is_file() else ""
        write_text_atomic(self.hydra_later, before + entry, temp=self.temp_for(self.hydra_later))

    def weights(self) -> Path:
        """The checkpoint to take weights from (e.g. a teacher): the best one, else the last."""
        return self.best_checkpoint if self.best_checkpoint.exists() else self.last_checkpoint

    def discard_if_empty(self) -> None:
        """Remove the folder when it holds nothing of the run's own (only what Hydra wrote before it failed)."""
        own_logs = re.compile(re.escape(LOG) + "|" + re.escape(RANK_LOG).replace(r"\{\}", r"\d+"))
        if self.path.is_dir() and all(p.name == HYDRA or own_logs.fullmatch(p.name) for p in self.path.iterdir()):
            shutil.rmtree(self.path, ignore_errors=True)
            self._discard_empty_roots()

    def _discard_empty_roots(self) -> None:
        """Remove the `runs/` root this folder left empty, and then the default output root (`outputs/`) when that is
        empty too; the other ranks of a torchrun job may be removing them at the same moment."""
        roots = [self.path.parent] if self.path.parent.name == RUNS else []
        if roots and roots[0].parent.name == DEFAULT_OUTPUT_ROOT:
            roots.append(roots[0].parent)
        for root in roots:
            try:
                root.rmdir()
            except OSError:  # not empty (other runs), gone already, or not ours to remove
                return


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

"""Table 7's comparison: each transfer against the same network trained from scratch on the row's data.

The paper's Table 7 has no baseline row; what a transfer is worth is its top-1 against the network that never saw
the source data. That run is a pre-training of the transfer's model (timm name and options) on data of the
transfer's fingerprint, launched with the transfer's other choices (`data.builtin.classes=shapes_b` beside
`transfer=builtin_b`). Where several such settings were run, the one that trains as many epochs as the transfer
counts (then the one with most runs).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .cells import Cell, Table
from .reader import RunInfo, metric_value
from .select import MISSING, get_key
from .settings import choices_of, experiment_settings, signature

SCRATCH = "from scratch"
STAGE = "transfer"  # the stage the comparison is made at
DIGEST = "data_fingerprint.digest"  # the data by content
# Choices a from-scratch twin may differ in from its transfer: what says it is a transfer, and at which size.
TRANSFER_CHOICES = ("transfer", "stage", "resolution", "data")
NOTE = ("Δ to from scratch: each transfer against the same network trained from scratch on the row's data (a "
        "pre-training of the transfer's model on data of its fingerprint, with its other choices); the paper "
        "gives no such number.")


def _value(run: RunInfo, key: str) -> Any:
    value = get_key(run.config, key)
    return None if value is MISSING else value


def is_twin(transfer: RunInfo, run: RunInfo) -> bool:
    """Whether `run` trains the transfer's network from scratch on the transfer's data."""
    if run.config.get("stage", "pretrain") != "pretrain":
        return False
    digest = _value(transfer, DIGEST)
    if digest is None or _value(run, DIGEST) != digest:
        return False
    if any(_value(run, k) != _value(transfer, k) for k in ("model.name", "model.kwargs")):
        return False
    mine, theirs = choices_of(run.config), choices_of(transfer.config)
    return all(mine.get(g) == theirs.get(g) for g in set(mine) | set(theirs) if g not in TRANSFER_CHOICES)


def scratch_runs(transfers: Iterable[RunInfo], runs: Iterable[RunInfo]) -> list[RunInfo]:
    """The runs that are some transfer's from-scratch twin."""
    by_data: dict[Any, list[RunInfo]] = {}  # a twin has its transfer's data: only those are compared
    for transfer in transfers:
        by_data.setdefault(_value(transfer, DIGEST), []).append(transfer)
    return [run for run in runs if any(is_twin(t, run) for t in by_data.get(_value(run, DIGEST), []))]


def _chosen(transfers: list[RunInfo], twins: list[RunInfo]) -> list[RunInfo]:
    """The twins of one setting: the one training as many epochs as the transfers, then the one most runs share."""
    groups: dict[Any, list[RunInfo]] = {}
    for run in twins:
        groups.setdefault(signature(experiment_settings(run.config)), []).append(run)
    epochs = {_value(t, "transfer.epochs") for t in transfers}
    return max(groups.values(), key=lambda g: (_value(g[0], "train.epochs") in epochs, len(g)))


def _start(run: RunInfo) -> float:
    return run.start_time.timestamp() if run.start_time else float("-inf")


def fill_scratch(table: Table, scratch: list[RunInfo]) -> None:
    """Each row's from-scratch cell (Row.reference), from the twins of the row's counted transfers."""
    if STAGE not in table.stages:
        return
    table.reference = SCRATCH
    for row in table.rows:
        transfers = [run for label, stage, run, _ in table.counted if label == row.key and stage == STAGE]
        twins = [run for run in scratch if any(is_twin(t, run) for t in transfers)]
        cell = Cell()
        if twins:
            for run in sorted(_chosen(transfers, twins), key=_start, reverse=True):  # a repeated seed: the latest
                if cell.add(run, metric_value(run, table.metric_key)):
                    table.reference_runs.append(run)
        row.reference = cell

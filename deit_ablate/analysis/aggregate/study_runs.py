"""Which study a run belongs to, from its recorded choices, so that a study's table shows only its own runs and
names the others in one line."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from deit_ablate.config.studies import studies

from .paper import paper_table
from .reader import RunInfo
from .scratch import scratch_runs
from .settings import choices_of


@dataclass
class StudyRuns:
    """The runs read, sorted for one study's table."""

    own: list[RunInfo]  # the table's rows
    scratch: list[RunInfo] = field(default_factory=list)  # its transfers' from-scratch comparisons
    others: Counter = field(default_factory=Counter)  # runs of every other study, by study


def default_study() -> str:
    """The study whose default row every run has unless launched with another (`ablation`: Table 8)."""
    return next(s.name for s in studies() if s.default is not None)


def stage_study(stage: str) -> str | None:
    """The one study without a default row whose paper table has a column for `stage` (`transfer`: Table 7)."""
    found = [s.name for s in studies() if s.default is None and stage in paper_table(s.table).columns]
    return found[0] if len(found) == 1 else None


def run_study(run: RunInfo) -> str:
    """The study a run belongs to: the row it was launched with of a study without a default row (`deit3`,
    `transfer`, `cait`), else the study whose table has its stage (a transfer without a row), else the study with a
    default row (`ablation`: Table 8)."""
    choices = choices_of(run.config)
    for study in studies():
        if study.default is None and choices.get(study.name):
            return study.name
    return stage_study(str(run.config.get("stage", "pretrain"))) or default_study()


def split_by_study(runs: list[RunInfo], study: str) -> StudyRuns:
    """The runs of `study`, and the others counted by study; a pre-training that is a transfer's from-scratch
    comparison (the same network trained on the transfer's data) goes with the transfer."""
    of = {id(run): run_study(run) for run in runs}
    transfer = stage_study("transfer")
    scratch = scratch_runs([r for r in runs if of[id(r)] == transfer], runs) if transfer else []
    for run in scratch:
        of[id(run)] = str(transfer)
    moved = {id(run) for run in scratch}
    own = [r for r in runs if of[id(r)] == study and id(r) not in moved]
    others = Counter(of[id(r)] for r in runs if of[id(r)] != study)
    return StudyRuns(own=own, scratch=scratch if study == transfer else [], others=others)


def others_text(others: Counter, sources: list[str]) -> str:
    """`Also in outputs/wandb: 3 runs of deit3, 1 of transfer (see --paper deit3 / --paper table7).`; '' if none."""
    if not others:
        return ""
    tables = {s.name: s.table for s in studies()}
    ranked = others.most_common()
    parts = [f"{n} {'run' if n == 1 else 'runs'} of {name}" if i == 0 else f"{n} of {name}"
             for i, (name, n) in enumerate(ranked)]
    see = " / ".join(f"--paper {tables[name]}" for name, _ in ranked if name in tables)
    return f"Also in {', '.join(sources)}: {', '.join(parts)}" + (f" (see {see})." if see else ".")

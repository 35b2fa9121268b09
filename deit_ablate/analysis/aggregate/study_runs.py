"""Which study a run belongs to, from its recorded choices, so that a study's table shows only its own runs and
names the others in one line."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from deit_ablate.config.studies import studies

from .paper import paper_table
from .reader import RunInfo
from .scratch import STAGE as TRANSFER_STAGE
from .scratch import scratch_runs
from .settings import choices_of


@dataclass(frozen=True)
class StudyIndex:
    """The studies as the numbers files give them, read once for all the runs of a table."""

    default: str  # the study whose default row every run has unless launched with another (`ablation`: Table 8)
    rowed: tuple[str, ...]  # the studies without a default row (`cait`, `deit3`, `transfer`, ...)
    by_stage: dict[str, str]  # a stage only one of them has a column for, Table 8 none -> that study (`transfer`)
    tables: dict[str, str]  # study -> its paper table (`ablation` -> `table8`)


def study_index() -> StudyIndex:
    """The studies' names, default study, paper tables, and the stages that only one study's table has a column for."""
    found = studies()
    default = next(s for s in found if s.default is not None)
    columns = {s.name: paper_table(s.table).columns for s in found if s.default is None}
    stages = {stage for cols in columns.values() for stage in cols} - set(paper_table(default.table).columns)
    by_stage = {stage: owners[0] for stage in stages
                if len(owners := [name for name, cols in columns.items() if stage in cols]) == 1}
    return StudyIndex(default=default.name, rowed=tuple(columns), by_stage=by_stage,
                      tables={s.name: s.table for s in found})


@dataclass
class StudyRuns:
    """The runs read, sorted for one study's table."""

    own: list[RunInfo]  # the table's rows
    scratch: list[RunInfo] = field(default_factory=list)  # its transfers' from-scratch comparisons
    others: Counter = field(default_factory=Counter)  # runs of every other study, by study


def run_study(run: RunInfo, index: StudyIndex) -> str:
    """The study a run belongs to: the row it was launched with of a study without a default row (`deit3`,
    `transfer`, `cait`), else the study whose table alone has its stage (a transfer without a row), else the study
    with a default row (`ablation`: Table 8)."""
    choices = choices_of(run.config)
    found = next((name for name in index.rowed if choices.get(name)), None)
    return found or index.by_stage.get(str(run.config.get("stage", "pretrain"))) or index.default


def split_by_study(runs: list[RunInfo], study: str, index: StudyIndex) -> StudyRuns:
    """The runs of `study`, and the others counted by study; a pre-training that is a transfer's from-scratch
    comparison (the same network trained on the transfer's data) goes with the transfer."""
    of = {id(run): run_study(run, index) for run in runs}
    transfer = index.by_stage.get(TRANSFER_STAGE)
    scratch = scratch_runs([r for r in runs if of[id(r)] == transfer], runs) if transfer else []
    for run in scratch:
        of[id(run)] = str(transfer)
    moved = {id(run) for run in scratch}
    own = [r for r in runs if of[id(r)] == study and id(r) not in moved]
    others = Counter(of[id(r)] for r in runs if of[id(r)] != study)
    return StudyRuns(own=own, scratch=scratch if study == transfer else [], others=others)


def others_text(others: Counter, sources: list[str], index: StudyIndex) -> str:
    """`Also in outputs/wandb: 3 runs of deit3, 1 of transfer (see --paper deit3 / --paper table7).`; '' if none."""
    if not others:
        return ""
    ranked = sorted(others.items(), key=lambda item: (-item[1], item[0]))  # most runs first, then by name
    parts = [f"{n} run{'' if n == 1 else 's'} of {name}" if i == 0 else f"{n} of {name}"
             for i, (name, n) in enumerate(ranked)]
    see = " / ".join(f"--paper {index.tables[name]}" for name, _ in ranked if name in index.tables)
    return f"Also in {', '.join(sources)}: {', '.join(parts)}" + (f" (see {see})." if see else ".")

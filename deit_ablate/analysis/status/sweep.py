"""The runs the status shows: a sweep's, composed, checked and planned exactly as its dry run does (the sweeper's
checked_jobs, then preflight.sweep_plans: runs not started yet included), or every run folder under an output root."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deit_ablate.config.studies import study_names
from deit_ablate.record.identity import folder_now
from deit_ablate.record.resume import LaunchAction, folder_action
from deit_ablate.record.rundir import RunDir, runs_root
from deit_ablate.record.runfiles import DamagedRecord, read_text

if TYPE_CHECKING:
    from deit_ablate.run.plan import RunPlan

HIDDEN_KEYS = ("stage", "seed", "runtime.", "hydra.", "hydra/")  # not a run's row label: shown in their own columns
LABEL_KEYS = ("stage", "seed")  # what the status reads of a run's saved config
UNKNOWN_LABELS = ("?", "?", None)
PLANNED_FOLDERS = ("run_dir", "upstream", "teacher_run", "layer_scale_source")  # a RunPlan's run folders


@dataclass(frozen=True)
class PlannedRun:
    """A run the status shows: its folder, its labels (study row, stage, seed) and its plan (a sweep's run)."""

    run_dir: RunDir
    labels: tuple[str, str, int | None]
    plan: RunPlan | None = None
    also: tuple[str, ...] = ()  # the other study rows of the sweep that name this run (a shared pre-training)
    damage: str | None = None  # what is damaged in its folder (`.hydra/config.yaml: a list, not a mapping`)

    @property
    def experiment(self) -> str | Path:
        """What makes two rows one run: a planned run's experiment digest, else its folder."""
        return self.plan.identity.digest if self.plan is not None else self.run_dir.path

    def action(self) -> LaunchAction:
        """What a launch would do now: the dry run's launch_action for a sweep's run, the folder's alone otherwise."""
        if self.plan is None:
            return folder_action(self.run_dir)
        from deit_ablate.run.lifecycle import launch_action  # a planned run: the training code is loaded already

        return launch_action(self.plan)

    def now(self) -> PlannedRun:
        """The run with its plan's folders as a launch would find them now (a --watch plans once): a folder planned
        before another row's launch made the same experiment's under that row's name is that folder."""
        if self.plan is None:
            return self
        moved = {}
        for key in PLANNED_FOLDERS:
            planned = getattr(self.plan, key)
            found = folder_now(planned.path) if planned is not None else None
            if found is not None and found != planned.path:
                moved[key] = RunDir(found)
        if not moved:
            return self
        return replace(self, run_dir=moved.get("run_dir", self.run_dir), plan=replace(self.plan, **moved))


def row_label(overrides: Sequence[str], studies: frozenset[str] | None = None) -> str:
    """A run's study row (`ablation=no_mixup`), or its other overrides where it has none (`baseline` for none);
    `studies`: study_names(), when the caller has read them once for many runs."""
    studies = studies if studies is not None else frozenset(study_names())
    rows = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in studies]
    others = [o for o in overrides if not o.lstrip("+~").startswith(HIDDEN_KEYS)]
    return " ".join(rows or others) or "baseline"


def sweep_runs(arguments: list[str]) -> list[PlannedRun]:
    """The runs of `python train.py -m <arguments>`, each as its dry run plans it (one line and exit status 2 for
    an override that does not compose or a run that cannot launch, as the sweep itself says)."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext, RunMode

    from deit_ablate.config.studies import CONF_DIR
    from deit_ablate.run.preflight import sweep_plans, sweep_run_dir

    GlobalHydra.instance().clear()
    hydra = Hydra.create_main_hydra2(task_name="train", config_search_path=create_config_search_path(str(CONF_DIR)))
    try:
        cfg = hydra.compose_config("config", arguments, run_mode=RunMode.MULTIRUN)
        context = HydraContext(config_loader=hydra.config_loader, callbacks=Callbacks(cfg))
        sweeper = Plugins.instance().instantiate_sweeper(config=cfg, hydra_context=context,
                                                         task_function=lambda _: None)
        _, configs = sweeper.checked_jobs(list(cfg.hydra.overrides.task))
        plans = list(sweep_plans(configs, [sweep_run_dir(c) for c in configs], job_log=False))
    finally:
        GlobalHydra.instance().clear()  # as Hydra's own app leaves it: a later compose starts afresh
    return one_per_run([PlannedRun(plan.run_dir, (row_label(plan.overrides), str(plan.settings.stage),
                                                  int(plan.settings.seed)), plan) for plan in plans])


def one_per_run(runs: Sequence[PlannedRun]) -> list[PlannedRun]:
    """Each run once, in order: a run several rows of a sweep name (two DeiT III rows differing only in their
    fine-tune share a pre-training) is the first row's, with the others' labels in `also`. One experiment is one
    run whatever folder each row planned: before its folder exists each row names it after its own overrides."""
    first: dict[str | Path, PlannedRun] = {}
    for run in runs:
        seen = first.get(run.experiment)
        if seen is None:
            first[run.experiment] = run
        elif run.labels[0] not in (seen.labels[0], *seen.also):
            first[run.experiment] = replace(seen, also=(*seen.also, run.labels[0]))
    return list(first.values())


def _yaml(text: str, path: Path) -> Any:
    """`text` parsed as YAML (libyaml's parser where it is built in: 8x faster); a DamagedRecord when it is none."""
    import yaml

    try:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 - a safe loader
    except yaml.YAMLError as error:
        raise DamagedRecord(path, f"not YAML ({str(error).splitlines()[0][:80]})") from None
    except RecursionError:  # the composer recurses on nested blocks
        raise DamagedRecord(path, "not YAML (nested too deep)") from None


def saved_labels(text: str, path: Path) -> dict[str, Any]:
    """The stage and seed of a config Hydra saved (`.hydra/config.yaml`): read from its top-level lines alone where
    it is a block mapping, as Hydra writes it (parsing the whole config cost 10-35 ms a run), else parsed whole."""
    lines = {key: re.search(rf"^{key}:(.*)$", text, re.MULTILINE) for key in LABEL_KEYS}
    if text.lstrip()[:1] not in ("{", "[", "-", "") and all(lines.values()):
        return {key: _yaml(line.group(1), path) for key, line in lines.items() if line is not None}
    config = _yaml(text, path)
    if config is not None and not isinstance(config, dict):
        raise DamagedRecord(path, f"a {type(config).__name__}, not a mapping")
    return config or {}


def folder_labels(run_dir: RunDir, studies: frozenset[str] | None = None) -> tuple[str, str, int | None]:
    """A run folder's study row, stage and seed, from the config and overrides Hydra saved there (`?` without
    them); a DamagedRecord when they are not what Hydra writes."""
    if not run_dir.hydra.is_dir():
        if run_dir.hydra.exists():
            raise DamagedRecord(run_dir.hydra, "a file, not a folder")
        return UNKNOWN_LABELS
    try:
        overrides = _yaml(read_text(run_dir.hydra_overrides), run_dir.hydra_overrides) or []
        config = saved_labels(read_text(run_dir.hydra_config), run_dir.hydra_config)
    except FileNotFoundError:
        return UNKNOWN_LABELS
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        what = type(overrides).__name__ if not isinstance(overrides, list) else "list holding other than strings"
        raise DamagedRecord(run_dir.hydra_overrides, f"a {what}, not a list of overrides")
    seed = config.get("seed")
    return row_label(overrides, studies), str(config.get("stage", "?")), \
        seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def folder_run(path: Path, studies: frozenset[str]) -> PlannedRun | None:
    """The run in the folder `path`, its labels read (its damage named instead where they cannot be); None for a
    folder that holds no run (no .hydra/, no identity.json)."""
    run = RunDir(path)
    try:
        if not (run.hydra.exists() or run.identity.exists()):
            return None
        return PlannedRun(run, folder_labels(run, studies))
    except DamagedRecord as error:
        return PlannedRun(run, UNKNOWN_LABELS, damage=error.detail(run.path))
    except OSError as error:  # an unreadable folder (chmod 000)
        return PlannedRun(run, UNKNOWN_LABELS, damage=f"its folder cannot be read ({error.strerror or error})")


def folder_runs(output_root: Path) -> list[PlannedRun]:
    """Every run folder under `output_root` (its runs/), as a launch would find it: only what the folders say (a
    run not started has none; give the sweep's overrides to see those too)."""
    folders = sorted(p for p in runs_root(output_root).iterdir() if p.is_dir() and not p.name.startswith("."))
    studies = frozenset(study_names())
    return [run for run in (folder_run(p, studies) for p in folders) if run is not None]


def root_problem(output_root: Path) -> str | None:
    """Why `output_root` is not an output root (no runs/ folder in it), or None."""
    if not output_root.is_dir():
        return f"{output_root} is not a folder"
    if not runs_root(output_root).is_dir():
        return f"{output_root} holds no {runs_root(output_root).name}/ folder of runs"
    return None

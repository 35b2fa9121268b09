"""The teacher of a distillation run: resolve its checkpoint (a file or a run folder), load it safely, run it."""

from __future__ import annotations

import contextlib
import hashlib
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
import yaml
from omegaconf import DictConfig
from torch import nn

from deit_ablate.config.schema import DistillConfig, DistillKind, Stage, TeacherConfig
from deit_ablate.core.errors import ConfigError
from deit_ablate.core.logs import log
from deit_ablate.record.checkpoint import read_weights
from deit_ablate.record.identity import RunIdentity, with_teacher
from deit_ablate.record.rundir import RunDir, find_run, runs_root
from deit_ablate.run.lineage import Lineage
from deit_ablate.run.stages import finished_teacher_run, stage_distils, teacher_run_dir
from deit_ablate.run.student import student_model_name
from deit_ablate.train.models import is_vision_transformer
from deit_ablate.train.teacher import MultiSizeTeacher, load_teacher


@dataclass(frozen=True)
class TeacherSource:
    """Where a student's teacher comes from: its architecture, timm kwargs, checkpoint file, and run folder if any."""

    model: str
    kwargs: dict[str, Any]
    checkpoint: Path | None
    run: RunDir | None = None


def resolve_teacher(teacher_cfg, output_root: str | Path, reference: str | None = None) -> TeacherSource:
    """The teacher's architecture, kwargs and checkpoint file; a run folder (or run name) brings all three.
    `reference` (a chained teacher's run folder, run_teacher) stands for distill.teacher.checkpoint."""
    reference = teacher_cfg.checkpoint if reference is None else reference
    name, kwargs = teacher_cfg.model, dict(teacher_cfg.kwargs)
    if reference is None or str(reference).strip() == "":
        return TeacherSource(name, kwargs, None)  # load_teacher explains what to do
    path = Path(str(reference)).expanduser()
    run = find_run(path, runs_root(output_root))
    if run is None:
        return TeacherSource(name, kwargs, path)
    if run.hydra_config.exists():
        config = yaml.safe_load(run.hydra_config.read_text())
        name, kwargs = config["model"]["name"], dict(config["model"].get("kwargs") or {})
        if is_vision_transformer(name):  # a ViT teacher (Table 2's DeiT-B): its grid, resampled to the student's
            kwargs.update(img_size=config["resolution"]["train_size"], dynamic_img_size=True)
    return TeacherSource(name, kwargs, run.weights(), run)


def teacher_run_state(run: RunDir) -> str:
    """How a teacher run stands: `finished`, `diverged`, `failed`, or `unfinished: k of n epochs`."""
    try:
        result = run.read_result()
    except ConfigError:  # a damaged result.json: the run itself counts as unfinished
        result = None
    if result is not None:
        return str(result["status"])
    try:
        rows = max(len(run.metrics.read_text().splitlines()) - 1, 0) if run.metrics.exists() else 0
        config = yaml.safe_load(run.hydra_config.read_text())
        planned = config["finetune" if config.get("stage") == Stage.finetune else "train"]["epochs"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return "unfinished"
    return f"unfinished: {rows} of {planned} epochs" if isinstance(planned, int) else f"unfinished: {rows} epochs"


def _state_text(state: str) -> str:
    """`has not finished (1 of 2 epochs logged, no result.json)`, or `ended as diverged`."""
    if not state.startswith("unfinished"):
        return f"ended as {state}"
    progress = state[len("unfinished"):].strip(" :")
    return f"has not finished ({progress + ' logged, ' if progress else ''}no result.json)"


def _command(run: RunDir) -> str:
    """The command that launches `run` again, from its recorded overrides."""
    try:
        overrides = yaml.safe_load(run.hydra_overrides.read_text()) or []
    except (OSError, yaml.YAMLError):
        overrides = []
    return " ".join(["python train.py", *(shlex.quote(str(item)) for item in overrides)])


def check_teacher_run(run: RunDir, reference: str, allow_unfinished: bool) -> str:
    """The teacher run's state; a ConfigError when it has not finished (unfinished, diverged, failed) unless
    `allow_unfinished`."""
    state = teacher_run_state(run)
    if state == "finished" or allow_unfinished:
        return state
    fix = (f"Finish it first by launching its command again, which resumes it: `{_command(run)}`"
           if state.startswith("unfinished") else
           f"Train a teacher that finishes (its command was `{_command(run)}`; relaunching it keeps the {state} "
           "result)")
    raise ConfigError(
        f"distill.teacher.checkpoint={reference} names the teacher run '{run.name}', which {_state_text(state)}: "
        f"the student would learn from the weights of a teacher that did not finish ({run.weights()}). {fix}; or "
        "add distill.teacher.allow_unfinished=true to distil from its latest checkpoint anyway (the run then warns "
        "and records which teacher weights it used).")


def check_distill_config(cfg: DictConfig) -> None:
    """Before anything runs: the student model suits the kind, a teacher run has finished (unless allowed) and the
    teacher resolves to a loadable file."""
    student_model_name(cfg.model, cfg.distill)  # refuses a model that does not suit the kind
    check_chain_keys(cfg.distill)
    lineage = Lineage.of(cfg, list(cfg.hydra.overrides.task) if "hydra" in cfg else None)
    if not stage_distils(lineage):
        return
    check_teacher_sizes(cfg.distill.teacher.sizes)
    chained = teacher_run_dir(lineage)
    if chained is not None and teacher_run_state(chained) != "finished":
        return  # trained first by the sweep; a single launch is refused by preflight (stages.finished_teacher_run)
    reference = str(chained.path) if chained is not None else cfg.distill.teacher.checkpoint
    source = resolve_teacher(cfg.distill.teacher, cfg.runtime.output_root, reference)
    if source.run is not None:
        check_teacher_run(source.run, reference, cfg.distill.teacher.allow_unfinished)
    if timm.is_model(source.model):
        meta_teacher(source.model, cfg.data.num_classes, source.kwargs)
    if source.checkpoint is None or not Path(source.checkpoint).is_file():
        load_teacher(source.model, source.checkpoint, cfg.data.num_classes)  # raises for a missing/unset checkpoint
    if not timm.is_model(source.model):
        raise ConfigError(f"distill.teacher.model={source.model} is not a timm model; set it to the teacher's "
                          "architecture.")
    check_resizable_teacher(cfg.distill.teacher.sizes, source)


def meta_teacher(model_name: str, num_classes: int, kwargs: Mapping[str, Any]) -> None:
    """Build the teacher on the meta device (no memory, no weights): a ConfigError naming distill.teacher.kwargs when
    timm refuses them, so such a value stops the launch, not the run after its data are read."""
    try:
        with torch.device("meta"):
            timm.create_model(model_name, pretrained=False, num_classes=num_classes, **kwargs)
    except Exception as error:  # whatever timm raises for arguments it cannot build: TypeError, AssertionError, ...
        given = ", ".join(f"distill.teacher.kwargs.{key}={value}" for key, value in kwargs.items()) or "no kwargs"
        raise ConfigError(f"the teacher {model_name} cannot be built with {given}: timm refuses them "
                          f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no message'}). "
                          "Set distill.teacher.kwargs to what the teacher was trained with (a teacher run folder "
                          "brings its own).") from None


def check_teacher_sizes(sizes: Sequence[int] | None) -> None:
    """distill.teacher.sizes, when set: at least one size, each once."""
    if sizes is not None and (not sizes or len(set(sizes)) != len(sizes)):
        raise ConfigError(f"distill.teacher.sizes={list(sizes)} must list distinct sizes, at least one: the "
                          "teacher's logits are averaged over the batch resized to each. Name each size once (e.g. "
                          "distill.teacher.sizes=[224,384]), or set it to null for the batch as it is.")


def check_resizable_teacher(sizes: Sequence[int] | None, source: TeacherSource) -> None:
    """With distill.teacher.sizes, a ViT teacher built to take other sizes than its own."""
    if sizes and is_vision_transformer(source.model) and not source.kwargs.get("dynamic_img_size"):
        raise ConfigError(f"distill.teacher.sizes={list(sizes)} resizes the batch the teacher sees, but the ViT "
                          f"teacher {source.model} is built for one size. Add "
                          "distill.teacher.kwargs.dynamic_img_size=true (its position embeddings resampled to each "
                          "size), or name the teacher's run folder in distill.teacher.checkpoint, which does so.")


def check_chain_keys(distill: DistillConfig) -> None:
    """A ConfigError when distill.teacher.chain is set with a teacher checkpoint, or without distillation."""
    chain = distill.teacher.get("chain")
    if chain is None:
        return
    if distill.teacher.checkpoint:
        raise ConfigError(f"distill.teacher.chain={chain} and distill.teacher.checkpoint="
                          f"{distill.teacher.checkpoint} are both set: chain trains the teacher in the same sweep, "
                          "checkpoint names one trained already. Set only one of them.")
    if distill.type == DistillKind.none:
        raise ConfigError(f"distill.teacher.chain={chain} is set but distill=none: there is no student to distil. "
                          "Pick a distillation (e.g. distill=hard_token) or drop distill.teacher.chain.")


def build_teacher(source: TeacherSource, num_classes: int, device: torch.device,
                  sizes: Sequence[int] | None = None) -> nn.Module:
    """The frozen teacher the plan resolved (`run_teacher`) on `device` (channels_last on GPU), checked against the
    data's class count; evaluated at each of `sizes` (distill.teacher.sizes), its logits averaged, when given."""
    teacher = teacher_layout(load_teacher(source.model, source.checkpoint, num_classes, **source.kwargs).to(device),
                             device)
    return teacher if not sizes else MultiSizeTeacher(teacher, sizes).eval()


def teacher_layout(teacher: nn.Module, device: torch.device) -> nn.Module:
    """A CNN teacher in channels_last on a GPU (its convolutions' fast layout there); a ViT, or on the CPU, as is."""
    if device.type == "cuda" and not hasattr(teacher, "pos_embed"):
        return teacher.to(memory_format=torch.channels_last)
    return teacher


# ----------------------------------------------------------------------------------------------------------
# Which teacher weights a student used


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha1 of the weights: each tensor's name, dtype, shape and raw bytes, in sorted key order."""
    digest = hashlib.sha1()
    for key in sorted(state):
        tensor = state[key].detach().cpu().contiguous()
        digest.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the bytes as they are, no copy
    return digest.hexdigest()


def _stat(path: Path) -> list[int]:
    """What changes whenever the file is written or replaced: size, modification and change times."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


_digests: dict[tuple[str, tuple[int, ...]], str] = {}  # one read per teacher file in a sweep's process


def file_weights_digest(path: Path) -> str:
    """The weights digest of a checkpoint file (read once per version of the file in this process)."""
    key = (str(path), tuple(_stat(path)))
    if key not in _digests:
        _digests[key] = weights_digest(read_weights(path, source=f"The teacher checkpoint {path}"))
    return _digests[key]


def _describe(teacher: Mapping[str, Any]) -> str:
    where = f"the teacher run '{teacher['run']}', " if teacher.get("run") else ""
    return f"sha1 {teacher['digest'][:12]}, {where}{teacher['checkpoint']}"


def run_teacher(lineage: Lineage, teacher: TeacherConfig, chained: RunDir | None = None,
                dry_run: bool = False) -> TeacherSource | None:
    """The teacher the run distils from: its chained teacher run `chained` (stages.teacher_run_dir) or
    distill.teacher.checkpoint (`teacher`), resolved; None without distillation, or in a dry run whose chained teacher
    run has not trained yet. A ConfigError, with the command that trains it, when that teacher run has not finished."""
    if not stage_distils(lineage):
        return None
    if chained is not None and teacher_run_state(chained) != "finished":
        if dry_run:
            return None  # the dry run says it waits for it (lifecycle.launch_plan)
        finished_teacher_run(lineage)  # refused, with the command that trains it
    reference = str(chained.path) if chained is not None else None
    return resolve_teacher(teacher, lineage.output_root, reference)


def teacher_identity(source: TeacherSource | None, run_dir: RunDir) -> dict[str, Any] | None:
    """What the run distils from (None without a teacher): the teacher run's name, id, state and top-1, the
    checkpoint file and the digest of its weights. A ConfigError when the run folder records other teacher
    weights."""
    if source is None:
        return None
    path = Path(source.checkpoint).resolve()
    recorded = (run_dir.read_identity() or {}).get("teacher")
    stat = _stat(path)
    same_file = recorded is not None and recorded.get("checkpoint") == str(path) and recorded.get("stat") == stat
    digest = recorded["digest"] if same_file else file_weights_digest(path)
    run = source.run
    teacher = {"run": run.name if run else None, "run_id": _run_id(run) if run else None,
               "status": teacher_run_state(run) if run else None, "checkpoint": str(path), "digest": digest,
               "stat": stat, **_teacher_top1(run)}
    if recorded is not None and recorded.get("digest") != digest:
        raise ConfigError(
            f"{run_dir.path} holds this experiment distilled from other teacher weights ({_describe(recorded)}) than "
            f"distill.teacher.checkpoint gives now ({_describe(teacher)}): the teacher was trained on or replaced "
            "since. The teacher's weights are part of a student's identity: distil from the new weights under another "
            f"output folder (runtime.output_root=...), or delete {run_dir.path} to train the student again here.")
    return teacher


def with_run_teacher(identity: RunIdentity, source: TeacherSource | None, run_dir: RunDir) -> RunIdentity:
    """`identity` with the teacher the run distils from (identity.with_teacher); a ConfigError when the run folder
    records other teacher weights."""
    return with_teacher(identity, teacher_identity(source, run_dir), run_dir.read_identity())


def _teacher_top1(run: RunDir | None) -> dict[str, float]:
    """The teacher run's own top-1 from its result (Table 2's teacher column), where it has one."""
    with contextlib.suppress(ConfigError, ValueError, OSError):
        result = run.read_result() if run is not None else None
        if result and isinstance(result.get("top1"), (int, float)):
            return {"top1": float(result["top1"])}
    return {}


def _run_id(run: RunDir) -> str | None:
    """The teacher run's wandb id, from its result or, unfinished, its identity."""
    for read in (run.read_result, run.read_identity):
        with contextlib.suppress(ConfigError, ValueError, OSError):
            recorded = read()
            if recorded and recorded.get("run_id"):
                return str(recorded["run_id"])
    return None


def teacher_summary(teacher: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What result.json and the wandb summary say about the teacher (the file's stat stays in identity.json)."""
    return None if teacher is None else {k: v for k, v in teacher.items() if k != "stat"}


def log_teacher(teacher: Mapping[str, Any] | None) -> None:
    """Name in the run's log the teacher weights it distils from; warn when the teacher run had not finished."""
    if teacher is None:
        return
    if teacher.get("run"):
        log.info(f"[run] distilling from the teacher run {teacher['run']} ({teacher['status']}): "
                 f"{teacher['checkpoint']}, weights sha1 {teacher['digest'][:12]}")
    else:
        log.info(f"[run] distilling from the teacher checkpoint {teacher['checkpoint']}, weights sha1 "
                 f"{teacher['digest'][:12]}")
    state = teacher.get("status")
    if state and state != "finished":
        log.warning(f"[run] the teacher run '{teacher['run']}' {_state_text(state)}; distilling from its latest "
                    f"checkpoint anyway (distill.teacher.allow_unfinished=true): {teacher['checkpoint']}. Should the "
                    "teacher train on, this student is refused at its next launch as distilled from other weights.")

"""The stages of a run: pre-training from scratch, then fine-tuning at a higher resolution (Table 8), and Table 7's
transfer to another dataset; and the runs a run starts from: a fine-tune's pre-training, a transfer's source run
(transfer.py), the LayerScale run whose learned diagonal CaiT's control fixes, or the teacher run a chained student
distils from (Table 2, distill.teacher.chain)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from deit_ablate.config.compose import compose_run_config
from deit_ablate.config.schema import CONF_DIR, Stage
from deit_ablate.config.stage_config import STAGE_BLOCKS, stage_config
from deit_ablate.core.errors import ConfigError, RunInUse
from deit_ablate.record import checkpoint as ckpt
from deit_ablate.record.overrides import chained_teacher_overrides, pretrain_overrides, swap_overrides, train_command
from deit_ablate.record.resolvers import run_dir_of
from deit_ablate.record.rundir import LAST, RUNS, RunDir
from deit_ablate.record.runlock import live_holder
from deit_ablate.run.lineage import Lineage
from deit_ablate.run.transfer import SOURCE_ROLE, source_overrides, source_run_dir
from deit_ablate.train.deeper import layer_scale_digest, layer_scale_values, set_layer_scale
from deit_ablate.train.models import resize_pos_embed_state


@dataclass(frozen=True)
class StageRecipe:
    """The batch, optimizer settings and length of this stage, and the weights it starts from."""

    global_batch: int
    optimizer: str
    lr: float  # per lr_base_batch images
    weight_decay: float
    epochs: int
    warmup_epochs: float
    warmup_lr: float
    min_lr: float
    lr_base_batch: int = 512  # lr is per this many images: the stage's own rule
    train_mode: bool = True  # False: the model stays in eval mode while it trains (DeiT's fine-tune)
    init_checkpoint: Path | None = None
    sam_rho: float = 0.0  # SAM's radius: optimizer.sam_rho in a pre-training, whose optimizer it wraps; else 0
    layer_decay: float | None = None  # finetune.layer_decay in a fine-tune: one lr scale per layer
    sched: str = "cosine"  # timm's schedule (optimizer.sched): cosine, step or none
    sched_on: str = "update"  # update: moved after every update; epoch: after every epoch, as the released main.py
    decay_epochs: float = 30.0  # sched=step: epochs between two decays
    decay_rate: float = 0.1  # sched=step: the factor of each decay


def stage_distils(lineage: Lineage) -> bool:
    """Whether this stage learns from a teacher: a distillation kind is set and the stage is not a transfer (its
    source's teacher knows other classes; there the distill keys only name the source run)."""
    return lineage.distills and lineage.stage != Stage.transfer


@dataclass(frozen=True)
class StageBatch:
    """This stage's global batch and micro-batch, with the keys that set them (for errors that name the fix)."""

    global_batch: int
    global_key: str  # finetune.global_batch in a fine-tune that sets it, else train.global_batch
    micro_batch: int
    micro_key: str  # finetune.micro_batch / transfer.micro_batch where set, else train.micro_batch


def stage_batch(cfg: DictConfig) -> StageBatch:
    """The batch this stage runs (stage_config) and the keys that set it."""
    block = STAGE_BLOCKS.get(str(cfg.stage))

    def key(name: str) -> str:
        return f"{block}.{name}" if block is not None and cfg[block].get(name) is not None else f"train.{name}"

    train = stage_config(cfg).train
    return StageBatch(train.global_batch, key("global_batch"), train.micro_batch, key("micro_batch"))


def upstream_run_dir(lineage: Lineage) -> RunDir | None:
    """The folder of the run this stage starts from: a fine-tune's pre-training or a transfer's source (None for a
    pre-training, or a stage started from an init_checkpoint)."""
    if lineage.stage == Stage.transfer:
        return source_run_dir(lineage)
    return pretrain_run_dir(lineage)


def pretrain_run_dir(lineage: Lineage) -> RunDir | None:
    """The folder of the pre-training run a fine-tune stage starts from (None for a pre-training, or a fine-tune of
    finetune.init_checkpoint): the run of the same overrides without the stage, resolution and finetune.* ones
    (which never change a pre-training), composed as Hydra would."""
    if lineage.stage != Stage.finetune or lineage.finetune_init:
        return None
    return run_dir_of(pretrain_overrides(list(lineage.overrides)), lineage.output_root)


def upstream_status(lineage: Lineage, upstream: RunDir | None) -> str:
    """How the run this stage starts from ended ("finished", "diverged", ...): a fine-tune's pre-training `upstream`
    or a transfer's source, or the stage's init_checkpoint (finished when the file exists); a ConfigError if it has
    not finished."""
    stage = "transfer" if lineage.stage == Stage.transfer else "finetune"
    if lineage.init_checkpoint:
        path = Path(lineage.init_checkpoint).expanduser()
        if not path.is_file():
            written_by = "a finished run" if stage == "transfer" else "a pre-training run"
            raise ConfigError(f"{stage}.init_checkpoint={path} does not exist. Point it at a checkpoint written by "
                              f"{written_by} (outputs/{RUNS}/<run>/{LAST}).")
        return "finished"
    result = upstream.read_result()
    if result is None:
        holder = live_holder(upstream.path)
        if holder is not None:
            raise RunInUse(f"{upstream_role(lineage)} {upstream.name} is being trained by another launch: {holder}. "
                           "Launch this run again once that one has finished.")
        raise ConfigError(_not_finished(lineage, upstream))
    return result["status"]


def _not_finished(lineage: Lineage, upstream: RunDir) -> str:
    """What to do when the run this stage starts from has not finished: train it first, or sweep both."""
    if lineage.stage == Stage.transfer:
        command = train_command(source_overrides(lineage) or [])
        return (f"stage=transfer starts from the run '{upstream.name}', which has not finished ({upstream.result} is "
                f"missing). Train it first: {command}; or sweep both in one command "
                "(on SLURM the transfer waits for it), or set transfer.init_checkpoint=/path/to/ckpt.pt.")
    return (f"stage=finetune starts from the pre-training run '{upstream.name}', which has not finished "
            f"({upstream.result} is missing). Run the pre-training first (the same command without stage=finetune), "
            "sweep both stages in one command (stage=pretrain,finetune, pre-training listed first), or set "
            "finetune.init_checkpoint=/path/to/checkpoint.pt.")


def compared_config(lineage: Lineage) -> DictConfig | None:
    """The config of the run a fine-tune or transfer starts from (its pre-training, its source at its source stage), as
    that run ran it, for the log line that names what the stage changes; None for a pre-training or a stage started
    from a checkpoint file (its own composed config is compared)."""
    upstream = None if lineage.init_checkpoint or lineage.stage == Stage.pretrain else upstream_overrides(lineage)
    return None if upstream is None else stage_config(compose_run_config(upstream))


def changes_line(lineage: Lineage, changes: list[str]) -> str | None:
    """The run log's line naming every key a fine-tune or transfer runs differently from what `compared_config` gave
    (stage_config.stage_changes); None without a change."""
    if not changes:
        return None
    stage = lineage.stage.value
    if lineage.init_checkpoint:
        start = f"the launch's config with its {STAGE_BLOCKS[stage]} block"
    elif lineage.stage == Stage.finetune:
        start = "its pre-training's config"
    else:
        start = f"the config of its source run (transfer.source_stage={lineage.transfer_source_stage})"
    return f"the {stage} runs {start} with: {', '.join(changes)}"


def stage_recipe(cfg: DictConfig, upstream: RunDir | None = None) -> StageRecipe:
    """The stage's `optimizer` and `train` as it runs them (stage_config.py: a fine-tune's are the `finetune` block's,
    Table 8's second column; a transfer's the `transfer` block's, Table 7 and facebookresearch/deit issue #45), a
    later stage starting from its init_checkpoint, else from the last checkpoint of the run it starts from,
    `upstream`."""
    applied = stage_config(cfg)
    opt, train = applied.optimizer, applied.train
    schedule = {"sched": str(opt.sched), "sched_on": str(opt.sched_on), "decay_epochs": float(opt.decay_epochs),
                "decay_rate": float(opt.decay_rate)}
    if cfg.stage == Stage.pretrain:
        return StageRecipe(train.global_batch, opt.name, opt.lr, opt.weight_decay, train.epochs, opt.warmup_epochs,
                           opt.warmup_lr, opt.min_lr, opt.lr_base_batch, sam_rho=float(opt.sam_rho), **schedule)
    block = cfg.transfer if cfg.stage == Stage.transfer else cfg.finetune
    if block.init_checkpoint:
        init = Path(block.init_checkpoint).expanduser()
    else:
        init = (upstream or upstream_run_dir(Lineage.of(cfg))).last_checkpoint
    # a transfer trains in train mode, like a pre-training; a fine-tune as finetune.train_mode says
    train_mode = cfg.stage == Stage.transfer or block.train_mode
    return StageRecipe(train.global_batch, opt.name, opt.lr, opt.weight_decay, train.epochs, opt.warmup_epochs,
                       opt.warmup_lr, opt.min_lr, opt.lr_base_batch, train_mode=train_mode, init_checkpoint=init,
                       layer_decay=cfg.finetune.layer_decay if cfg.stage == Stage.finetune else None, **schedule)


def pretrained_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The weights a pre-training run ended with: its EMA's when it kept one (the `ema` row's result)."""
    source = f"The pre-trained checkpoint {path}"
    if Path(path).suffix == ".safetensors":
        return ckpt.read_weights(path, source=source)
    state = ckpt.load(path, source)  # read once: a paper-scale checkpoint is about a gigabyte
    if isinstance(state, dict) and isinstance(state.get("ema"), dict):
        state = {"model": state["ema"]}
    return ckpt.extract_state_dict(state, source=source)


def load_pretrained(model: torch.nn.Module, path: str | Path) -> None:
    """Load pre-trained weights into `model`, resizing the position embeddings to its grid."""
    model.load_state_dict(resize_pos_embed_state(pretrained_weights(path), model))


def classifier_names(model: torch.nn.Module) -> tuple[str, ...]:
    """The module names of `model`'s classification head(s): `head`, and `head_dist` on a distilled DeiT."""
    heads = model.get_classifier()
    heads = heads if isinstance(heads, tuple) else (heads,)
    return tuple(name for name, module in model.named_modules() if name and any(module is h for h in heads))


def load_backbone(model: torch.nn.Module, path: str | Path) -> tuple[str, ...]:
    """Load pre-trained weights into `model` but for its classification head(s), which stay newly initialised for
    the new classes (a transfer); position embeddings resized to its grid. Returns the heads' names."""
    heads = classifier_names(model)
    state = {key: value for key, value in pretrained_weights(path).items()
             if not any(key.startswith(head + ".") for head in heads)}
    missing, unexpected = model.load_state_dict(resize_pos_embed_state(state, model), strict=False)
    not_heads = [key for key in missing if not any(key.startswith(head + ".") for head in heads)]
    if not_heads or unexpected:
        raise ConfigError(f"the checkpoint {path} is another architecture than this transfer's model: missing "
                          f"{not_heads[:5]}, unexpected {unexpected[:5]}. Transfer with the source run's model.")
    return heads


# The study whose rows model.kwargs.layer_scale_from names, and the keys of the row that fixes a learned diagonal
# (left out of the overrides of the run it takes the diagonal from).
LAYER_SCALE_GROUP = "cait"
LAYER_SCALE_KEYS = ("model.kwargs.layer_scale_from", "model.kwargs.layer_scale_learned")


def layer_scale_row(row: str | None) -> str | None:
    """The row of the cait study that model.kwargs.layer_scale_from names (None when unset); a ConfigError if there
    is no such row."""
    if row is None:
        return None
    if not (CONF_DIR / LAYER_SCALE_GROUP / f"{row}.yaml").is_file():
        rows = sorted(p.stem for p in (CONF_DIR / LAYER_SCALE_GROUP).glob("depth*_layerscale.yaml"))
        raise ConfigError(f"model.kwargs.layer_scale_from={row} is not a row of the {LAYER_SCALE_GROUP} study "
                          f"(conf/{LAYER_SCALE_GROUP}/). Name a row that learns LayerScale: {', '.join(rows)}.")
    return str(row)


def layer_scale_source_overrides(lineage: Lineage) -> list[str] | None:
    """The overrides of the LayerScale run this run takes its diagonal from (None when it takes none). A
    fine-tune takes none: its pre-trained weights hold the diagonal its pre-training fixed."""
    row = layer_scale_row(lineage.layer_scale_from)
    if row is None or lineage.stage != Stage.pretrain:
        return None
    # the same overrides with cait=<row>, without the fixing row's own keys
    return swap_overrides(list(lineage.overrides), f"{LAYER_SCALE_GROUP}={row}", LAYER_SCALE_KEYS)


def upstream_overrides(lineage: Lineage) -> list[str] | None:
    """The overrides of the run that a run launched with `overrides` starts from, which a sweep must train first: a
    fine-tune's pre-training, the teacher run a chained student distils from, or the LayerScale run whose diagonal a
    pre-training fixes (None: no such run)."""
    if lineage.stage == Stage.finetune:
        return pretrain_overrides(list(lineage.overrides))
    if lineage.stage == Stage.transfer:
        return source_overrides(lineage)
    if chained_teacher(lineage) is not None:
        return teacher_run_overrides(lineage)
    return layer_scale_source_overrides(lineage)


def upstream_role(lineage: Lineage) -> str:
    """What the run `lineage` starts from is to it, in words ("its pre-training"), for logs and plans."""
    if lineage.stage == Stage.finetune:
        return "its pre-training"
    if lineage.stage == Stage.transfer:
        return SOURCE_ROLE
    if chained_teacher(lineage) is not None:
        return "its teacher run"
    return "its LayerScale run"


def chained_teacher(lineage: Lineage) -> str | None:
    """The model option of the teacher this run trains first (distill.teacher.chain), or None; a ConfigError when
    conf/model/ has no such option."""
    chain = lineage.teacher_chain
    if chain is None or lineage.stage == Stage.transfer:  # a transfer distils from no teacher (transfer.py)
        return None
    if not (CONF_DIR / "model" / f"{chain}.yaml").is_file():
        options = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
        raise ConfigError(f"distill.teacher.chain={chain} is not a model option (conf/model/). Name one of: "
                          f"{', '.join(options)}.")
    return str(chain)


def teacher_run_overrides(lineage: Lineage) -> list[str] | None:
    """The overrides of the teacher run a chained student distils from (None when distill.teacher.chain is unset):
    the student's pre-training overrides without study rows, distill.* and model.* ones, plus model=<chain> and
    distill.teacher.kwargs as its model.kwargs (Table 2's demo CNNs of three sizes): the run
    `python train.py model=<chain> ...` trains, with the DeiT recipe (as DeiT trained its RegNetY-16GF)."""
    chain = chained_teacher(lineage)
    return None if chain is None else chained_teacher_overrides(chain, lineage.teacher_kwargs, list(lineage.overrides))


def teacher_run_dir(lineage: Lineage) -> RunDir | None:
    """The folder of the teacher run a chained student distils from (None when distill.teacher.chain is unset)."""
    teacher_overrides = teacher_run_overrides(lineage)
    return None if teacher_overrides is None else run_dir_of(teacher_overrides, lineage.output_root)


def finished_teacher_run(lineage: Lineage) -> RunDir | None:
    """The finished teacher run a chained student distils from (None when unchained); a ConfigError naming it and
    the command that trains it when it has not finished."""
    source = teacher_run_dir(lineage)
    if source is None:
        return None
    return require_finished(
        source, f"distils from the teacher run '{source.name}' (distill.teacher.chain={chained_teacher(lineage)})",
        train_command(teacher_run_overrides(lineage)),
        "or sweep the student with -m (the sweep trains its teacher run first; on SLURM the student waits for it).")


def layer_scale_run_dir(lineage: Lineage) -> RunDir | None:
    """The folder of the LayerScale run whose learned diagonal this run fixes (CaiT appendix A's control): the run
    of the same overrides with `cait=<model.kwargs.layer_scale_from>`, composed as Hydra would; None when unset."""
    source_overrides = layer_scale_source_overrides(lineage)
    if source_overrides is None:
        return None
    upstream = compose_run_config(source_overrides)
    kwargs = upstream.model.kwargs
    if not kwargs.get("init_values") or kwargs.get("layer_scale_from") or kwargs.get("layer_scale_learned") is False:
        raise ConfigError(f"model.kwargs.layer_scale_from={lineage.layer_scale_from}: that row does not learn "
                          "LayerScale from ε (its model.kwargs.init_values is unset, or its diagonal is fixed). Name a "
                          "row that learns it, e.g. depth18_layerscale.")
    return run_dir_of(source_overrides, lineage.output_root, upstream)


def require_finished(source: RunDir, needs: str, command: str, alternative: str) -> RunDir:
    """`source` when it finished; else a ConfigError saying what this run `needs` it for, how it ended and the
    command that trains it (or the `alternative`)."""
    result = source.read_result()
    if result is None or result["status"] != "finished":
        state = "has not finished" if result is None else f"ended as {result['status']}"
        raise ConfigError(f"this run {needs}, which {state} ({source.result}). Train it first: {command}; "
                          f"{alternative}")
    return source


def _require_layer_scale_run(lineage: Lineage, source: RunDir) -> RunDir:
    """`source` when that LayerScale run finished; else a ConfigError naming it and the command that trains it."""
    return require_finished(
        source, f"fixes the LayerScale diagonal at the values the run '{source.name}' learned (model.kwargs."
        f"layer_scale_from={layer_scale_row(lineage.layer_scale_from)}, CaiT appendix A)",
        train_command(layer_scale_source_overrides(lineage) or []),
        "or sweep both in one command, that row listed first (on SLURM the run waits for it).")


def finished_layer_scale_run(lineage: Lineage) -> RunDir | None:
    """The finished LayerScale run whose diagonal this run fixes (None when it fixes none); a ConfigError naming
    it and the command that trains it when it has not finished."""
    source = layer_scale_run_dir(lineage)
    return None if source is None else _require_layer_scale_run(lineage, source)


def check_layer_scale_run(lineage: Lineage, source: RunDir, data_digest: str | None) -> None:
    """A ConfigError, before anything trains, when the LayerScale run `source` (`layer_scale_run_dir`) has not
    finished, or trained on other data than `data_digest`."""
    _require_layer_scale_run(lineage, source)
    recorded = (source.recorded_data() or {}).get("digest")
    if recorded is not None and recorded != data_digest:
        raise ConfigError(f"the LayerScale run '{source.name}' was trained on other data than this run's; train it on "
                          "this data first, under another output folder (runtime.output_root=...).")


def fix_layer_scale(model: torch.nn.Module, source: RunDir | None) -> dict[str, str] | None:
    """Set `model`'s LayerScale diagonal to the one the finished LayerScale run `source` ended with (the plan's,
    checked by `check_layer_scale_run`); that run's name and the diagonal's digest (None without a source). A
    ConfigError when its checkpoint is another architecture."""
    if source is None:
        return None
    values = layer_scale_values(pretrained_weights(source.last_checkpoint))
    set_layer_scale(model, values, f"the checkpoint of the LayerScale run '{source.name}' ({source.last_checkpoint})")
    return {"run": source.name, "digest": layer_scale_digest(values)}

"""Structured config schemas: every key a run can take, typed, so a misspelled key fails at composition."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any, get_type_hints

from omegaconf import OmegaConf

from deit_ablate.config.ranges import MAX_SIDE, SIDE_HINT, Range, fraction, ranged
from deit_ablate.config.studies import CONF_DIR


class Choice(str, Enum):
    """A key with a fixed set of values: OmegaConf refuses any other at composition, naming the allowed ones."""

    def __str__(self) -> str:
        return self.value


Stage = Choice("Stage", {name: name for name in ("pretrain", "finetune", "transfer")})
DataName = Choice("DataName", {name: name for name in ("builtin", "imagenet", "imagefolder", "cifar10", "cifar100")})
EraseMode = Choice("EraseMode", {name: name for name in ("pixel", "rand", "const")})  # timm RandomErasing
MixMode = Choice("MixMode", {name: name for name in ("batch", "pair", "elem")})  # timm Mixup
DistillKind = Choice("DistillKind", {name: name for name in ("none", "soft", "hard", "hard_token", "soft_token")})
KLNormalization = Choice("KLNormalization", {name: name for name in ("elements", "batch")})
FusionRule = Choice("FusionRule", {name: name for name in ("prob", "logit")})
Precision = Choice("Precision", {name: name for name in ("auto", "bf16", "fp16", "fp32")})
BadImagePolicy = Choice("BadImagePolicy", {name: name for name in ("skip", "fail")})
TrackingMode = Choice("TrackingMode", {name: name for name in ("offline", "online", "disabled")})
DataBackend = Choice("DataBackend", {name: name for name in ("pil", "dali")})  # data/transforms.py, data/dali.py
CropMode = Choice("CropMode", {name: name for name in ("rrc", "simple")})  # random-resized crop, or DeiT III's simple
Criterion = Choice("Criterion", {name: name for name in ("ce", "bce")})  # soft-target cross-entropy, or DeiT III's BCE
TeacherView = Choice("TeacherView", {name: name for name in ("same", "fixed")})  # Beyer et al. 2022
HeadKind = Choice("HeadKind", {name: name for name in ("linear", "mlp_tanh")})  # model.head (models.py)
# timm's schedules as main.py names them (--sched): cosine, step (x decay_rate every decay_epochs), none (a flat lr)
Sched = Choice("Sched", {name: name for name in ("cosine", "step", "none")})
# update: moved after every update from lr(0); epoch: as the released main.py, one epoch late (train/optim.py)
SchedOn = Choice("SchedOn", {name: name for name in ("update", "epoch")})


BETA = "a Beta parameter (0 turns it off)"


@dataclass
class ModelConfig:
    """A timm model and its regularizers."""

    name: str = "deit_base_patch16_224"
    drop_path: float = fraction(0.1)  # stochastic depth, linspace(0, p, depth) over blocks (DeiT Table 9)
    # DeiT's --drop (timm 0.3.2): after the position embedding, in the attention projection and the MLP, not
    # before the head (timm 1.0's pos_drop_rate and proj_drop_rate; its drop_rate stays 0 on ViTs)
    dropout: float = fraction(0.0)
    # The same network with a distillation token (timm name), trained instead of `name` by distill=hard_token
    # and soft_token, as DeiT's Table 3 trains DeiT-B for the class-token rows and DeiT-B⚗ for the token rows
    distilled_name: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra timm create_model arguments
    # The classifier: `linear` (DeiT's), or `mlp_tanh`, the original ViT's pre-training head (Dosovitskiy et al.
    # 2021, section 3.1): a pre-logits layer, Linear d->d then tanh, before it; timm's ViTs without distillation
    # token only. vit_original's transfer gets a linear head (its override set: conf/recipe/vit_original.yaml)
    head: HeadKind = HeadKind.linear


@dataclass
class BuiltinDataConfig:
    """How the procedural dataset is drawn (data=builtin only)."""

    image_size: int = ranged(40, ge=8, le=MAX_SIDE, hint=SIDE_HINT)
    train_per_class: int = ranged(500, ge=1)
    val_per_class: int = ranged(100, ge=1)
    seed: int = ranged(0, ge=0)
    # which shapes: `shapes` (the 10 classes of every run so far) or `shapes_b` (10 others: a second dataset for
    # the demo's transfer stage; data/builtin.py CLASS_SETS)
    classes: str = "shapes"


@dataclass
class DataConfig:
    """Where images come from: an ImageFolder-style train/val tree or CIFAR-100."""

    name: DataName = DataName.builtin
    root: str | None = None
    num_classes: int = ranged(10, ge=1)
    fast_jpeg: bool = False  # faster decode and crop of training JPEGs (changes pixels; data/fast_jpeg.py)
    # training images decoded and augmented by timm's PIL transform (pil, the reference's pixels) or by NVIDIA
    # DALI (dali, opt-in: on the GPU when there is one; data/dali.py)
    backend: DataBackend = DataBackend.pil
    mean: tuple[float, float, float] = fraction((0.485, 0.456, 0.406), "a channel's mean, pixels scaled to [0, 1]")
    std: tuple[float, float, float] = ranged((0.229, 0.224, 0.225), gt=0, hint="each channel is divided by it")
    builtin: BuiltinDataConfig = field(default_factory=BuiltinDataConfig)
    # the share of each class's training images trained on: the first ceil(f * n) of a fixed permutation per class
    # (data/datasets.py fraction_indices); the same images for every seed and layout; eval stays on all of val/
    fraction: float = ranged(1.0, gt=0, le=1, hint="the share of each class's training images kept")


@dataclass
class AugmentConfig:
    """Label-preserving augmentation of the training images (timm create_transform)."""

    auto_augment: str | None = "rand-m9-mstd0.5-inc1"
    # --color-jitter 0.4 in DeiT's main.py of the paper era (commit 1d38fa4, Dec 2020; 0.3 since DeiT III, 2022).
    # timm ignores it while an auto-augment policy is on, so only the no_randaugment row sees it.
    color_jitter: float = ranged(0.4, ge=0)
    reprob: float = fraction(0.25)  # random erasing probability
    remode: EraseMode = EraseMode.pixel
    recount: int = ranged(1, ge=1, le=16, hint="the erased boxes per image (DeiT: 1), each drawn in a loop")
    # copies of each image per epoch, each to a different rank; 1 = off
    repeated_aug: int = ranged(3, ge=1, hint="the copies of each image; 1 turns repeated augmentation off")
    scale: tuple[float, float] = ranged((0.08, 1.0), gt=0, le=1, hint="the crop's fraction of the image's area")
    no_aug: bool = False  # resize + center crop only: a deterministic pipeline for equivalence tests
    crop: CropMode = CropMode.rrc  # rrc: random-resized crop (scale above); simple: DeiT III's simple random crop
    three_augment: bool = False  # DeiT III's 3-Augment instead of an auto-augment policy (augment=three_augment)
    hflip: float = fraction(0.5)
    interpolation: str = "bicubic"


@dataclass
class MixConfig:
    """Mixup/CutMix (Beta alphas, not probabilities) and label smoothing."""

    mixup_alpha: float = ranged(0.8, ge=0, hint=BETA)
    cutmix_alpha: float = ranged(1.0, ge=0, hint=BETA)
    prob: float = fraction(1.0)
    switch_prob: float = fraction(0.5)
    mode: MixMode = MixMode.batch
    label_smoothing: float = fraction(0.1)
    criterion: Criterion = Criterion.ce  # bce: binary cross-entropy on the mixed targets (DeiT III)


@dataclass
class TeacherConfig:
    """The convnet teacher of a distillation run."""

    model: str = "regnety_160"
    checkpoint: str | None = None  # a checkpoint file, or a run folder / run name under outputs/runs
    kwargs: dict[str, Any] = field(default_factory=dict)
    # A teacher run folder without a finished result is refused; true distils from its latest checkpoint, with a
    # warning. A permission, not the experiment: the weights' digest (recorded in the run folder) stands for it.
    allow_unfinished: bool = False
    # A model option trained first as the teacher in the same sweep (record/overrides.py chained_teacher_overrides)
    chain: str | None = None
    # The sizes (px) the teacher sees each batch at, its logits averaged over them (Beyer et al. 2022's teacher at
    # 224 and 384): the batch resized bilinearly to each (teacher.MultiSizeTeacher); null = the batch as it is.
    sizes: list[int] | None = ranged(None, ge=1, le=MAX_SIDE, hint=SIDE_HINT)


@dataclass
class DistillConfig:
    """Distillation from a teacher (DeiT section 5)."""

    type: DistillKind = DistillKind.none
    alpha: float = fraction(0.0)  # weight of the teacher term
    tau: float = ranged(1.0, gt=0)  # temperature of the soft kinds
    # elements: the released code's sum / (B K); batch: per image, sum / B
    kl_normalization: KLNormalization = KLNormalization.elements
    # headline top-1 of a distilled model: prob = mean of softmaxes (paper); logit = mean of logits (code)
    fusion: FusionRule = FusionRule.prob
    # same: the student's (augmented, mixed) view, consistent teaching; fixed: one cached view (Beyer et al. 2022)
    teacher_view: TeacherView = TeacherView.same
    teacher: TeacherConfig = field(default_factory=TeacherConfig)


@dataclass
class OptimizerConfig:
    """Optimizer and learning-rate schedule; lr is per 512 images and scales with the global batch."""

    name: str = "adamw"
    lr: float = ranged(5e-4, gt=0)
    lr_base_batch: int = ranged(512, ge=1)
    weight_decay: float = ranged(0.05, ge=0)
    momentum: float = ranged(0.9, ge=0, lt=1, hint="SGD's momentum; 0 is plain SGD")  # SGD only
    betas: tuple[float, float] = ranged((0.9, 0.999), ge=0, lt=1, hint="Adam's decay rates of the gradient's moments")
    eps: float = ranged(1e-8, gt=0)
    sched: Sched = Sched.cosine
    sched_on: SchedOn = SchedOn.update
    decay_epochs: float = ranged(30.0, gt=0, hint="epochs between two decays of sched=step")  # main.py's default
    decay_rate: float = ranged(0.1, gt=0, hint="the factor sched=step multiplies the lr by")  # main.py's --decay-rate
    warmup_epochs: float = ranged(5.0, ge=0)
    warmup_lr: float = ranged(1e-6, ge=0)
    min_lr: float = ranged(1e-5, ge=0)
    clip_grad: float | None = ranged(None, gt=0, hint="the largest gradient norm (a negative one would reverse "
                                     "every step); null turns clipping off")
    # SAM's radius rho (Foret et al. 2021), wrapping the optimizer above; 0 = off (train/sam.py)
    sam_rho: float = ranged(0.0, ge=0, hint="SAM's radius; 0 turns SAM off (Chen, Hsieh & Gong 2022 use 0.05-0.25 "
                                               "for ViT-B/16, 0.2 with AdamW)")


@dataclass
class SharpnessConfig:
    """How sharpness is measured on a trained model (Chen, Hsieh & Gong 2022); an evaluation, not the experiment."""

    at_end: bool = False  # measure it after the last epoch too (`python -m deit_ablate.sharpness` on any run)
    # training images measured on: the first N of a seeded permutation of the train split
    images: int = ranged(1024, ge=1)
    # images per forward/double-backward pass (memory only: the figures do not depend on it)
    batch_size: int = ranged(64, ge=1)
    # most power iterations for lambda_max (Hessian-vector products over all N images each)
    iters: int = ranged(20, ge=1)
    tol: float = ranged(1e-3, gt=0.0)  # stop when lambda_max changes by less than this fraction between two iterations
    # Gaussian weight noise N(0, sigma^2) on every parameter (Chen, Hsieh & Gong 2022, Table 1: N(0, 0.01))
    sigma: float = ranged(0.01, ge=0.0)
    draws: int = ranged(5, ge=1)  # noise draws the noisy loss is averaged over
    seed: int = ranged(0, ge=0)  # picks the images, the power iteration's start vector and the noise


@dataclass
class ResolutionConfig:
    """Train and eval image size; eval resizes to size / crop_pct then center-crops."""

    train_size: int = ranged(224, ge=1, le=MAX_SIDE, hint=f"the side of a training image; {SIDE_HINT}")
    eval_size: int = ranged(224, ge=1, le=MAX_SIDE, hint=f"the side of an eval image; {SIDE_HINT}")
    crop_pct: float = ranged(0.875, ge=0.25, le=1, hint="eval resizes to eval_size / crop_pct (DeiT: 0.875, 1 at "
                             "384 px), at most 4 times the side")


@dataclass
class FinetuneConfig:
    """The second stage of Table 8: fine-tune the row's own checkpoint at a higher resolution.

    Defaults are the released DeiT fine-tune command (README of facebookresearch/deit: --batch-size 32 on
    2 nodes x 8 GPUs, --lr 5e-6 --weight-decay 1e-8 --epochs 30 --min-lr 5e-6, main.py's defaults else)."""

    init_checkpoint: str | None = None  # None: the same run's pre-training checkpoint (its EMA weights if kept)
    optimizer: str = "adamw"  # AdamW for every row but sgd_finetune (Table 8: the sgd row is SGD pre-training only)
    global_batch: int | None = ranged(None, ge=1)  # None: train.global_batch; the paper preset sets 512 (32 x 16 GPUs)
    micro_batch: int = ranged(32, ge=1)  # the released command's 32 images per GPU: the unit of every per-batch draw
    lr: float = ranged(5e-6, gt=0)  # per lr_base_batch images, like optimizer.lr
    # the fine-tune's own lr rule: lr is said per this many images (main.py's 512 for every stage), whatever the
    # pre-training's optimizer.lr_base_batch (the original ViT recipe's 4096)
    lr_base_batch: int = ranged(512, ge=1)
    weight_decay: float = ranged(1e-8, ge=0)
    epochs: int = ranged(30, ge=1)
    warmup_epochs: float = ranged(5.0, ge=0)  # main.py's --warmup-epochs default
    warmup_lr: float = ranged(1e-6, ge=0)  # main.py's --warmup-lr default
    min_lr: float = ranged(5e-6, ge=0)  # absolute, like optimizer.min_lr (DeiT scales only the peak lr)
    # The released code fine-tunes with the model in eval mode (engine.train_one_epoch(set_training_mode=False)):
    # no stochastic depth, no dropout in this stage. True trains it in train mode.
    train_mode: bool = False
    # layer-wise lr decay zeta: block k at zeta^(L-k) of the lr (None: off)
    layer_decay: float | None = ranged(None, gt=0, le=1, hint="the ratio zeta between one layer's lr and the "
                                       "next (1 = no decay; BEiT uses 0.65 for base models, 0.75 for large), or "
                                       "null for off")
    # The size this row pre-trains at when it is not the preset's (DeiT III's low-resolution pre-training): a
    # fine-tune's config then tells apart pre-trainings that differ only in size (None: the preset's).
    pretrain_size: int | None = ranged(None, ge=1, le=MAX_SIDE, hint=SIDE_HINT)
    # Any other key of the run as this stage runs it, nested as in the config (`mix: {criterion: ce}`): applied over
    # the pre-training's values (stage_config.py). DeiT III's fine-tune changes its loss, augmentation and drop path.
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class TransferConfig:
    """DeiT Table 7: fine-tune a finished run on another dataset with a new classification head.

    The released code has no transfer command. The defaults are the recipe its first author gave for CIFAR-10 and
    Cars in facebookresearch/deit issue #45 (2021-01-22): SGD, batch 768, lr 0.01, weight decay 1e-4, 1000 epochs at
    224 or 384 px, random erasing and stochastic depth removed, the rest as on ImageNet (RandAugment, Mixup/CutMix,
    label smoothing, repeated augmentation, 5 warm-up epochs, cosine). The iNaturalist rows set issue #105's; the
    option transfer_recipe=cait sets CaiT's rule (conf/transfer_recipe/)."""

    source_stage: Stage = Stage.finetune  # the run transferred: finetune (Table 7's DeiT-B⚗↑384) or pretrain
    init_checkpoint: str | None = None  # None: the source run's last checkpoint (its EMA weights if kept)
    optimizer: str = "sgd"
    global_batch: int = ranged(768, ge=1)
    micro_batch: int | None = ranged(None, ge=1)  # None: train.micro_batch (issue #45 names no per-GPU batch)
    # Issue #45's "lr 0.01" is the lr at its batch of 768, as the author reads his own numbers (issue #141: the lr
    # he gives is the one after main.py's linear scaling), so it is said at 768 images, not per 512 (0.015)
    lr: float = ranged(0.01, gt=0)
    lr_base_batch: int = ranged(768, ge=1)
    weight_decay: float = ranged(1e-4, ge=0)
    epochs: int = ranged(1000, ge=1)  # CaiT's (section 4.3) too; conf/transfer/inat*.yaml: 360, issue #105's and CaiT's
    warmup_epochs: float = ranged(5.0, ge=0)
    warmup_lr: float = ranged(1e-6, ge=0)  # main.py's --warmup-lr default
    min_lr: float = ranged(1e-5, ge=0)  # main.py's --min-lr default
    drop_path: float = fraction(0.0)  # stochastic depth removed (issue #45)
    reprob: float = fraction(0.0)  # random erasing removed (issue #45)
    # CaiT's factor for this dataset (Touvron et al. 2021b, section 4.3: 10 for Cars, Flowers and iNaturalist, 100
    # for CIFAR-10/100), read by transfer_recipe=cait alone: a run's identity holds the lr it gives, not the factor
    cait_lr_divisor: float = ranged(10.0, gt=0, hint="CaiT's factor from the pre-training's lr to the transfer's "
                                    "(10, or 100 for CIFAR)")
    overrides: dict[str, Any] = field(default_factory=dict)  # any other key, as FinetuneConfig.overrides


@dataclass
class TrainConfig:
    """Length, batch and precision of a run."""

    epochs: int = ranged(300, ge=1)
    global_batch: int = ranged(1024, ge=1)
    # The unit of every per-batch computation (one Mixup/CutMix draw, one SAM perturbation, one BatchNorm batch, one
    # sampler slot): the paper's 8 GPUs x 128. The global batch is global_batch / micro_batch virtual slots.
    micro_batch: int = ranged(128, ge=1)
    max_steps: int | None = ranged(None, ge=1)  # stop after this many optimizer steps (smoke tests: another experiment)
    ema: bool = False
    ema_decay: float = fraction(0.99996)
    # auto: bf16 autocast on GPU, fp32 on CPU; or bf16, fp32, or fp16 (autocast + a loss scaler, as the
    # released DeiT code trained)
    amp: Precision = Precision.auto
    # Replaced by eval_max_images (it counted per rank): any value is refused (validate.py); null keeps identities.
    eval_max_batches: int | None = ranged(None, ge=1)
    # The first N images of the eval split alone, on any layout (smoke tests: another experiment); null: all of it.
    eval_max_images: int | None = ranged(None, ge=1, hint="the images of the eval split scored, all ranks together")


@dataclass
class TrackingConfig:
    """wandb: offline by default into <output_root>/wandb, online when the user sets mode=online."""

    mode: TrackingMode = TrackingMode.offline
    project: str = "deit-ablate"
    entity: str | None = None


@dataclass
class RuntimeConfig:
    """How a run executes, never what it computes: not part of its identity, so changing any of these and
    relaunching resumes the same run (same folder, same wandb run)."""

    device: str = "auto"
    # torch intra-op threads of the training process; None: torch's default (one per core) on a CPU, the cores the
    # loader workers leave on a GPU (data/loader.py: loader_settings; docs/gpu.md)
    cpu_threads: int | None = ranged(None, ge=1, hint="or null for torch's default (one thread per core)")
    # data-loading workers; None: the cores available to this process on a CPU, all of a rank's cores but two on a GPU
    num_workers: int | None = ranged(None, ge=0)
    # added to the workers' niceness (0-19); None: 19 where the training step limits the run (a CPU training on
    # images of at most 64 px: the workers yield the cores to its threads), 0 elsewhere (decoding JPEGs, feeding a
    # GPU: the workers limit the run, and niced workers starve on a shared machine). docs/PERFORMANCE.md
    worker_nice: int | None = ranged(None, ge=0, le=19, hint="it is added to the loader workers' niceness, and only "
                                                             "root may raise a priority; use 0 to leave it as it is, "
                                                             "null to choose by device and image size")
    compile: bool = False  # torch.compile the model (opt-in; falls back to eager where it cannot)
    # images one forward/backward pass may hold: a device runs its micro-batches one at a time (accumulating), and
    # a micro-batch larger than this is refused unless splitting it computes exactly the same (validate.py)
    max_batch_per_device: int = ranged(128, ge=1)
    eval_batch: int = ranged(256, ge=1)
    log_interval: int = ranged(10, ge=1)
    checkpoint_every_steps: int = ranged(0, ge=0)  # also save a resumable checkpoint every N steps (0: off)
    # ... and every M minutes (0: off), so preemption loses little
    checkpoint_every_minutes: float = ranged(10.0, ge=0.0)
    # where the Table 7 transfer rows find their datasets, each under the row's name (conf/transfer/: cifar10/,
    # flowers/, ...); data.root overrides it for one run. Where data lies is not which data it is (the fingerprint).
    data_dir: str = "data"
    output_root: str = "outputs"  # run folders under <output_root>/runs, wandb logs under <output_root>/wandb
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    dry_run: bool = False  # print each run's identity and what a launch would do, then stop
    wait_for_lock: bool = False  # another launch trains this run: wait for it to end instead of exiting
    # an unreadable image: skip (the next readable one in its place, named in train.log and counted) or fail
    on_bad_image: BadImagePolicy = BadImagePolicy.skip


@dataclass
class Config:
    """A whole run: the experiment (every node but `runtime`) and how it executes (`runtime`)."""

    preset: str = "demo"
    stage: Stage = Stage.pretrain
    seed: int = ranged(0, ge=0)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    mix: MixConfig = field(default_factory=MixConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    resolution: ResolutionConfig = field(default_factory=ResolutionConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharpness: SharpnessConfig = field(default_factory=SharpnessConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


@functools.cache
def _preset_teacher(preset: str) -> str:
    teacher = OmegaConf.structured(TeacherConfig)
    path = CONF_DIR / "preset" / f"{preset}.yaml"
    if path.is_file():
        teacher = OmegaConf.merge(teacher, OmegaConf.select(OmegaConf.load(path), "distill.teacher", default={}))
    return json.dumps(OmegaConf.to_container(teacher, resolve=True, enum_to_str=True))


def preset_teacher(preset: str) -> dict[str, Any]:
    """The teacher block a run of `preset` has when nothing names a teacher: the schema's, with the preset's own on
    top (conf/preset/<preset>.yaml: the demo's CNN). What a run that does not distil holds in its identity."""
    return json.loads(_preset_teacher(str(preset)))  # a fresh copy: callers edit it


def schema_ranges(node: type = Config, prefix: str = "") -> list[tuple[str, Range]]:
    """(dotted key, range) of every numeric key of the schema, in the schema's order."""
    hints = get_type_hints(node)
    found: list[tuple[str, Range]] = []
    for item in fields(node):
        if is_dataclass(hints[item.name]):
            found += schema_ranges(hints[item.name], f"{prefix}{item.name}.")
        elif "range" in item.metadata:
            found.append((prefix + item.name, item.metadata["range"]))
    return found

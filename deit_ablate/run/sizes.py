"""The image sizes a run's stages take: a ViT's size at evaluation, a Mixer's at every stage, and the size a fine-tune
names for the pre-training it starts from (finetune.pretrain_size)."""

from __future__ import annotations

from deit_ablate.config.schema import FinetuneConfig, ResolutionConfig, Stage
from deit_ablate.core.errors import ConfigError
from deit_ablate.run.student import StudentSpec, build_stage_model
from deit_ablate.train.models import is_mixer


def check_image_sizes(student: StudentSpec, size: ResolutionConfig) -> None:
    """A model that takes one image size (a ViT's strict patch embedding) is evaluated at the size it trains at."""
    import torch
    from timm.layers import PatchEmbed

    if size.eval_size == size.train_size:
        return
    name = student.name
    with torch.device("meta"):  # the architecture only: no memory, no initialisation cost
        model = build_stage_model(student, size.train_size)
    embed = next((m for m in model.modules() if isinstance(m, PatchEmbed)), None)
    if embed is not None and embed.strict_img_size and not getattr(embed, "dynamic_img_pad", False):
        raise ConfigError(
            f"resolution.train_size={size.train_size} but resolution.eval_size={size.eval_size}: {name} is built for "
            f"{size.train_size}-px images and takes no other size, so its first evaluation would fail after an epoch "
            f"of training. Set resolution.eval_size={size.train_size} (with resolution.crop_pct the eval resize is "
            f"eval_size / crop_pct), or pick a resolution option that sets both.")


def check_mixer_size(student: StudentSpec, stage: Stage, pretrain_size: int | None) -> None:
    """A Mixer fine-tunes or transfers at the size it pre-trained at, named by finetune.pretrain_size: its
    token-mixing MLPs are sized to its patch grid, with no position table to resample."""
    name, size = student.name, student.img_size
    if stage == Stage.pretrain or not is_mixer(name) or pretrain_size == size:
        return
    raise ConfigError(f"stage={stage} of {name} at resolution.train_size={size}, but finetune.pretrain_size="
                      f"{pretrain_size}: a Mixer's token-mixing MLPs are sized to the patch grid of "
                      "the size it pre-trained at (no position table to resample, as a ViT's), so a later stage "
                      "must train at that size. Set resolution=<its size>px and finetune.pretrain_size=<its size> "
                      "(224 for the sam study's mixer rows at paper scale, 32 at demo scale).")


def check_pretrain_size(stage: Stage, pretrain_size: int | None, train_size: int) -> None:
    """finetune.pretrain_size, where set, is the size the pre-training stage trains at."""
    size = pretrain_size
    if size is not None and stage == Stage.pretrain and size != train_size:
        raise ConfigError(f"finetune.pretrain_size={size} but this pre-training trains at resolution.train_size="
                          f"{train_size}. Set resolution.train_size={size} for the pre-training "
                          "(conf/deit3/res_128.yaml shows how), or finetune.pretrain_size=null.")


def check_upstream_size(finetune: FinetuneConfig, stage: Stage, overrides: list[str] | None) -> None:
    """A fine-tune's finetune.pretrain_size, where set, is the size the pre-training it starts from trains at: the
    name would otherwise tell apart fine-tunes of one pre-training (or join those of two). Read from the pre-training's
    own config (the launch's overrides without the stage's: stages.upstream_run_dir's run)."""
    size = finetune.pretrain_size
    if size is None or stage != Stage.finetune or finetune.init_checkpoint or overrides is None:
        return
    from deit_ablate.config.compose import compose_run_config
    from deit_ablate.record.overrides import pretrain_overrides

    trains_at = compose_run_config(pretrain_overrides(overrides)).resolution.train_size
    if trains_at != size:
        raise ConfigError(f"finetune.pretrain_size={size}, but the pre-training this fine-tune starts from trains at "
                          f"resolution.train_size={trains_at}. Set finetune.pretrain_size={trains_at} (or null), or "
                          "fine-tune the row that pre-trains at that size.")

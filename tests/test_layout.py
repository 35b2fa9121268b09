"""layout=released: the released commands' per-GPU batch (README of facebookresearch/deit: DeiT-B on 2 nodes x 8
GPUs x 64, DeiT-S/Ti on 4 GPUs x 256) in one override; the paper preset keeps the paper's 8 x 128."""

from __future__ import annotations

import re

import pytest
from omegaconf.errors import InterpolationResolutionError

from deit_ablate.core.distributed import DistInfo
from deit_ablate.record.identity import composed_choices, run_identity
from deit_ablate.record.overrides import chained_teacher_overrides
from deit_ablate.record.rundir import RunDir, runs_root
from deit_ablate.run.lifecycle import dry_run_line
from deit_ablate.run.plan import make_plan
from deit_ablate.run.validate import plan_batch, validate_config
from tests.conftest import compose_config, one_class_imagefolder
from tests.test_ablation import _composed


@pytest.mark.parametrize(("model", "paper", "released"), [
    ("deit_base", (8, 128), (16, 64)), ("deit_small", (8, 128), (4, 256)), ("deit_tiny", (8, 128), (4, 256)),
    ("deit_small_distilled", (8, 128), (4, 256)),
])
def test_released_layout_is_one_override_per_model(model, paper, released):
    base = ["preset=paper", f"model={model}"]
    for overrides, (slots, micro) in ((base, paper), ([*base, "layout=released"], released)):
        cfg = compose_config(overrides)
        assert (cfg.train.global_batch, cfg.train.micro_batch) == (1024, micro), overrides
        plan = plan_batch(cfg, world_size=slots)  # the command's GPUs, one released per-GPU batch each, unsplit
        assert (plan.slots, plan.accum_steps, plan.split) == (slots, 1, 1)
        assert plan_batch(cfg, world_size=1).split == 1  # one process computes the same slots


def test_released_layout_plans_at_paper_scale_as_another_run(tmp_path):
    inputs = [*one_class_imagefolder(tmp_path / "imagenet"), f"runtime.output_root={tmp_path / 'out'}"]
    lines, digests = [], []
    for layout in ([], ["layout=released"]):
        overrides = ["preset=paper", "model=deit_small", "runtime.dry_run=true", *inputs, *layout]
        cfg = _composed(overrides)
        validate_config(cfg)
        identity = run_identity(cfg, overrides, composed_choices(cfg))
        plan = make_plan(cfg, DistInfo(), RunDir(runs_root(cfg.runtime.output_root) / identity.name), overrides)
        lines.append(dry_run_line(plan))
        digests.append(identity.digest)
    assert re.search(r"layout=released.*: train from step 0$", lines[1]), lines[1]
    assert digests[0] != digests[1]


def test_released_layout_names_what_it_cannot_give():
    with pytest.raises(InterpolationResolutionError, match=r"model.name=regnety_160 has none\. Drop layout=released"):
        compose_config(["preset=paper", "model=regnety_160", "layout=released"]).train.micro_batch  # noqa: B018
    with pytest.raises(InterpolationResolutionError, match="do not divide it"):
        compose_config(["model=deit_small", "layout=released", "train.global_batch=130"]).train.micro_batch  # noqa: B018


def test_a_chained_teacher_keeps_the_paper_layout():
    # headline=deit_ti_distilled trains its RegNetY-16GF first from the student's overrides: no released command
    overrides = ["preset=paper", "headline=deit_ti_distilled", "layout=released"]
    cfg = compose_config(overrides)
    teacher = compose_config(chained_teacher_overrides(str(cfg.distill.teacher.chain), {}, overrides))
    assert (cfg.train.micro_batch, teacher.model.name, teacher.train.micro_batch) == (256, "regnety_160", 128)

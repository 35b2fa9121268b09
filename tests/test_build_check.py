"""The launch check builds the run's pipeline once (run/build_check.py): what timm or torch would refuse mid-run,
after the run's folder was made, is refused before it as one line naming the key."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from conftest import TINY, compose_config, one_class_imagefolder, run_train

from deit_ablate.core.errors import ConfigError
from deit_ablate.run.validate import validate_launch

# Each value crashed a run after its folder was made (issue 52, point 4): the override and the message's start.
REFUSED = [
    (["data.std=[0.2,0.2]"], "data.std=[0.2, 0.2] has 2 item(s) but takes 3"),
    (["data.mean=[0.5,0.5,0.5,0.5]"], "data.mean=[0.5, 0.5, 0.5, 0.5] has 4 item(s) but takes 3"),
    (["optimizer.betas=[0.9]"], "optimizer.betas=[0.9] has 1 item(s) but takes 2"),
    (["augment.scale=[0.5]"], "augment.scale=[0.5] has 1 item(s) but takes 2"),
    (["augment.interpolation=foo"], "augment.interpolation=foo is not a resize filter"),
    (["augment.interpolation=random"], "augment.interpolation=random is not a resize filter"),
    # values that allocate or loop: an upper bound (config/ranges.py)
    (["resolution.crop_pct=1e-6"], "resolution.crop_pct=1e-06 must be in [0.25, 1]"),
    (["resolution.eval_size=200000"], "resolution.eval_size=200000 must be in [1, 2048]"),
    (["distill=soft", "distill.teacher.sizes=[200000]"], "distill.teacher.sizes=[200000] must be in [1, 2048]"),
    (["augment.auto_augment=rand-m9-n1000000"], "augment.auto_augment=rand-m9-n1000000: 'n' in section 'n1000000' "
                                                "must be in [0, 16]"),
    (["augment.auto_augment=augmix-w100"], "augment.auto_augment=augmix-w100: 'w' in section 'w100' must be in [1, "),
]


def _build(cfg) -> None:
    """check_build on the groups of the config `cfg`'s stage runs."""
    from deit_ablate.config.stage_config import stage_config
    from deit_ablate.run.build_check import BUILT_GROUPS, check_build

    staged = stage_config(cfg)
    check_build(*(staged[group] for group in BUILT_GROUPS))


def _launch(overrides: list[str], tmp_path) -> None:
    validate_launch(compose_config([*overrides, f"runtime.output_root={tmp_path / 'out'}",
                                    "runtime.tracking.mode=disabled"]))


@pytest.mark.parametrize(("overrides", "expected"), REFUSED, ids=[case[0][-1] for case in REFUSED])
def test_a_value_timm_or_torch_refuses_mid_run_is_refused_at_launch(tmp_path, overrides, expected):
    with pytest.raises(ConfigError) as error:
        _launch(overrides, tmp_path)
    message = str(error.value)
    assert message.startswith(expected) and "\n" not in message, message


@pytest.mark.parametrize("overrides", [[], ["preset=paper", "data=imagefolder"], ["augment=three_augment"],
                                       ["mix.mode=elem"], ["optimizer=sgd"], ["optimizer=lamb"],
                                       ["augment.auto_augment=augmix-m3-w4"],
                                       ["resolution.crop_pct=0.25"], ["augment.interpolation=bilinear"]])
def test_the_presets_and_valid_values_build(tmp_path, overrides):
    _launch([*overrides, *(one_class_imagefolder(tmp_path / "data") if "preset=paper" in overrides else [])], tmp_path)


@pytest.mark.parametrize("kind", ["soft", "hard_token"])
def test_a_distilling_stage_builds_its_loss(kind):
    _build(compose_config([f"distill={kind}", "model=deit_tiny_distilled"]))


def test_every_fixed_length_key_of_the_schema_is_counted():
    from deit_ablate.run.build_check import check_arities, schema_arities

    arities = dict(schema_arities())
    assert arities == {"data.mean": 3, "data.std": 3, "augment.scale": 2, "optimizer.betas": 2}
    for key, count in arities.items():
        with pytest.raises(ConfigError, match=f"^{key}=.* has {count + 1} item"):
            cfg = compose_config([f"{key}=[{','.join(['0.5'] * (count + 1))}]"])
            check_arities({group: cfg[group] for group in ("data", "augment", "optimizer")})


def test_the_check_leaves_the_global_random_generators_where_they_were():
    cfg = compose_config(["augment.auto_augment=augmix-m2-w2", "resolution.crop_pct=0.9"])
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    _build(cfg)
    drawn = random.random(), np.random.rand(), torch.rand(1).item()
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    assert drawn == (random.random(), np.random.rand(), torch.rand(1).item())


def _looping_imagefolder(root) -> list[str]:
    """A two-class ImageFolder whose second class folder in train/ is a symlink to itself."""
    overrides = one_class_imagefolder(root)
    os.symlink("b", root / "train" / "b")
    return overrides


def test_a_class_folder_that_is_a_symlink_loop_is_one_line(tmp_path):
    overrides = _looping_imagefolder(tmp_path / "data")
    with pytest.raises(ConfigError, match=r"^data.root: .*train/b cannot be read \(Too many levels of symbolic links"):
        _launch(["data=imagefolder", *overrides], tmp_path)


@pytest.mark.parametrize("dry_run", [False, True])
def test_train_py_refuses_it_before_a_run_folder_exists(tmp_path, data_cache, dry_run):
    """A value timm refuses (the launch) and a symlink loop among the class folders (the launch and the dry run)."""
    overrides = (_looping_imagefolder(tmp_path / "data") + ["data=imagefolder", "data.num_classes=2"] if dry_run
                 else ["data.std=[0.2,0.2]"])
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    proc = run_train([*TINY, *overrides, f"runtime.dry_run={str(dry_run).lower()}"], run_dir, data_cache, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    expected = "error: data.root: " if dry_run else "error: data.std=[0.2, 0.2] has 2 item(s)"
    assert lines[0].startswith(expected), proc.stderr
    assert list(run_dir.iterdir()) == []

"""Bad input and faults, one case each (issue 14): a clear message or a recovery, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from deit_ablate.errors import ConfigError
from deit_ablate.validate import validate_config
from tests.conftest import TINY, compose_config, run_train


def _no_run_left(cwd: Path, output_root: str = "outputs") -> bool:
    """No run folder and no wandb run under `output_root`: nothing was written for the run."""
    return not list((cwd / output_root).glob("runs/*")) and not list((cwd / output_root).glob("wandb/*run-*"))


@pytest.mark.parametrize(("override", "expected"), [
    ("optimizer.lr=-1", "optimizer.lr=-1.0 must be > 0"),
    ("optimizer.lr=0", "optimizer.lr=0.0 must be > 0"),
    ("train.eval_batch=0", "train.eval_batch=0 must be >= 1"),
    ("data.num_workers=-1", "data.num_workers=-1 must be >= 0"),
    ("train.epochs=0", "train.epochs=0 must be >= 1"),
    ("train.epochs=-3", "train.epochs=-3 must be >= 1"),
    ("finetune.epochs=0", "finetune.epochs=0 must be >= 1"),
    ("train.max_steps=0", "train.max_steps=0 must be >= 1"),
    ("tracking.project=../..", "tracking.project=../.. is not a safe name"),
    ("tracking.project=a/b", "tracking.project=a/b is not a safe name"),
    ("augment.auto_augment=rand-m9-mstd0.5-inc", "section 'inc' has no valid value for 'inc'"),
    ("augment.auto_augment=rand-m9-mstd0.5-inc2", "section 'inc2' has no valid value"),
    ("augment.auto_augment=rand-x9", "section 'x9' is not one of"),
    ("augment.auto_augment=rand-m9-tweight", "section 'tweight' names no transform set"),
    ("augment.auto_augment=randaugment", "'randaugment' is not a policy kind"),
    ("augment.auto_augment=original-m9", "section 'm9' is not one of mstd"),
])
def test_out_of_range_values_are_refused_naming_the_key(override, expected):
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config([override]))
    assert expected in str(error.value)


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5-inc1", "rand-m9-n3-mstd0.5", "rand-mstd1-tweights",
                                    "original", "v0r-mstd0.5", "3a", "augmix-m5-w4-d2", None])
def test_timm_policy_strings_pass(policy):
    validate_config(compose_config([f"augment.auto_augment={policy if policy else 'null'}"]))


def test_malformed_policy_names_the_expected_form_before_anything_is_written(tmp_path, data_cache):
    proc = run_train(TINY + ["augment.auto_augment=rand-m9-mstd0.5-inc"], tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "rand-m<magnitude>" in error_lines[0] and "rand-m9-mstd0.5-inc1" in error_lines[0]
    assert _no_run_left(tmp_path)


@pytest.mark.parametrize("override", ["optimizer.lr=-1", "tracking.project=../.."])
def test_bad_values_exit_2_with_one_line_and_leave_nothing(tmp_path, data_cache, override):
    proc = run_train(TINY + [override], tmp_path, data_cache, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        next(line for line in proc.stderr.splitlines() if line.startswith("error:"))]
    assert _no_run_left(tmp_path)


@pytest.mark.parametrize("layout", ["no_class_folders", "empty_class_folder"])
def test_imagefolder_without_images_is_the_clear_data_root_error(tmp_path, data_cache, layout):
    root = tmp_path / "data"
    for split in ("train", "val"):
        (root / split).mkdir(parents=True)
    if layout == "empty_class_folder":
        for split in ("train", "val"):
            (root / split / "cat").mkdir()
    proc = run_train(["data=imagefolder", f"data.root={root}", "data.num_classes=1"] + TINY, tmp_path, data_cache,
                     check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{root / 'train'} is not an ImageFolder split" in proc.stderr
    assert ("holds no class folder" if layout == "no_class_folders" else "class folder(s) cat hold no image") \
        in proc.stderr
    assert _no_run_left(tmp_path)

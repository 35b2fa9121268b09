"""Every numeric key of the schema has a valid range, declared on its field and checked before anything is written."""

from __future__ import annotations

import types
import typing
from dataclasses import fields, is_dataclass

import pytest
from conftest import TINY, compose_config, run_train

from deit_ablate.config.schema import Config, schema_ranges
from deit_ablate.core.errors import ConfigError
from deit_ablate.run.validate import check_ranges, validate_config

# Values that invert or empty the computation (issue 39, point 3): each the key, the value and the range it names.
INVERTING = [
    (["optimizer.clip_grad=-1"], "optimizer.clip_grad=-1.0 must be > 0"),
    (["resolution.train_size=0"], "resolution.train_size=0 must be in [1, 2048]"),
    (["optimizer.betas=[2, 0.999]"], "optimizer.betas=[2.0, 0.999] must be in [0, 1) each (2.0 is not)"),
    (["optimizer=sgd", "optimizer.momentum=-5"], "optimizer.momentum=-5.0 must be in [0, 1)"),
]


def _numeric(kind: typing.Any) -> bool:
    """Whether a field's type holds a number (int or float, optional, or a tuple or list of them), not a bool."""
    if kind in (int, float):
        return True
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType, tuple, list):
        return any(_numeric(arg) for arg in args if arg is not type(None))
    return False


def _numeric_keys(node: type = Config, prefix: str = "") -> list[str]:
    hints = typing.get_type_hints(node)
    keys = []
    for item in fields(node):
        kind = hints[item.name]
        keys += _numeric_keys(kind, f"{prefix}{item.name}.") if is_dataclass(kind) else (
            [prefix + item.name] if _numeric(kind) else [])
    return keys


def test_every_numeric_key_of_the_schema_declares_its_range():
    keys = _numeric_keys()
    assert len(keys) > 70 and "optimizer.betas" in keys and "runtime.cpu_threads" in keys
    assert sorted(keys) == sorted(key for key, _ in schema_ranges())


@pytest.mark.parametrize(("overrides", "expected"), INVERTING)
def test_a_value_that_inverts_or_empties_the_run_is_one_line(overrides, expected):
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(overrides))
    message = str(error.value)
    assert message.startswith(expected) and "\n" not in message


def test_the_defaults_and_the_bounds_themselves_pass():
    check_ranges(compose_config([]))
    check_ranges(compose_config(["optimizer.clip_grad=null", "optimizer=sgd", "optimizer.momentum=0",
                                 "optimizer.betas=[0, 0.5]", "resolution.crop_pct=1", "runtime.worker_nice=0",
                                 "mix.label_smoothing=0", "model.drop_path=1", "runtime.num_workers=0"]))


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_number_that_is_not_finite_is_refused(value):
    with pytest.raises(ConfigError, match=f"optimizer.lr={value} must be a finite number > 0"):
        check_ranges(compose_config([f"optimizer.lr={value}"]))


@pytest.mark.parametrize(("overrides", "expected"), [
    pytest.param(*INVERTING[0], id="clip_grad"),
    *(pytest.param(*case, id=case[0][-1].split("=")[0], marks=pytest.mark.slow) for case in INVERTING[1:]),
])
def test_train_py_refuses_it_before_a_run_folder_exists(tmp_path, data_cache, overrides, expected):
    proc = run_train(TINY + overrides, tmp_path, data_cache, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {expected}"), proc.stderr
    assert list(tmp_path.iterdir()) == []  # no outputs/, no runs/, no wandb/

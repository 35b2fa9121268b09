"""A schema key added without the steps that keep every earlier run's identity fails here, with the step to take
(docs/adding-a-study.md, "Adding a config key"): its ADDED_KEYS entry, a name in the docs. Its range is
tests/test_ranges.py's; a key the recipe leaves unread is tests/test_unread_settings.py's."""

from __future__ import annotations

import json
import re
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from deit_ablate.config.keys import ADDED_KEYS, is_execution_key, schema_default
from deit_ablate.config.ranges import fraction
from deit_ablate.config.schema import AugmentConfig, Config

REPO = Path(__file__).resolve().parents[1]
# The keys every run's identity has held from the start: recorded once, never edited (new keys go to ADDED_KEYS).
RECORDED = tuple(json.loads((REPO / "tests" / "data" / "identity_keys.json").read_text())["keys"])
ROUTE = "docs/adding-a-study.md, 'Adding a config key'"


def schema_keys(node: type = Config, prefix: str = "") -> list[str]:
    """Every leaf key of the schema, dotted (a mapping such as `model.kwargs` is one leaf), in the schema's order."""
    hints = typing.get_type_hints(node)
    keys: list[str] = []
    for item in fields(node):
        kind = hints[item.name]
        keys += schema_keys(kind, f"{prefix}{item.name}.") if is_dataclass(kind) else [prefix + item.name]
    return keys


def _default(node: type, dotted: str) -> Any:
    """The default of a dotted key in the schema `node` (a dataclass), as plain data."""
    value: Any = node()
    for key in dotted.split("."):
        value = getattr(value, key)
    return getattr(value, "value", value)


def unkept_keys(node: type = Config, added: dict[str, object] = ADDED_KEYS) -> dict[str, str]:
    """`{key: what to do}` for each schema key that would change every earlier run's identity: in neither the
    record of the keys the identity always held, nor `added`, nor the execution keys."""
    return {key: (f"{key} is a new schema key, so every run's identity would hold its default and every earlier run "
                  f"would get another folder and wandb id: add `\"{key}\": {_default(node, key)!r},` (the value "
                  "that computes as before; here its schema default) to ADDED_KEYS in deit_ablate/config/keys.py, "
                  f"or, if it never changes what a run computes, put it under runtime.* ({ROUTE})")
            for key in schema_keys(node) if key not in RECORDED and key not in added and not is_execution_key(key)}


def test_every_schema_key_keeps_earlier_runs_identities():
    missing = unkept_keys()
    assert not missing, "\n".join(missing.values())


@dataclass
class _AugmentWithSolarize(AugmentConfig):
    """A contributor's new augmentation key, without its ADDED_KEYS entry."""

    solarize: float = fraction(0.0)


@dataclass
class _Extended(Config):
    augment: _AugmentWithSolarize = field(default_factory=_AugmentWithSolarize)


def test_a_key_added_without_its_entry_is_named_with_the_fix():
    missing = unkept_keys(_Extended)
    assert list(missing) == ["augment.solarize"]
    assert '`"augment.solarize": 0.0,`' in missing["augment.solarize"] and ROUTE in missing["augment.solarize"]
    assert unkept_keys(_Extended, {**ADDED_KEYS, "augment.solarize": 0.0}) == {}


def test_no_key_the_identity_always_held_has_left_the_schema():
    gone = [key for key in RECORDED if key not in schema_keys()]
    assert not gone, (f"{gone}: every run's identity holds these keys, so removing one gives every earlier run "
                      "another folder and wandb id; keep the key, or put it back into the identity as "
                      "deit_ablate/config/keys.py's LEGACY_CHOICE_KEYS does (tests/test_study_identities.py checks)")


def test_every_added_key_names_a_key_of_the_schema():
    keys = schema_keys()
    for key in ADDED_KEYS:  # a key of a mapping leaf (`model.kwargs.<name>`) too
        assert any(key == k or key.startswith(k + ".") and isinstance(schema_default(k), dict) for k in keys), (
            f"ADDED_KEYS names {key}, which the schema lacks: a misspelt entry keeps no run's identity")


def test_every_schema_key_is_named_in_the_docs():
    text = "\n".join(page.read_text(encoding="utf-8") for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")])
    named = set(re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)*)", text))
    unnamed = [key for key in schema_keys() if key not in named]
    assert not unnamed, f"{unnamed}: name each key (`group.key`) where docs/runs.md lists its group's keys ({ROUTE})"

"""Whether a run's logged config has the shape this code logs: each group of the config schema a mapping, each text
key a text (or none), and the records the trainer adds beside them (`choices`, `data_fingerprint`) of theirs. A log
whose config has another shape (a list where `distill` is, a number where `model.name` is) is damaged: its run is
skipped with one warning line, instead of a TypeError deep in the table."""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any

TEXT, MAPPING = "a text", "a mapping"
ADDED = {"run_id": TEXT, "run_name": TEXT, "experiment_digest": TEXT, "git_commit": TEXT, "choices": MAPPING,
         "data_fingerprint": MAPPING, "data_fingerprint.digest": TEXT}  # record/tracking.py logs these too


def _kind(hint: Any) -> str | None:
    """TEXT, MAPPING or None (anything) for a schema type hint; `X | None` as X."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        kinds = {_kind(arg) for arg in typing.get_args(hint) if arg is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    if hint is str or (isinstance(hint, type) and issubclass(hint, Enum)):
        return TEXT
    return MAPPING if hint is dict or typing.get_origin(hint) is dict or is_dataclass(hint) else None


def _shapes(node: type, prefix: str = "") -> dict[str, str]:
    hints = typing.get_type_hints(node)
    found: dict[str, str] = {}
    for item in fields(node):
        kind = _kind(hints[item.name])
        if kind is not None:
            found[prefix + item.name] = kind
        if is_dataclass(hints[item.name]):
            found |= _shapes(hints[item.name], f"{prefix}{item.name}.")
    return found


@functools.cache
def shapes() -> dict[str, str]:
    """Dotted key -> TEXT or MAPPING, for every key of the schema (and the trainer's records) with such a type."""
    from deit_ablate.config.schema import Config

    return _shapes(Config) | ADDED


def shape_problem(config: dict[str, Any]) -> str | None:
    """What in `config` (a run's logged config) has another shape than this code logs, or None."""
    wanted = shapes()
    stack: list[tuple[str, dict[str, Any]]] = [("", config)]
    while stack:
        prefix, node = stack.pop()
        for key, value in node.items():
            dotted = prefix + str(key)
            kind = wanted.get(dotted)
            if value is None or kind is None:
                continue
            if kind == MAPPING and not isinstance(value, dict):
                return f"its config key {dotted} is a {type(value).__name__}, not {MAPPING}"
            if kind == TEXT and not isinstance(value, str):
                return f"its config key {dotted} is a {type(value).__name__}, not {TEXT}"
            if kind == MAPPING:
                stack.append((dotted + ".", value))
    return None

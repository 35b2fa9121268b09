"""The JSON values inside a wandb log's records, parsed within bounds: a value nested too deep or too long makes the
log a DamagedLog (its run skipped with one warning line) instead of a RecursionError or a MemoryError; an integer too
long for a float (10**5000) is read as a float (inf), as the aggregator's numbers are."""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64  # a run's config nests a few levels (model.kwargs.depth); a summary value, one or two
MAX_VALUE_BYTES = 1 << 20  # one config, summary or history value: this project logs numbers and short texts
MAX_INT_DIGITS = 100  # longer integers are read as floats: every one this project logs fits a float


class DamagedLog(ValueError):
    """A run log whose records cannot be read as a run; the message says what is wrong, for its one warning line."""


def _parse_int(text: str) -> int | float:
    return int(text) if len(text) <= MAX_INT_DIGITS else float(text)


_DECODER = json.JSONDecoder(parse_int=_parse_int)


def depth(value: Any) -> int:
    """How deep lists and mappings nest in `value` (a plain value: 0), counted without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        value, level = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            deepest = max(deepest, level + 1)
            stack += [(item, level + 1) for item in value]
    return deepest


def loads(text: str) -> Any:
    """A record's JSON value (a text that is no JSON: the text itself, None for none); a DamagedLog when it is longer
    than MAX_VALUE_BYTES or nests deeper than MAX_DEPTH."""
    if not text:
        return None
    if len(text) > MAX_VALUE_BYTES:
        raise DamagedLog(f"a value of {len(text)} bytes, above the {MAX_VALUE_BYTES >> 20} MB a value is read to")
    deep = DamagedLog(f"a value nested deeper than {MAX_DEPTH} levels")
    try:
        value = _DECODER.decode(text)
    except RecursionError:  # json's parser recurses (and stops at Python's limit)
        raise deep from None
    except ValueError:
        return text
    if text.count("[") + text.count("{") > MAX_DEPTH and depth(value) > MAX_DEPTH:  # the count: a cheap bound first
        raise deep
    return value


def key_path(path: tuple[str, ...]) -> tuple[str, ...]:
    """A record item's key path, checked: a DamagedLog when it nests deeper than MAX_DEPTH."""
    if len(path) > MAX_DEPTH:
        raise DamagedLog(f"a key nested {len(path)} levels deep, deeper than {MAX_DEPTH}")
    return path

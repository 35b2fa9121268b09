"""The names the runs hold (config and summary keys) and the close ones to suggest for a misspelled name."""

from __future__ import annotations

import difflib

from .reader import RunInfo
from .settings import flatten


def _initials(key: str) -> str:
    *parents, leaf = key.split(".")
    return ".".join([*parents, "".join(part[:1] for part in leaf.split("_"))])


def suggest(word: str, known: set[str]) -> str:
    """`; did you mean ...?` with the close matches (and keys abbreviated by initials: `optimizer.wd`)."""
    close = [k for k in sorted(known) if "_" in k.split(".")[-1] and _initials(k) == word]
    close += [k for k in difflib.get_close_matches(word, sorted(known), n=3, cutoff=0.6) if k not in close]
    return f"; did you mean {' or '.join(close[:3])}?" if close else ""


def config_keys(runs: list[RunInfo]) -> set[str]:
    """Every dotted config key (and parent key) of these runs."""
    keys: set[str] = set()
    for run in runs:
        for key in flatten(run.config):
            parts = key.split(".")
            keys.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return keys


def summary_keys(runs: list[RunInfo]) -> set[str]:
    """Every (dotted) summary key of these runs."""
    return {k for run in runs for k in flatten(run.summary) if not k.startswith("_")}

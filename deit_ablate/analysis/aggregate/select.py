"""Choosing runs: config-key lookup, filters (local and as a W&B API query), and de-duplication by run id."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from fnmatch import fnmatchcase
from typing import Any

from .reader import RunInfo

MISSING = object()
STATUS_RANK = {"finished": 3, "diverged": 2, "failed": 1, "unfinished": 0}

# Short names for --rows; a tuple of several keys makes one row per combination of their values. A study's rows
# are its chosen options (Hydra's choices), logs without choices fall back to the key (Table 8's `ablation`).
ROW_ALIASES: dict[str, tuple[str, ...]] = {
    "ablation": ("ablation",),
    "distill": ("distill.type",),
    "resolution": ("resolution.train_size",),
    "model": ("model.name",),
    "data": ("data.name",),
    "mix": ("mix.mixup_alpha", "mix.cutmix_alpha"),
    "augment": ("augment.auto_augment",),
    "optimizer": ("optimizer.name",),
    "preset": ("preset",),
    "seed": ("seed",),
}
# --rows values that name a config group: rows are its chosen options (`mix`: none, mixup_only, ...); runs
# logged before the choices were fall back to the alias keys. Any other group in the runs' choices works too.
CHOICE_ROWS = ("mix", "augment", "optimizer", "model", "data")
# Aliases that stay plain config keys: the paper tables are keyed by their values.
PLAIN_ROWS = ("distill", "resolution", "preset", "seed")


def row_keys(rows: str) -> tuple[str, ...]:
    """The dotted config keys behind a --rows value: an alias, one dotted key, or keys joined by commas."""
    if rows in ROW_ALIASES:
        return ROW_ALIASES[rows]
    return tuple(k.strip() for k in rows.split(",") if k.strip())


def get_key(config: dict[str, Any], dotted: str) -> Any:
    """A nested config value by dotted key (`model.name`), also found when stored flat; else MISSING."""
    if dotted in config:
        return config[dotted]
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def format_value(value: Any) -> str:
    """A config value as a row label: ints plain, floats short, None/MISSING as `(unset)`."""
    if value is MISSING or value is None:
        return "(unset)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return format(value, "g")
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return str(value)


def matches(value: Any, pattern: str) -> bool:
    """Whether a config value equals a command-line string (shell-style wildcards allowed)."""
    if value is MISSING:
        return False
    text = format_value(value)
    if fnmatchcase(text, pattern) or fnmatchcase(str(value), pattern):
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(pattern) == float(value)
        except ValueError:
            return False
    return False


def parse_when(text: str, end: bool = False) -> datetime:
    """An ISO date or date-time; naive means local time; a bare date as an upper bound includes that day."""
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if end and len(text.strip()) <= 10:
        when += timedelta(days=1)
    return when if when.tzinfo else when.astimezone()


@dataclass
class RunFilter:
    """Which runs count: all given conditions must hold (several --group values: any of them)."""

    groups: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    where: list[tuple[str, str]] = field(default_factory=list)  # (dotted key, pattern)
    since: datetime | None = None
    until: datetime | None = None  # exclusive

    def matches(self, run: RunInfo) -> bool:
        """Whether one run passes every condition."""
        if self.groups and not any(fnmatchcase(run.group or "", g) for g in self.groups):
            return False
        if any(tag not in run.tags for tag in self.tags):
            return False
        if any(not matches(get_key(run.config, key), pattern) for key, pattern in self.where):
            return False
        if self.since or self.until:
            if run.start_time is None:
                return False
            if self.since and run.start_time < self.since:
                return False
            if self.until and run.start_time >= self.until:
                return False
        return True

    def api_filters(self) -> dict[str, Any]:
        """The subset of conditions the W&B server can apply (MongoDB-style); the rest is applied locally."""
        parts: list[dict[str, Any]] = []
        plain_groups = [g for g in self.groups if not any(c in g for c in "*?[")]
        if plain_groups and len(plain_groups) == len(self.groups):
            parts.append({"group": {"$in": plain_groups}})
        parts.extend({"tags": {"$in": [tag]}} for tag in self.tags)
        for key, pattern in self.where:
            if "." not in key and not any(c in pattern for c in "*?["):
                parts.append({f"config.{key}": _typed(pattern)})
        if self.since:
            parts.append({"createdAt": {"$gte": _utc_iso(self.since)}})
        if self.until:
            parts.append({"createdAt": {"$lt": _utc_iso(self.until)}})
        if not parts:
            return {}
        return parts[0] if len(parts) == 1 else {"$and": parts}


def _typed(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: brackets nested too deep for json's parser
        return text


def _utc_iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def dedup(runs: list[RunInfo]) -> tuple[list[RunInfo], list[RunInfo]]:
    """One run per id: finished > diverged > failed > unfinished, the latest among equals; also the dropped."""
    best: dict[str, RunInfo] = {}
    dropped: list[RunInfo] = []

    def rank(run: RunInfo) -> tuple[Any, ...]:
        started = run.start_time.timestamp() if run.start_time else float("-inf")
        return (STATUS_RANK[run.status], started, run.source)

    for run in runs:
        kept = best.get(run.run_id)
        if kept is None:
            best[run.run_id] = run
        elif rank(run) > rank(kept):
            best[run.run_id] = run
            dropped.append(kept)
        else:
            dropped.append(run)
    return list(best.values()), dropped

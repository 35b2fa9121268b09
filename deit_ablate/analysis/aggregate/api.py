"""Runs read through the W&B API (`wandb://ENTITY/PROJECT`), as `RunInfo` like the offline logs."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from .reader import API_PREFIX, RunInfo


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _summary_dict(summary: Any) -> dict[str, Any]:
    if summary is None:
        return {}
    if isinstance(summary, Mapping):
        return _plain(summary)
    return {k: _plain(summary.get(k)) for k in summary.keys()}


def _parse_time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if not value:
        return None
    text = str(value).replace("Z", "+00:00")
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)


def _api_commit(run: Any) -> str:
    try:  # a public-API Run answers attribute reads from its GraphQL fields; a stand-in may have none
        return str(getattr(run, "commit", "") or "")
    except Exception:
        return ""


def api_run_info(run: Any, path: str) -> RunInfo:
    """Convert one `wandb.apis.public.Run` (or anything with its attributes) into a `RunInfo`."""
    summary = _summary_dict(getattr(run, "summary", None))
    return RunInfo(
        run_id=str(run.id),
        name=str(getattr(run, "name", "") or ""),
        project=path.split("/")[-1],
        entity=path.split("/")[0] if "/" in path else "",
        group=str(getattr(run, "group", "") or ""),
        tags=tuple(getattr(run, "tags", None) or ()),
        config={k: _plain(v) for k, v in dict(getattr(run, "config", None) or {}).items() if k != "_wandb"},
        summary=summary,
        start_time=_parse_time(getattr(run, "created_at", None)),
        source=f"{API_PREFIX}{path}/{run.id}",
        last_history={},
        handle=run,
        commit=_api_commit(run),
    )


def read_api(path: str, filters: dict[str, Any] | None = None, api: Any = None) -> list[RunInfo]:
    """Read runs of `ENTITY/PROJECT` through `wandb.Api().runs(path, filters=...)`."""
    if api is None:
        import wandb

        api = wandb.Api()
    runs = api.runs(path, filters=filters or None, per_page=500, lazy=False)
    return [api_run_info(run, path) for run in runs]

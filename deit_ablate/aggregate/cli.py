"""`deit-aggregate` / `scripts/aggregate.py`: rebuild Table 8 (or another grouping) from wandb runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .paper import table_names
from .reader import API_PREFIX, RunInfo, Warn, is_api_source, read_api, read_offline, stderr_warn
from .render import FORMATS, render
from .select import ROW_ALIASES, RunFilter, dedup, parse_when
from .table import METRICS, Table, build_table

EPILOG = f"""\
sources: a wandb folder (outputs/wandb), the folder holding it (outputs), one run folder or
run-*.wandb file, or {API_PREFIX}ENTITY/PROJECT for the W&B API. Several sources are merged.
--rows aliases: {", ".join(f"{k} ({'+'.join(v)})" for k, v in ROW_ALIASES.items())}.
--metric: {", ".join(f"{k} ({v})" for k, v in METRICS.items())}; any other value is a summary key.
"""


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    p = argparse.ArgumentParser(
        prog="deit-aggregate",
        description="Aggregate wandb runs into the DeiT ablation table (Table 8), with the paper's numbers.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("sources", nargs="+", help="offline wandb folder(s) or wandb://ENTITY/PROJECT")
    p.add_argument("--format", choices=FORMATS, default="markdown", help="output format (default markdown)")
    p.add_argument("--out", type=Path, help="write the table to this file instead of stdout")
    p.add_argument("--plot", type=Path, help="also draw the Δ-to-baseline bar chart into this PNG")
    p.add_argument("--rows", default="ablation", help="config key (dotted) or alias to group rows by")
    p.add_argument("--metric", default="top1", help="which summary top-1: " + ", ".join(METRICS))
    p.add_argument("--baseline", help="row that Δ is measured against (default: the paper table's baseline)")
    p.add_argument("--paper", default="auto", help=f"paper table beside ours: auto, none, {', '.join(table_names())}")
    p.add_argument("--group", action="append", default=[], help="wandb group (repeat: any of them)")
    p.add_argument("--tag", action="append", default=[], help="wandb tag the run must have (repeat: all)")
    p.add_argument("--preset", help="config preset (demo, paper)")
    p.add_argument("--model", help="config model.name (wildcards allowed)")
    p.add_argument("--data", help="config data.name")
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE", help="any config key")
    p.add_argument("--since", help="runs started on/after this date or ISO time (local time if naive)")
    p.add_argument("--until", help="runs started before this time; a bare date includes that day")
    p.add_argument("--digits", type=int, default=2, help="decimals for our numbers (default 2)")
    p.add_argument("--list-runs", action="store_true", help="print the runs each cell counts, not the table")
    p.add_argument("--jobs", type=int, help="processes that read log files (default: up to 4)")
    p.add_argument("-q", "--quiet", action="store_true", help="no warnings or run counts on stderr")
    return p


def make_filter(args: argparse.Namespace) -> RunFilter:
    """The run filter from the command-line options."""
    where = []
    for item in args.where:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--where takes KEY=VALUE, got {item!r}")
        where.append((key.strip(), value.strip()))
    for key, value in (("preset", args.preset), ("model.name", args.model), ("data.name", args.data)):
        if value is not None:
            where.append((key, value))
    return RunFilter(
        groups=list(args.group),
        tags=list(args.tag),
        where=where,
        since=parse_when(args.since) if args.since else None,
        until=parse_when(args.until, end=True) if args.until else None,
    )


def collect_runs(sources: list[str], run_filter: RunFilter, jobs: int | None, warn: Warn) -> list[RunInfo]:
    """Every run from every source (the API gets the filter as a server-side query too)."""
    runs: list[RunInfo] = []
    for source in sources:
        if is_api_source(source):
            path = source[len(API_PREFIX) :].strip("/")
            if path.count("/") != 1:
                raise ValueError(f"{source}: expected {API_PREFIX}ENTITY/PROJECT")
            try:
                runs += read_api(path, run_filter.api_filters())
            except Exception as exc:  # no network, no login, unknown project: say so in one line
                raise RuntimeError(f"{source}: the W&B API failed: {exc}") from exc
        else:
            found = read_offline(source, jobs=jobs, warn=warn)
            if not found:
                warn(f"{source}: no wandb runs found")
            runs += found
    return runs


def aggregate(args: argparse.Namespace, warn: Warn = stderr_warn) -> Table:
    """Read, filter, de-duplicate and tabulate, as the command line asks."""
    run_filter = make_filter(args)
    runs = collect_runs(args.sources, run_filter, args.jobs, warn)
    kept = [r for r in runs if run_filter.matches(r)]
    unique, dropped = dedup(kept)
    table = build_table(unique, rows=args.rows, metric=args.metric, baseline=args.baseline, paper=args.paper)
    if args.baseline is not None and table.row(args.baseline) is None:
        warn(f"--baseline {args.baseline!r} is not a row of this table; no differences computed")
    if table.other_stage:
        warn(f"{table.other_stage} run(s) with a stage other than pretrain/finetune left out")
    table.meta = {
        "sources": list(args.sources),
        "read": len(runs),
        "filtered_out": len(runs) - len(kept),
        "duplicates": len(dropped),
        "counted": len(table.counted),
        "dropped_duplicates": [{"run_id": r.run_id, "status": r.status, "source": r.source} for r in dropped],
        "partial_logs": [r.source for r in runs if r.problem],
    }
    return table


def list_runs(table: Table, digits: int) -> str:
    """A markdown list of the counted runs, row by row."""
    lines = [f"| {table.rows_key} | stage | seed | status | {table.metric_key} | run id | source |"]
    lines.append("|:--|:--|--:|:--|--:|:--|:--|")
    order = {row.key: i for i, row in enumerate(table.rows)}
    for label, stage, run, value in sorted(table.counted, key=lambda c: (order.get(c[0], 0), c[1], c[2].run_id)):
        shown = "" if value is None else f"{value:.{digits}f}"
        seed = run.config.get("seed", "")
        lines.append(f"| {label} | {stage} | {seed} | {run.status} | {shown} | {run.run_id} | {run.source} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the aggregator; returns the process exit status."""
    args = build_parser().parse_args(argv)
    warn: Warn = (lambda message: None) if args.quiet else stderr_warn
    try:
        table = aggregate(args, warn)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    text = list_runs(table, args.digits) if args.list_runs else render(table, args.format, args.digits)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    if args.plot:
        from .plot import plot_deltas

        plot_deltas(table, args.plot)
    if not args.quiet:
        meta = table.meta
        print(
            f"{meta['read']} run(s) read, {meta['filtered_out']} filtered out, "
            f"{meta['duplicates']} duplicate(s) dropped, {meta['counted']} counted"
            + (f"; table written to {args.out}" if args.out else "")
            + (f"; plot written to {args.plot}" if args.plot else ""),
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

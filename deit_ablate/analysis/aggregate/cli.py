"""`deit-aggregate` / `scripts/aggregate.py`: rebuild Table 8 (or another grouping) from wandb runs."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from deit_ablate.core.atomic import write_figure_atomic, write_text_atomic
from deit_ablate.core.errors import no_access
from deit_ablate.run.commands import command, number_option

from .api import read_api
from .cells import METRICS, Table
from .columns import delta_reference, split_text
from .names import config_keys, suggest, summary_keys
from .paper import STAGE_NAMES, paper_table, table_names
from .reader import API_PREFIX, RunInfo, Warn, is_api_source, read_offline, stderr_warn
from .render import FORMATS, render
from .select import MISSING, ROW_ALIASES, RunFilter, dedup, format_value, get_key, matches, parse_when
from .settings import choices_of
from .study_runs import StudyRuns, others_text, run_study, split_by_study, study_index
from .table import build_table, row_spec

ALL_FORMATS = (*FORMATS, "html")


class UsageError(ValueError):
    """A command-line value that names nothing in these runs (exit status 2)."""

EPILOG = f"""\
sources: a wandb folder (outputs/wandb), the folder holding it (outputs), one run folder or
run-*.wandb file, or {API_PREFIX}ENTITY/PROJECT for the W&B API. Several sources are merged.
--rows aliases: {", ".join(f"{k} ({'+'.join(v)})" for k, v in ROW_ALIASES.items())}.
--rows mix, augment, optimizer, model, data (or any config group): rows are the options chosen
(mix: none, mixup_only, ...); a dotted key: its values.
--metric: {", ".join(f"{k} ({v})" for k, v in METRICS.items())}; any other value is a summary key.
A cell holds only runs that differ in nothing but the seed (and execution settings); runs under one row
key that differ otherwise become sub-rows named by what differs (baseline · mix=none).
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
    p.add_argument("--format", choices=ALL_FORMATS, default="markdown", help="output format (default markdown)")
    p.add_argument("--out", type=Path, help="write the table to this file instead of stdout")
    p.add_argument("--plot", type=Path, help="also draw the Δ-to-baseline bar chart into this PNG")
    p.add_argument("--curves", type=Path, help="also draw validation top-1 by epoch per row into this PNG")
    p.add_argument("--rows", help="config key (dotted) or alias to group rows by (default: ablation, or the study "
                                  "the runs or --paper belong to, e.g. cait)")
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
    p.add_argument(
        "--only-present",
        action="store_true",
        help="hide rows and columns (stages) without runs (default with --paper none)",
    )
    p.add_argument(
        "--match-baseline",
        action="store_true",
        help="keep only each row's main setting (the baseline's other settings) instead of sub-rows",
    )
    p.add_argument("--digits", type=number_option(int, 0), default=2, help="decimals for our numbers (default 2)")
    p.add_argument("--list-runs", action="store_true", help="print the runs each cell counts, not the table")
    p.add_argument("--jobs", type=number_option(int, 1), help="processes that read log files (default: up to 4)")
    p.add_argument("-q", "--quiet", action="store_true", help="no warnings or run counts on stderr")
    return p


def where_options(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """The config-key conditions as (option as typed, dotted key, pattern)."""
    where = []
    for item in args.where:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--where takes KEY=VALUE, got {item!r}")
        where.append((f"--where {item}", key.strip(), value.strip()))
    for option, key, value in (("--preset", "preset", args.preset), ("--model", "model.name", args.model),
                               ("--data", "data.name", args.data)):
        if value is not None:
            where.append((f"{option} {value}", key, value))
    return where


def filters_text(args: argparse.Namespace) -> str:
    """The run filters as typed (`--preset demo --group table8`), for the outputs to name."""
    given = [option for option, _, _ in where_options(args)]
    given += [f"--group {g}" for g in args.group] + [f"--tag {t}" for t in args.tag]
    given += [f"--{name} {value}" for name, value in (("since", args.since), ("until", args.until)) if value]
    return " ".join(given) or "none (every run read)"


def options_text(args: argparse.Namespace) -> str:
    """How the table was shaped: rows, metric, paper, baseline and the flags given."""
    given = [f"--rows {args.rows}", f"--metric {args.metric}", f"--paper {args.paper}"]
    given += [f"--baseline {args.baseline}"] if args.baseline else []
    given += [f"--{flag}" for flag in ("match-baseline", "only-present") if getattr(args, flag.replace("-", "_"))]
    return " ".join(given)


def make_filter(args: argparse.Namespace) -> RunFilter:
    """The run filter from the command-line options."""
    where = [(key, value) for _, key, value in where_options(args)]
    return RunFilter(
        groups=list(args.group),
        tags=list(args.tag),
        where=where,
        since=parse_when(args.since) if args.since else None,
        until=parse_when(args.until, end=True) if args.until else None,
    )


def collect_runs(
    sources: list[str], run_filter: RunFilter, jobs: int | None, warn: Warn, history: bool = False
) -> list[RunInfo]:
    """Every run from every source (the API gets the filter as a server-side query too); `history`: with the
    per-epoch rows of offline logs (for curves)."""
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
            found = read_offline(source, jobs=jobs, warn=warn, history=history)
            if not found:
                warn(f"{source}: no wandb runs found")
            runs += found
    return runs


def check_names(args: argparse.Namespace, runs: list[RunInfo]) -> None:
    """--metric, --rows and --where must name something these runs have; else a UsageError with close ones."""
    if not runs:
        return
    keys = config_keys(runs)
    metric = args.metric
    if metric not in METRICS and metric not in summary_keys(runs):
        known = set(METRICS) | summary_keys(runs)
        raise UsageError(
            f"unknown --metric {metric!r}: neither a metric ({', '.join(METRICS)}) nor a summary key of any run"
            + suggest(metric, known)
        )
    groups = {g for run in runs for g in choices_of(run.config)}
    spec = row_spec(args.rows, groups)
    if spec.group is None or spec.group not in groups:
        missing = [k for k in spec.keys if k not in keys]
        if missing:
            known = keys | set(ROW_ALIASES) | groups
            if spec.group is not None:
                raise UsageError(
                    f"unknown --rows {args.rows!r}: no run logged a {spec.group!r} group choice, "
                    f"and none has {', '.join(missing)}" + suggest(args.rows, known)
                )
            raise UsageError(f"unknown --rows key {missing[0]!r}: no run has it" + suggest(missing[0], known))
    for option, key, _ in where_options(args):
        if key not in keys:
            raise UsageError(f"unknown key {key!r} in {option}: no run has it" + suggest(key, keys))


def explain_empty(args: argparse.Namespace, runs: list[RunInfo], run_filter: RunFilter) -> str:
    """Why no run passed the filters: the first condition that alone keeps none, with the values seen."""
    for option, key, pattern in where_options(args):
        if not any(matches(get_key(r.config, key), pattern) for r in runs):
            seen = {format_value(v) for r in runs if (v := get_key(r.config, key)) is not MISSING}
            shown = sorted(seen)[:10]
            values = ", ".join(shown) + (f", +{len(seen) - len(shown)} more" if len(seen) > len(shown) else "")
            return f"{option} matches none of the {len(runs)} run(s) read ({key}: {values})" + suggest(pattern, seen)
    for option, values, have in (("--group", args.group, {r.group for r in runs}),
                                 ("--tag", args.tag, {t for r in runs for t in r.tags})):
        for value in values:
            alone = RunFilter(groups=[value]) if option == "--group" else RunFilter(tags=[value])
            if not any(alone.matches(r) for r in runs):
                return f"{option} {value} matches none of the {len(runs)} run(s) read" + suggest(value, have)
    if args.since or args.until:
        alone = RunFilter(since=run_filter.since, until=run_filter.until)
        if not any(alone.matches(r) for r in runs):
            return f"--since/--until leave none of the {len(runs)} run(s) read"
    return f"the filters together leave none of the {len(runs)} run(s) read (each alone keeps some)"


def _report(table: Table, warn: Warn) -> None:
    for split in table.splits:
        warn(split_text(split))
    for row in table.rows:
        for stage in table.stages:
            same = row.cells[stage].same_seed
            if same:
                warn(
                    f"{row.key} ({STAGE_NAMES[stage]}): {len(same)} finished run(s) repeat a seed already counted "
                    f"({', '.join(same)}); the latest run of each seed counts, the others are not averaged"
                )
    if table.paper_note:
        warn(table.paper_note)


def default_rows(args: argparse.Namespace, runs: list[RunInfo]) -> str:
    """--rows when not given: the rows of the --paper table named, else the study every run belongs to (its recorded
    choices: `cait`, `deit3`), else the study with a default row (`ablation`: Table 8) where it has runs, else the
    study with most runs."""
    if args.paper not in (None, "auto", "none") and args.paper in table_names():
        return paper_table(args.paper).rows_key
    index = study_index()
    counts = Counter(run_study(run, index) for run in runs)
    if len(counts) == 1 or (counts and index.default not in counts):
        return counts.most_common(1)[0][0]
    return index.default


def aggregate(args: argparse.Namespace, warn: Warn = stderr_warn) -> Table:
    """Read, filter, de-duplicate and tabulate, as the command line asks."""
    run_filter = make_filter(args)
    curves = bool(args.curves) or args.format == "html"
    runs = collect_runs(args.sources, run_filter, args.jobs, warn, history=curves)
    kept = [r for r in runs if run_filter.matches(r)]
    if args.rows is None:
        args.rows = default_rows(args, kept)
    check_names(args, runs)
    if runs and not kept:
        raise UsageError("no run left: " + explain_empty(args, runs, run_filter))
    if not runs and run_filter.api_filters() and any(is_api_source(s) for s in args.sources):
        raise UsageError(f"no run left: the W&B API returned no run for the query {run_filter.api_filters()}")
    unique, dropped = dedup(kept)
    index = study_index()
    sorted_runs = split_by_study(unique, args.rows, index) if args.rows in index.tables else StudyRuns(own=unique)
    if sorted_runs.others:
        warn(f"{sum(sorted_runs.others.values())} run(s) that are not rows of the {args.rows} study left out")
    table = build_table(
        sorted_runs.own,
        rows=args.rows,
        metric=args.metric,
        baseline=args.baseline,
        paper=args.paper,
        match_baseline=args.match_baseline,
        only_present=args.only_present or args.paper == "none",
        scratch=sorted_runs.scratch,
    )
    if args.baseline is not None and table.row(args.baseline) is None:
        warn(f"--baseline {args.baseline!r} is not a row of this table; no differences computed")
    if table.other_stage:
        warn(f"{table.other_stage} run(s) with a stage other than pretrain/finetune left out")
    _report(table, warn)
    table.meta = {
        "sources": list(args.sources),
        "read": len(runs),
        "filtered_out": len(runs) - len(kept),
        "duplicates": len(dropped),
        "counted": len(table.counted),
        "same_seed": [rid for row in table.rows for c in row.cells.values() for rid in c.same_seed],
        "not_matching_baseline": [r.run_id for r in table.left_out],
        "dropped_duplicates": [{"run_id": r.run_id, "status": r.status, "source": r.source} for r in dropped],
        "partial_logs": [r.source for r in runs if r.problem],
        "filters": filters_text(args),
        "options": options_text(args),
        "other_studies": dict(sorted_runs.others),
        "also": others_text(sorted_runs.others, list(args.sources), index),
    }
    return table


def list_runs(table: Table, digits: int) -> str:
    """A markdown list of the counted runs, row by row."""
    lines = [f"| {table.rows_key} | stage | seed | status | {table.metric_key} | run id | source |"]
    lines.append("|:--|:--|--:|:--|--:|:--|:--|")
    order = {row.key: i for i, row in enumerate(table.rows)}
    entries = [(*c, c[2].status) for c in table.counted]
    entries += [(*c, "finished, same seed: not averaged") for c in table.repeated]
    for label, stage, run, value, status in sorted(entries, key=lambda c: (order.get(c[0], 0), c[1], c[2].run_id)):
        shown = "" if value is None else f"{value:.{digits}f}"
        seed = run.config.get("seed", "")
        lines.append(f"| {label} | {stage} | {seed} | {status} | {shown} | {run.run_id} | {run.source} |")
    return "\n".join(lines) + "\n"


def figures(table: Table, args: argparse.Namespace) -> dict[str, Any]:
    """The figures the command line asks for (Δ plot, curves), each drawn once."""
    wanted_plot = args.plot or (args.format == "html" and table.compared)
    wanted_curves = args.curves or args.format == "html"
    out: dict[str, Any] = {}
    if wanted_plot:
        from .plot import draw_deltas

        out["plot"] = draw_deltas(table)
    if wanted_curves:
        from .curves import plot_curves

        out["curves"] = plot_curves(table, None, args.jobs)
    return out


def output_text(table: Table, args: argparse.Namespace, figs: dict[str, Any]) -> str:
    """The table as asked: --list-runs, a text format, or the HTML page with the figures embedded."""
    if args.list_runs:
        return list_runs(table, args.digits)
    if args.format != "html":
        return render(table, args.format, args.digits)
    from .html import to_html
    from .plot import figure_png

    names = {"plot": f"Δ to {delta_reference(table)}", "curves": "Validation top-1 by epoch"}
    return to_html(table, args.digits, [(names[k], figure_png(fig)) for k, fig in figs.items()])


def write_outputs(table: Table, args: argparse.Namespace) -> list[str]:
    """Write the table and any plots; return what was written where."""
    figs = figures(table, args)
    text = output_text(table, args, figs)
    done = []
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.out, text)
        done.append(f"table written to {args.out}")
    else:
        sys.stdout.write(text)
    for name, path in (("plot", args.plot), ("curves", args.curves)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write_figure_atomic(path, figs[name])
            done.append(f"{name} written to {path}")
    return done


@command("deit-aggregate")
def main(argv: list[str] | None = None) -> int:
    """Run the aggregator; returns the process exit status."""
    args = build_parser().parse_args(argv)
    warn: Warn = (lambda message: None) if args.quiet else stderr_warn
    try:
        table = aggregate(args, warn)
    except PermissionError as exc:  # a folder or log of another user's that this one may not read
        print(f"error: {no_access(exc)}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    done = write_outputs(table, args)
    if not args.quiet:
        meta = table.meta
        extra = [f"{len(meta['same_seed'])} same-seed run(s) not averaged"] if meta["same_seed"] else []
        if meta["not_matching_baseline"]:
            extra.append(f"{len(meta['not_matching_baseline'])} not matching the baseline left out")
        print(
            f"{meta['read']} run(s) read, {meta['filtered_out']} filtered out, "
            f"{meta['duplicates']} duplicate(s) dropped, "
            + "".join(f"{e}, " for e in extra)
            + f"{meta['counted']} counted"
            + "".join(f"; {d}" for d in done),
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

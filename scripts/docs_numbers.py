"""Regenerate every number the docs present as measured from our own demo runs: run each page's demo commands (a run
already finished under --outputs is skipped, as any relaunch skips it), read the recorded runs through the
aggregator, write the figures to docs/measured.json and rewrite the page's generated sections, each stamped with
the commit its runs recorded and the command that regenerates it.

    python scripts/docs_numbers.py                           # every page: trains what is missing, then writes
    python scripts/docs_numbers.py --pages transfer,deit3    # some pages
    python scripts/docs_numbers.py --outputs DIR --no-train  # the figures of runs already trained under DIR
    python scripts/docs_numbers.py --render-only             # the pages again from docs/measured.json

A generated section lies between `<!-- measured:NAME -->` and `<!-- /measured -->`; tests/test_docs_numbers.py holds
the pages to what this script renders from docs/measured.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MEASURED = REPO / "docs" / "measured.json"
SECTION = re.compile(r"(<!-- measured:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /measured -->)", re.S)
THREADS = "runtime.cpu_threads=1"


@dataclass(frozen=True)
class Demo:
    """One demo run: what it is on the page and its overrides as a user types them (seed 0, the demo preset)."""

    label: str
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Page:
    """A page's demo: its runs, the commands that train them as the page shows them, and how its figures are read
    from the runs and rendered into its sections."""

    file: str
    demos: tuple[Demo, ...]
    commands: tuple[str, ...]
    measure: Callable[[dict[str, Any], list[Any]], dict[str, Any]]
    render: Callable[[dict[str, Any]], dict[str, str]]


def teacher_override(outputs: str) -> str:
    """The override that names the demo CNN teacher run under `outputs`."""
    return f"distill.teacher.checkpoint='{outputs}/runs/model=cnn_demo'"


# -- reading the runs --

def read_runs(outputs: Path) -> list[Any]:
    """Every finished run logged under `outputs`, one per run id, with its per-epoch rows."""
    from deit_ablate.analysis.aggregate import dedup, read_offline

    runs, _ = dedup(read_offline(outputs / "wandb", history=True, warn=lambda message: None))
    return [run for run in runs if run.status == "finished"]


def run_of(demo: Demo, runs: list[Any], outputs: Path) -> Any:
    """The finished run a demo's command trains: the one logged under the folder its identity names."""
    from deit_ablate.record.resolvers import run_dir_of

    overrides = [item.replace("{outputs}", str(outputs)) for item in demo.overrides]
    name = run_dir_of(overrides, outputs).name
    found = [run for run in runs if run.name == name]
    if not found:
        raise SystemExit(f"docs_numbers: no finished run of `python train.py {' '.join(overrides)}` under {outputs}")
    return max(found, key=lambda run: run.start_time.timestamp() if run.start_time else 0.0)


def stamp(runs: list[Any]) -> dict[str, Any]:
    """The commits the runs recorded and the day the last one started."""
    from deit_ablate.analysis.aggregate.about import run_commit

    commits = sorted({run_commit(run) or "not recorded" for run in runs})
    day = max(run.start_time for run in runs if run.start_time).date().isoformat()
    return {"commits": commits, "date": day}


def top1(run: Any) -> float:
    return round(float(run.summary["top1"]), 2)


def first_epoch_top1(run: Any) -> float:
    return round(float(run.history[0]["val/top1"]), 2)


# -- the transfer page --

TRANSFER_DEMOS = (
    Demo("the pre-training on `shapes`", ()),
    Demo("its fine-tune at 48 px (the transfer's source)", ("stage=finetune",)),
    Demo("the transfer to `shapes_b`", ("transfer=builtin_b",)),
    Demo("the transfer from the pre-training", ("transfer=builtin_b", "transfer.source_stage=pretrain")),
    Demo("from scratch on `shapes_b`", ("data.builtin.classes=shapes_b", "train.epochs=5")),
)


def measure_transfer(found: dict[str, Any], _: list[Any]) -> dict[str, Any]:
    """Each run's final top-1, and after the first epoch where the page compares the start."""
    rows = []
    for demo in TRANSFER_DEMOS:
        run = found[demo.label]
        epoch1 = first_epoch_top1(run) if demo.overrides and "stage=finetune" not in demo.overrides else None
        rows.append({"label": demo.label, "overrides": list(demo.overrides), "epoch1": epoch1, "top1": top1(run),
                     "seconds": round(float(run.summary["train_seconds"])), "run": run.name})
    return {"runs": rows}


def _overrides_text(overrides: list[str] | tuple[str, ...]) -> str:
    return f"`{' '.join(overrides)}`" if overrides else "(none)"


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def render_transfer(figures: dict[str, Any]) -> dict[str, str]:
    """The transfer page's measured table."""
    lines = ["| run | `python train.py ...` | top-1 after epoch 1 | top-1 at the end | training time |",
             "|---|---|--:|--:|--:|"]
    for row in figures["runs"]:
        command = _overrides_text(row["overrides"])
        lines.append(f"| {row['label']} | {command} | {_number(row['epoch1'])} | {_number(row['top1'])} | "
                     f"{row['seconds']} s |")
    return {"transfer": stamp_line(figures, "transfer") + "\n\n" + "\n".join(lines) + "\n"}


def stamp_line(figures: dict[str, Any], page: str) -> str:
    commits = ", ".join(commit[:10] for commit in figures["commits"])
    return (f"Measured at commit {commits} on {figures['date']}: seed 0, one run each, built-in data, one torch "
            f"thread\n(`python scripts/docs_numbers.py --pages {page}` runs the commands again and rewrites this).")


# -- the deit3 page --

DEIT3_DEMOS = (
    Demo("baseline", ("deit3=baseline",)),
    Demo("randaugment", ("deit3=randaugment",)),
    Demo("registers_4", ("deit3=registers_4",)),
    Demo("layer_decay_075", ("deit3=layer_decay_075", "stage=finetune")),
    Demo("teacher", ("model=cnn_demo",)),
    Demo("teach_fixed", ("deit3=teach_fixed", "distill.teacher.checkpoint='{outputs}/runs/model=cnn_demo'")),
    Demo("teach_function_matching", ("deit3=teach_function_matching",
                                     "distill.teacher.checkpoint='{outputs}/runs/model=cnn_demo'")),
)


def measure_deit3(found: dict[str, Any], _: list[Any]) -> dict[str, Any]:
    """The aggregator's deit3 table (--paper deit3, rows that ran), and each ViT run's high-norm token share."""
    from deit_ablate.analysis.aggregate import build_table

    rows_runs = [run for label, run in found.items() if label != "teacher"]
    table = build_table(rows_runs, rows="deit3", paper="deit3", only_present=True)
    rows = []
    for row in table.rows:
        if not row.has_runs:
            continue
        cells = {stage: {"ours": None if cell.mean is None else round(cell.mean, 2),
                         "delta": None if cell.delta is None else round(cell.delta, 2),
                         "paper": cell.paper, "paper_delta": cell.paper_delta, "paper_absent": cell.paper_absent}
                 for stage, cell in row.cells.items() if stage in table.stages}
        rows.append({"row": row.key, "delta_to": row.delta_to, "cells": cells})
    high_norm = {label: found[label].summary.get("high_norm_tokens") for label in ("baseline", "randaugment",
                                                                                     "registers_4")}
    sizes = {stage: table.stage_sizes.get(stage, []) for stage in table.stages}
    return {"rows": rows, "stages": table.stages, "sizes": sizes, "teacher_top1": top1(found["teacher"]),
            "high_norm_tokens": high_norm}


def _deit3_header(figures: dict[str, Any]) -> tuple[list[str], list[tuple[str, str]]]:
    names, keys = ["deit3", "Δ to"], []
    for stage in figures["stages"]:
        size = "/".join(str(s) for s in figures["sizes"][stage])
        what = "pre-train" if stage == "pretrain" else "fine-tune"
        names += [f"ours {what} @{size}", "Δ", "paper", "paper Δ"]
        keys += [(stage, "ours"), (stage, "delta"), (stage, "paper"), (stage, "paper_delta")]
    return names, keys


def _signed(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:+.{digits}f}"


def render_deit3(figures: dict[str, Any]) -> dict[str, str]:
    """The deit3 page's measured table and the sentence on high-norm tokens."""
    names, keys = _deit3_header(figures)
    lines = ["| " + " | ".join(names) + " |", "|:--|--:|" + "--:|" * len(keys)]
    for row in figures["rows"]:
        cells = []
        for stage, key in keys:
            cell = row["cells"][stage]
            value = cell[key]
            if key == "paper" and value is None and cell["ours"] is not None:
                cells.append(cell["paper_absent"])
            elif key == "ours":
                cells.append(_number(value))
            else:
                cells.append("" if value is None else (_signed(value, 2 if key == "delta" else 1)
                                                       if "delta" in key else f"{value}"))
        lines.append(f"| {row['row']} | {row['delta_to']} | " + " | ".join(cells) + " |")
    share = ", ".join(f"`{label}` {value:.1f} %" for label, value in figures["high_norm_tokens"].items())
    text = (stamp_line(figures, "deit3") + f" The demo CNN teacher reached {figures['teacher_top1']:.2f}.\n\n"
            + "\n".join(lines) + f"\n\n`high_norm_tokens` at the end of each pre-training: {share}.\n")
    return {"deit3": text}


# -- the cait page --

CAIT_DEMOS = (Demo("ca_12_2", ("cait=ca_12_2",)),)


def measure_cait(found: dict[str, Any], _: list[Any]) -> dict[str, Any]:
    return {"top1": top1(found["ca_12_2"])}


def render_cait(figures: dict[str, Any]) -> dict[str, str]:
    return {"cait": f"`python train.py cait=ca_12_2 {THREADS}` (4 + 1 blocks) reached {figures['top1']:.2f} % top-1 "
                    f"(chance 10 %). " + stamp_line(figures, "cait") + "\n"}


PAGES = {
    "transfer": Page("docs/transfer.md", TRANSFER_DEMOS, (
        f"python train.py {THREADS}", f"python train.py stage=finetune {THREADS}",
        f"python train.py transfer=builtin_b {THREADS}",
        f"python train.py transfer=builtin_b transfer.source_stage=pretrain {THREADS}",
        f"python train.py data.builtin.classes=shapes_b train.epochs=5 {THREADS}"), measure_transfer, render_transfer),
    "deit3": Page("docs/deit3.md", DEIT3_DEMOS, (
        f"python train.py -m deit3=baseline,randaugment,registers_4 {THREADS}",
        f"python train.py deit3=layer_decay_075 stage=finetune {THREADS}", f"python train.py model=cnn_demo {THREADS}",
        "python train.py -m deit3=teach_fixed,teach_function_matching "
        f"\"distill.teacher.checkpoint='outputs/runs/model=cnn_demo'\" {THREADS}"), measure_deit3, render_deit3),
    "cait": Page("docs/cait.md", CAIT_DEMOS, (f"python train.py cait=ca_12_2 {THREADS}",), measure_cait, render_cait),
}


# -- the transfer page's recipes, from the resolved config -------------------------------------------------------------

RECIPE_STAGES = (("pre-training", ()), ("fine-tune", ("stage=finetune",)), ("transfer", ("transfer=builtin_b",)))
RESOLVED = re.compile(r"(<!-- resolved:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /resolved -->)", re.S)


def render_recipes() -> dict[str, str]:
    """The demo's stages as they run (`--cfg job --resolve` with the stage's block applied): optimizer, lr, batch,
    epochs, image size."""
    from deit_ablate.config.compose import compose_run_config
    from deit_ablate.config.stage_config import stage_config
    from deit_ablate.train.optim import scaled_lr

    lines = ["| stage | `python train.py ...` | optimizer | lr (per 512 images → at the batch) | global batch | epochs "
             "(warm-up) | image size (train / eval) |", "|---|---|---|---|--:|---|---|"]
    for name, overrides in RECIPE_STAGES:
        cfg = stage_config(compose_run_config(list(overrides)))
        opt, train, res = cfg.optimizer, cfg.train, cfg.resolution
        per_512 = scaled_lr(opt.lr, 512, opt.lr_base_batch)
        lr = scaled_lr(opt.lr, train.global_batch, opt.lr_base_batch)
        lines.append(f"| {name} | {_overrides_text(overrides)} | {opt.name} | {per_512:g} → {lr:g} | "
                     f"{train.global_batch} | {train.epochs:g} ({opt.warmup_epochs:g}) | "
                     f"{res.train_size} / {res.eval_size} px |")
    return {"transfer": "\n".join(lines) + "\n"}


# -- writing --

def replace_sections(text: str, sections: dict[str, str], pattern: re.Pattern[str] = SECTION) -> str:
    """`text` with each generated section named in `sections` holding its new body; a SystemExit names one missing."""
    missing = set(sections) - {match["name"] for match in pattern.finditer(text)}
    if missing:
        raise SystemExit(f"docs_numbers: no generated section {', '.join(sorted(missing))} in the page")
    return pattern.sub(lambda m: m[1] + sections.get(m["name"], m["body"]) + m[4], text)


def render_page(name: str, measured: dict[str, Any]) -> str:
    """Page `name`'s text with its generated sections rendered from `measured` (and the resolved recipes)."""
    page = PAGES[name]
    text = replace_sections((REPO / page.file).read_text(), page.render(measured[name]))
    if name == "transfer":
        text = replace_sections(text, render_recipes(), RESOLVED)
    return text


def train_page(page: Page, outputs: Path) -> float:
    """Run the page's demo runs (each skipped when finished under `outputs`); the seconds it took."""
    start = time.monotonic()
    for demo in page.demos:
        overrides = [item.replace("{outputs}", str(outputs)) for item in demo.overrides]
        command = [sys.executable, str(REPO / "train.py"), *overrides, THREADS, f"runtime.output_root={outputs}"]
        print("docs_numbers: python train.py " + " ".join(command[2:]), flush=True)
        subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - start


def measure_page(page: Page, outputs: Path) -> dict[str, Any]:
    """The page's figures from the runs under `outputs`, stamped with their commits and the commands."""
    runs = read_runs(outputs)
    found = {demo.label: run_of(demo, runs, outputs) for demo in page.demos}
    return {**stamp(list(found.values())), "commands": list(page.commands), **page.measure(found, runs)}


def main(argv: list[str] | None = None) -> int:
    """Train what is missing, measure, write docs/measured.json and the pages."""
    from deit_ablate.run.commands import prepare_configs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", default=",".join(PAGES), help=f"comma-separated: {', '.join(PAGES)}")
    parser.add_argument("--outputs", type=Path, default=REPO / "outputs" / "docs_numbers",
                        help="the output root the demo runs go to (finished runs there are reused)")
    parser.add_argument("--no-train", action="store_true", help="read the runs already under --outputs, train none")
    parser.add_argument("--render-only", action="store_true", help="rewrite the pages from docs/measured.json")
    args = parser.parse_args(argv)
    names = [name for name in args.pages.split(",") if name]
    unknown = [name for name in names if name not in PAGES]
    if unknown:
        parser.error(f"unknown page(s) {', '.join(unknown)}; known: {', '.join(PAGES)}")
    prepare_configs()
    measured = json.loads(MEASURED.read_text()) if MEASURED.exists() else {}
    outputs = args.outputs.resolve()
    for name in names:
        if not args.render_only:
            seconds = 0.0 if args.no_train else train_page(PAGES[name], outputs)
            measured[name] = measure_page(PAGES[name], outputs)
            print(f"docs_numbers: {name}: {seconds:.0f} s", flush=True)
        (REPO / PAGES[name].file).write_text(render_page(name, measured))
    MEASURED.write_text(json.dumps(measured, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

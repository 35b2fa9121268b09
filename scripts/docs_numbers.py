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


class BadInput(Exception):
    """What the script cannot work from (no runs under --outputs, a damaged docs/measured.json): its message names the
    problem and the fix; main says it in one line, exit status 2, before any page or docs/measured.json is written."""


# -- reading the runs --

def read_runs(outputs: Path) -> list[Any]:
    """Every finished run logged under `outputs`, one per run id, with its per-epoch rows."""
    from deit_ablate.analysis.aggregate import dedup, read_offline
    from deit_ablate.record.rundir import wandb_root

    if not wandb_root(outputs).is_dir():
        raise BadInput(f"--outputs {outputs} holds no {wandb_root(outputs).name}/ folder: no run was logged there. "
                       "Train the pages' runs there (without --no-train), or give --outputs the output root they were "
                       "trained under")
    runs, _ = dedup(read_offline(wandb_root(outputs), history=True, warn=lambda message: None))
    return [run for run in runs if run.status == "finished"]


def run_of(demo: Demo, runs: list[Any], outputs: Path) -> Any:
    """The finished run a demo's command trains: the one logged under the folder its identity names."""
    from deit_ablate.record.resolvers import run_dir_of

    overrides = [item.replace("{outputs}", str(outputs)) for item in demo.overrides]
    name = run_dir_of(overrides, outputs).name
    found = [run for run in runs if run.name == name]
    if not found:
        raise BadInput(f"no finished run of `python train.py {' '.join(overrides)}` under {outputs}. Train it "
                       "(without --no-train), or give --outputs the output root it was trained under")
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


def stamp_line(figures: dict[str, Any], page: str, runs: str = "seed 0, one run each") -> str:
    commits = ", ".join(commit[:10] for commit in figures["commits"])
    return (f"Measured at commit {commits} on {figures['date']}: {runs}, built-in data, one torch "
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


def study_table(runs: list[Any], study: str) -> dict[str, Any]:
    """The aggregator's table of a study's runs with its paper table beside (`--paper STUDY`, rows that ran), each
    cell's figures as plain values: ours, Δ, the paper's, and the sharpness figures where the runs have them."""
    from deit_ablate.analysis.aggregate import build_table

    table = build_table(runs, rows=study, paper=study, only_present=True)
    rows = []
    for row in (row for row in table.rows if row.has_runs):
        cells = {stage: {"ours": None if cell.mean is None else round(cell.mean, 2),
                         "delta": None if cell.delta is None else round(cell.delta, 2),
                         "paper": cell.paper, "paper_delta": cell.paper_delta, "paper_absent": cell.paper_absent,
                         "sharpness": {name: round(sum(v) / len(v), 3) for name, v in cell.sharpness.items()},
                         "paper_sharpness": dict(cell.paper_sharpness)}
                 for stage, cell in row.cells.items() if stage in table.stages}
        rows.append({"row": row.key, "delta_to": row.delta_to, "cells": cells})
    sizes = {stage: table.stage_sizes.get(stage, []) for stage in table.stages}
    columns = dict(table.paper.columns) if table.paper is not None else {}
    return {"study": study, "rows": rows, "stages": table.stages, "sizes": sizes, "paper_columns": columns}


def measure_deit3(found: dict[str, Any], _: list[Any]) -> dict[str, Any]:
    """The deit3 table, the teacher's top-1 and each ViT pre-training's high-norm token share."""
    table = study_table([run for label, run in found.items() if label != "teacher"], "deit3")
    high_norm = {label: found[label].summary.get("high_norm_tokens") for label in ("baseline", "randaugment",
                                                                                     "registers_4")}
    return {"table": table, "teacher_top1": top1(found["teacher"]), "high_norm_tokens": high_norm}


# (summary figure, header, digits) of the sharpness columns, as the aggregator prints them (analysis/aggregate/sharp.py)
SHARPNESS = (("lambda_max", "λ_max", 1), ("train_loss", "train loss", 3), ("noisy_loss", "noisy loss", 3))


def _signed(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:+.{digits}f}"


def _stage_cells(cell: dict[str, Any]) -> list[str]:
    paper = cell["paper"] if cell["paper"] is not None else (cell["paper_absent"] if cell["ours"] is not None else "")
    return [_number(cell["ours"]), _signed(cell["delta"], 2), f"{paper}", _signed(cell["paper_delta"], 1)]


def _sharpness_cells(cell: dict[str, Any]) -> list[str]:
    out = []
    for name, _, digits in SHARPNESS:
        value, paper = cell["sharpness"].get(name), cell["paper_sharpness"].get(name)
        out += ["" if value is None else f"{value:.{digits}f}", "" if paper is None else f"{paper:g}"]
    return out


def render_table(table: dict[str, Any]) -> str:
    """A study's table as the page shows it: the aggregator's columns, sharpness ones where the runs have them."""
    names = [table["study"], "Δ to"]
    for stage in table["stages"]:
        what = "pre-train" if stage == "pretrain" else "fine-tune"
        at = str(table["paper_columns"].get(stage, ""))
        paper = f"paper @{at}" if at.isdigit() else f"paper {what}"
        names += [f"ours {what} @{'/'.join(str(s) for s in table['sizes'][stage])}", "Δ", paper, "paper Δ"]
    sharp = any(row["cells"]["pretrain"]["sharpness"] for row in table["rows"])
    names += [text for _, head, _ in SHARPNESS for text in (head, f"paper {head}")] if sharp else []
    lines = ["| " + " | ".join(names) + " |", "|:--|--:|" + "--:|" * (len(names) - 2)]
    for row in table["rows"]:
        cells = [text for stage in table["stages"] for text in _stage_cells(row["cells"][stage])]
        cells += _sharpness_cells(row["cells"]["pretrain"]) if sharp else []
        lines.append(f"| {row['row']} | {row['delta_to']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_deit3(figures: dict[str, Any]) -> dict[str, str]:
    """The deit3 page's measured table and the sentence on high-norm tokens."""
    share = ", ".join(f"`{label}` {value:.1f} %" for label, value in figures["high_norm_tokens"].items())
    text = (stamp_line(figures, "deit3") + f" The demo CNN teacher reached {figures['teacher_top1']:.2f}.\n\n"
            + render_table(figures["table"]) + f"\n\n`high_norm_tokens` at the end of each pre-training: {share}.\n")
    return {"deit3": text}


# -- the sharpness page --

SAM_ROWS = ("baseline", "rho_02", "sgd", "sgd_rho_02")
SAM_DEMOS = tuple(Demo(row, (f"sam={row}", "sharpness.at_end=true")) for row in SAM_ROWS)


def measure_sam(found: dict[str, Any], _: list[Any]) -> dict[str, Any]:
    return {"table": study_table(list(found.values()), "sam")}


def render_sam(figures: dict[str, Any]) -> dict[str, str]:
    return {"sharpness": stamp_line(figures, "sharpness") + "\n\n" + render_table(figures["table"]) + "\n"}


# -- the seed spread (docs/studies.md) --

SAM_SEEDS = (Demo("sam seed 0", ("sam=baseline", "sharpness.at_end=true")),
             Demo("sam seed 1", ("sam=baseline", "seed=1")))
SPREAD_DEMOS = (*(Demo(f"demo seed {seed}", (f"seed={seed}",) if seed else ()) for seed in range(5)), *SAM_SEEDS)


def measure_spread(found: dict[str, Any], _: list[Any]) -> dict[str, Any]:
    """Top-1 over the plain demo's five seeds and `sam=baseline`'s two, and the standard deviation of each."""
    import statistics

    out = {}
    for name, prefix in (("demo", "demo seed"), ("sam_baseline", "sam seed")):
        values = [top1(run) for label, run in found.items() if label.startswith(prefix)]
        out[name] = {"top1": values, "sigma": round(statistics.stdev(values), 2)}
    return out


def render_spread(figures: dict[str, Any]) -> dict[str, str]:
    demo, sam = figures["demo"], figures["sam_baseline"]
    return {"spread": f"The plain demo gave {_listed(demo['top1'])} % (σ = {demo['sigma']:.2f}), `sam=baseline` "
                      f"{_listed(sam['top1'])} % (σ = {sam['sigma']:.2f}).\n"
                      + stamp_line(figures, "spread", "one run per seed") + "\n"}


def _listed(values: list[float]) -> str:
    texts = [f"{value:.1f}" for value in values]
    return ", ".join(texts[:-1]) + f" and {texts[-1]}"


# -- the teachers of Table 2 (docs/distillation.md) --

TEACHER_ROWS = (("deit_b", "the demo ViT"), ("regnety_16gf", "the demo CNN"))
TEACHER_DEMOS = tuple(Demo(f"{row} {stage}", (f"teachers={row}", *(("stage=finetune",) if stage == "finetune" else ())))
                      for row, _ in TEACHER_ROWS for stage in ("pretrain", "finetune"))


def measure_teachers(found: dict[str, Any], _: list[Any]) -> dict[str, Any]:
    """Per row: its teacher's top-1 (as the student recorded it), the student's, and its fine-tune's."""
    return {row: {"teacher": round(float(found[f"{row} pretrain"].summary["teacher"]["top1"]), 2),
                  "student": top1(found[f"{row} pretrain"]), "finetune": top1(found[f"{row} finetune"])}
            for row, _ in TEACHER_ROWS}


def render_teachers(figures: dict[str, Any]) -> dict[str, str]:
    lines = ["| `teachers=` | teacher | teacher top-1 | student @32 | its fine-tune @48 |", "|---|---|--:|--:|--:|"]
    for row, teacher in TEACHER_ROWS:
        got = figures[row]
        lines.append(f"| `{row}` | {teacher} | {got['teacher']:.2f} | {got['student']:.2f} | {got['finetune']:.2f} |")
    return {"teachers": stamp_line(figures, "teachers") + "\n\n" + "\n".join(lines) + "\n"}


# -- the cait page --

CAIT_DEMOS = (Demo("ca_12_2", ("cait=ca_12_2",)),)


def measure_cait(found: dict[str, Any], _: list[Any]) -> dict[str, Any]:
    return {"top1": top1(found["ca_12_2"])}


def render_cait(figures: dict[str, Any]) -> dict[str, str]:
    return {"cait": f"`python train.py cait=ca_12_2 {THREADS}` (4 + 1 blocks) reached {figures['top1']:.2f} % top-1 "
                    f"(chance 10 %).\n" + stamp_line(figures, "cait") + "\n"}


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
    "sharpness": Page("docs/sharpness.md", SAM_DEMOS, (
        f"python train.py -m sam={','.join(SAM_ROWS)} sharpness.at_end=true {THREADS}",), measure_sam, render_sam),
    "spread": Page("docs/studies.md", SPREAD_DEMOS, (
        f"python train.py -m seed=0,1,2,3,4 {THREADS}", f"python train.py -m sam=baseline seed=0,1 {THREADS}"),
        measure_spread, render_spread),
    "teachers": Page("docs/distillation.md", TEACHER_DEMOS, (
        f"python train.py -m teachers=deit_b,regnety_16gf stage=pretrain,finetune {THREADS}",), measure_teachers,
        render_teachers),
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
        raise BadInput(f"no generated section {', '.join(sorted(missing))} in the page: restore its "
                       "`<!-- measured:NAME -->` ... `<!-- /measured -->` markers (git diff shows them)")
    return pattern.sub(lambda m: m[1] + sections.get(m["name"], m["body"]) + m[4], text)


def read_measured(path: Path) -> dict[str, Any]:
    """docs/measured.json's figures of each page (none where there is no file); BadInput when it is damaged."""
    if not path.exists():
        return {}
    fix = (f"Restore it (git checkout -- {path.relative_to(REPO) if path.is_relative_to(REPO) else path}) or "
           "regenerate its pages (python scripts/docs_numbers.py)")
    try:
        measured = json.loads(path.read_text())
    except (ValueError, RecursionError, OSError) as error:  # UnicodeDecodeError is a ValueError
        raise BadInput(f"{path} cannot be read ({type(error).__name__}: {str(error)[:80]}). {fix}") from None
    if not isinstance(measured, dict) or not all(isinstance(v, dict) for v in measured.values()):
        raise BadInput(f"{path} is not a JSON object of each page's figures. {fix}")
    return measured


def render_page(name: str, measured: dict[str, Any]) -> str:
    """Page `name`'s text with its generated sections rendered from `measured` (and the resolved recipes)."""
    page = PAGES[name]
    if name not in measured:
        raise BadInput(f"{MEASURED} holds no figures of page {name}: measure them (python scripts/docs_numbers.py "
                       f"--pages {name}, without --render-only)")
    try:
        sections = page.render(measured[name])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise BadInput(f"{MEASURED}'s figures of page {name} are damaged ({type(error).__name__}: {str(error)[:80]}). "
                       f"Restore the file (git checkout -- docs/measured.json) or measure them again (python "
                       f"scripts/docs_numbers.py --pages {name})") from None
    text = replace_sections((REPO / page.file).read_text(), sections)
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
    """Train what is missing, measure, write docs/measured.json and the pages: all of them once every page is
    rendered, none on bad input (one line, exit status 2)."""
    from deit_ablate.core.atomic import write_text_atomic
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
    outputs = args.outputs.resolve()
    try:
        measured = read_measured(MEASURED)
        if args.no_train and not args.render_only:
            read_runs(outputs)  # no runs there: said before any page is measured
        pages = {}
        for name in names:
            if not args.render_only:
                seconds = 0.0 if args.no_train else train_page(PAGES[name], outputs)
                measured[name] = measure_page(PAGES[name], outputs)
                print(f"docs_numbers: {name}: {seconds:.0f} s", flush=True)
            pages[REPO / PAGES[name].file] = render_page(name, measured)
    except BadInput as error:
        print(f"error: docs_numbers: {error}.", file=sys.stderr)
        return 2
    for path, text in pages.items():
        write_text_atomic(path, text)
    write_text_atomic(MEASURED, json.dumps(measured, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

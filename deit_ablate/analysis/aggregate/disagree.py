"""The disagreement matrix of finished runs (DeiT Table 4): the percent of eval images on which two predictions
differ, over every (run, head) of the runs, from the predictions each run keeps (deit_ablate/record/predictions.py).

Runs are compared only on the same images: their data fingerprints must match and their files hold the same
images (refused before anything is computed, naming both runs). The paper's four Table 4 values (conf/distill/
disagreement.json) are shown beside ours where the runs' roles can be told: the distilled run (it has a fused head),
its teacher (the run its result names as teacher), and a run without distillation.
"""

from __future__ import annotations

import csv
import io
import json
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from deit_ablate.config.studies import CONF_DIR, default_choices, preset_choices, studies
from deit_ablate.core.errors import ConfigError
from deit_ablate.record.predictions import HEAD_NAMES, HEADS, INDEX, LABELS
from deit_ablate.record.rundir import DATA, PREDICTIONS, PREDICTIONS_FIX, RunDir
from deit_ablate.record.runfiles import DamagedRecord, read_text

from .plot import literal

PAPER_FILE = CONF_DIR / "distill" / "disagreement.json"


@dataclass(frozen=True)
class RunPredictions:
    """One run's saved predictions: per head, with the true labels, the image indices and their record."""

    run: RunDir
    label: str
    heads: dict[str, np.ndarray]
    labels: np.ndarray
    index: np.ndarray
    record: dict[str, Any]
    teacher_run: str | None  # the folder name of the run it distilled from, if a run


def _missing(run: RunDir) -> ConfigError:
    """Why `run` has no predictions file, and what to do."""
    result = run.read_result()
    if result is None:
        return ConfigError(f"the run {run.path} has not finished (no result.json): launch its command again to "
                           "finish it; it then writes its predictions.")
    if result["status"] != "finished":
        return ConfigError(f"the run {run.path} ended as {result['status']}: only a finished run keeps predictions.")
    return ConfigError(f"the run {run.path} has no {PREDICTIONS}: it finished before runs kept their predictions. "
                       f"Re-evaluate it: delete its {run.result.name} and launch its command again (it resumes at its "
                       "final checkpoint, only evaluates, and writes both), or train it again.")


def row_label(run: RunDir) -> str | None:
    """The study row the run is, from its Hydra choices (`teachers=regnety_4gf`; a run of no study's own row: the
    group options it changes from the recipe's, `model=cnn_demo`, else the default row, `ablation=baseline`); None
    where the run recorded no choices."""
    try:
        choices = yaml.safe_load(read_text(run.hydra_settings))["hydra"]["runtime"]["choices"]  # bounded, no FIFO
    except (OSError, DamagedRecord, yaml.YAMLError, KeyError, TypeError, RecursionError):
        return None
    if not isinstance(choices, dict):
        return None
    rows = [f"{s.name}={choices[s.name]}" for s in studies() if s.default is None and choices.get(s.name)]
    if rows:
        return ", ".join(rows)
    defaults = {**default_choices(), **preset_choices().get(str(choices.get("preset")), {})}
    changed = [f"{g}={v}" for g, v in choices.items() if g in defaults and v is not None and str(v) != defaults[g]]
    if changed:
        return ", ".join(changed)
    main = next((s for s in studies() if s.default is not None and choices.get(s.name)), None)
    return f"{main.name}={choices[main.name]}" if main else None


def load_predictions(run: RunDir, label: str | None = None) -> RunPredictions:
    """The run's predictions.npz; a ConfigError naming the run and the fix when it has none."""
    held = run.read_predictions()
    if held is None:
        raise _missing(run)
    arrays, record = held
    lengths = {arrays[name].shape for name in (LABELS, INDEX, *HEADS) if name in arrays}
    if LABELS not in arrays or INDEX not in arrays or len(lengths) != 1 or len(next(iter(lengths))) != 1 \
            or any(values.dtype.kind not in "iu" for values in arrays.values()):
        raise DamagedRecord(run.predictions, "not a predictions file (its labels, indices and heads are not integer "
                                             "arrays of one length)", PREDICTIONS_FIX)
    teacher = (run.read_result() or {}).get("teacher") or {}
    teacher_run = Path(str(teacher["run"])).name if teacher.get("run") else None
    heads = {head: arrays[head].astype(np.int64) for head in HEADS if head in arrays}
    label = label or row_label(run) or str(record.get("model_name") or run.name)
    return RunPredictions(run=run, label=label, heads=heads,
                          labels=arrays[LABELS].astype(np.int64), index=arrays[INDEX].astype(np.int64),
                          record=record, teacher_run=teacher_run)


def unique_labels(runs: Sequence[RunPredictions]) -> list[RunPredictions]:
    """The runs with labels told apart: a label two runs share gets each run's hash (the name's last 10 chars)."""
    seen = [r.label for r in runs]
    return [r if seen.count(r.label) == 1 else
            RunPredictions(r.run, f"{r.label} [{r.run.name[-10:]}]", r.heads, r.labels, r.index, r.record,
                           r.teacher_run) for r in runs]


def check_comparable(runs: Sequence[RunPredictions]) -> None:
    """Refuse runs whose predictions are not of the same images: other data (by fingerprint), another number
    of images, or other images of the split. A ConfigError naming both runs."""
    from deit_ablate.data.datasets import describe_data

    first = runs[0]
    for other in runs[1:]:
        a, b = first.record.get(DATA) or {}, other.record.get(DATA) or {}
        if a.get("digest") != b.get("digest"):
            raise ConfigError(f"{first.run.name} and {other.run.name} were evaluated on different data: "
                              f"{describe_data(a)} against {describe_data(b)}. Compare runs of one dataset.")
        if first.index.size != other.index.size or not np.array_equal(first.index, other.index):
            raise ConfigError(f"{first.run.name} holds predictions of {first.index.size} images, {other.run.name} "
                              f"of {other.index.size}{'' if first.index.size != other.index.size else ' others'}: "
                              "compare runs evaluated on the whole split (train.eval_max_images unset).")


def columns(runs: Sequence[RunPredictions]) -> list[tuple[str, np.ndarray]]:
    """Every (run, head) as (label, predictions): `<run label>`, or `<run label> (class head)` and so on."""
    return [(f"{r.label} ({HEAD_NAMES[head]})" if HEAD_NAMES[head] else r.label, values)
            for r in runs for head, values in r.heads.items()]


def disagreement_matrix(predictions: Sequence[np.ndarray]) -> np.ndarray:
    """The percent of images on which each pair of prediction arrays differs (symmetric, 0 on the diagonal)."""
    stacked = np.stack([np.asarray(p) for p in predictions])
    return 100.0 * (stacked[:, None, :] != stacked[None, :, :]).mean(axis=2)


def paper_pairs(path: Path = PAPER_FILE) -> dict[str, Any]:
    """Table 4 as conf/distill/disagreement.json holds it (title, citation, note, pairs)."""
    return json.loads(path.read_text(encoding="utf-8"))["table4"]


def roles(runs: Sequence[RunPredictions]) -> dict[str, RunPredictions]:
    """Which run plays which part of Table 4 (`distilled`, `teacher`, `plain`), where exactly one run fits each."""
    distilled = [r for r in runs if "fused" in r.heads]
    found = {"distilled": distilled[0]} if len(distilled) == 1 else {}
    if found and found["distilled"].teacher_run is not None:
        teacher = [r for r in runs if r.run.name == found["distilled"].teacher_run]
        found.update({"teacher": teacher[0]} if len(teacher) == 1 else {})
    plain = [r for r in runs if "main" in r.heads and r is not found.get("teacher")]
    found.update({"plain": plain[0]} if len(plain) == 1 else {})
    return found


ROLES = {"distilled": "a distilled run (one with a distillation token: class, distillation and fused heads)",
         "teacher": "its teacher run (the run its result names as teacher)",
         "plain": "a run without distillation"}


def missing_roles(runs: Sequence[RunPredictions]) -> str:
    """Why the paper's pairs have no value of ours ('' when every role is filled): the parts of Table 4 none of
    these runs plays, and what to give."""
    parts = roles(runs)
    missing = [text for role, text in ROLES.items() if role not in parts]
    if not missing:
        return ""
    return ("Ours is — where these runs hold no such pair: Table 4 compares " + "; ".join(ROLES.values()) +
            f". No run here (or more than one) is {'; '.join(missing)}. Give one run of each (e.g. a "
            "distill=hard_token run, its teacher and a run without distillation) to fill it.")


def reference_rows(runs: Sequence[RunPredictions], table: dict[str, Any]) -> list[dict[str, Any]]:
    """The paper's pairs, each with ours (the same pair among `runs`) where the runs' roles can be told."""
    parts = roles(runs)
    rows = []
    for pair in table["pairs"]:
        a, b = parts.get(pair["a_role"]), parts.get(pair["b_role"])
        ours = None
        if a is not None and b is not None and pair["a_head"] in a.heads:
            b_values = b.heads.get("main", b.heads.get("fused"))
            ours = float(disagreement_matrix([a.heads[pair["a_head"]], b_values])[0, 1])
        rows.append({"pair": f"{pair['a']} vs {pair['b']}", "paper": pair["percent"], "ours": ours})
    return rows


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def markdown_matrix(labels: Sequence[str], matrix: np.ndarray) -> str:
    """The matrix as a markdown table (percent, one decimal)."""
    lines = ["| disagreement (%) | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    lines += [f"| {label} | " + " | ".join(f"{v:.1f}" for v in row) + " |"
              for label, row in zip(labels, matrix, strict=True)]
    return "\n".join(lines)


def markdown_reference(rows: Sequence[dict[str, Any]], table: dict[str, Any], why: str = "") -> str:
    """The paper's Table 4 values beside ours, as a markdown table with its source (and `why` ours is missing)."""
    lines = [f"{table['title']} (DeiT-B on ImageNet; {table['citation']})", "",
             "| pair | paper (%) | ours (%) |", "|---|---:|---:|"]
    lines += [f"| {r['pair']} | {r['paper']:.1f} | {_percent(r['ours'])} |" for r in rows]
    return "\n".join(lines + (["", why] if why else []))


def matrix_csv(labels: Sequence[str], matrix: np.ndarray) -> str:
    """The matrix as CSV: a header of labels, one row per label."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["", *labels])
    writer.writerows([label, *(f"{v:.4f}" for v in row)] for label, row in zip(labels, matrix, strict=True))
    return buf.getvalue()


def heatmap(labels: Sequence[str], matrix: np.ndarray, rows: Sequence[dict[str, Any]], images: int,
            why: str = "") -> Any:
    """The matrix as a matplotlib Figure (a cell's percent written in it), the paper's values beside it (and `why`
    ours is missing)."""
    from matplotlib.figure import Figure

    side = 0.55 * len(labels)  # inches: the matrix, then room for labels (left, below), colour bar and the paper
    margin = 0.3 + 0.065 * max(len(label) for label in labels)
    labels = [literal(label) for label in labels]
    width, height = margin + side + 1.2 + 3.6, margin + side + 0.6
    fig = Figure(figsize=(width, height), dpi=120)
    ax = fig.add_axes((margin / width, margin / height, side / width, side / height))
    image = ax.imshow(matrix, cmap="viridis", vmin=0.0)
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", rotation_mode="anchor", fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    for i, row in enumerate(matrix):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.1f}", ha="center", va="center", fontsize=7,
                    color="white" if value < 0.6 * max(matrix.max(), 1e-9) else "black")
    bar = fig.add_axes(((margin + side + 0.15) / width, margin / height, 0.15 / width, side / height))
    fig.colorbar(image, cax=bar).set_label("% of images predicted differently", fontsize=7)
    ax.set_title(f"Disagreement over {images} eval images", fontsize=9)
    reference = "\n".join(f"{r['pair']}:\n  paper {r['paper']:.1f}%, ours {_percent(r['ours'])}" for r in rows)
    reference += "\n\n" + textwrap.fill(why, 60) if why else ""
    fig.text((width - 3.5) / width, (margin + side) / height,
             literal("DeiT Table 4 (DeiT-B, ImageNet)\n\n" + reference), fontsize=6.5, ha="left", va="top")
    return fig

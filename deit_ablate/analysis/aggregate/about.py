"""What a table was made from: data, model as built, epochs, resolution, preset, commit and the aggregator's filters.

Every output names these (the heading, the notes, the figures' foot), so a table of a small demo ViT on the
built-in 32 px data never reads as DeiT-B on ImageNet. Where the counted runs differ in one of them, every
distinct value is listed with its run count rather than one picked.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from deit_ablate.train.architecture import describe_architecture

from .cells import Table
from .paper import STAGE_NAMES
from .reader import RunInfo
from .select import MISSING, format_value, get_key

NOT_RECORDED = "not recorded"
COMMIT_KEYS = ("git_commit", "commit", "git.commit")  # where a config or summary may hold the code's commit


def _get(config: dict[str, Any], key: str) -> Any:
    value = get_key(config, key)
    return None if value is MISSING else value


def run_commit(run: RunInfo) -> str:
    """The commit of the code that made a run: wandb's git record, else a config or summary key; '' if none."""
    if run.commit:
        return run.commit
    for source in (run.config, run.summary):
        for key in COMMIT_KEYS:
            value = _get(source, key)
            if isinstance(value, str) and value:
                return value
    return ""


def builtin_text(run: RunInfo) -> str:
    """What the built-in data is: `10 synthetic shape classes (shapes), drawn at 40 px, 30 train / 10 val images per
    class`; '' for other data."""
    if _get(run.config, "data.name") != "builtin":
        return ""
    drawn = _get(run.config, "data.builtin")
    drawn = drawn if isinstance(drawn, dict) else {}
    classes = _get(run.config, "data.num_classes") or 10
    text = f"{classes} synthetic shape classes"
    text += f" ({drawn['classes']})" if drawn.get("classes") else ""
    text += f", drawn at {drawn['image_size']} px" if drawn.get("image_size") else ""
    if drawn.get("train_per_class") and drawn.get("val_per_class"):
        text += f", {drawn['train_per_class']} train / {drawn['val_per_class']} val images per class"
    return text


def data_text(run: RunInfo) -> str:
    """`builtin: 10 synthetic shape classes ... (digest 4a7852e1, 10 classes)`: the data's name (and what the built-in
    data is), the short form of its fingerprint, its classes."""
    config = run.config
    fingerprint = _get(config, "data_fingerprint")
    fingerprint = fingerprint if isinstance(fingerprint, dict) else {}
    name, digest = _get(config, "data.name"), fingerprint.get("digest")
    if name is None and not digest:
        return NOT_RECORDED
    classes = _get(config, "data.num_classes") or fingerprint.get("classes")
    parts = [f"digest {str(digest)[:8]}" if digest else "no fingerprint"]
    if classes is not None:
        parts.append(f"{classes} classes")
    what = builtin_text(run)
    return f"{format_value(name)}{': ' + what if what else ''} ({', '.join(parts)})"


def built_text(run: RunInfo) -> str:
    """The model as the run built it (`vit_base_patch16_224 (patch 8, width 32, depth 1, heads 2, 0.02 M params)`),
    else its configured timm name; '' when neither is recorded."""
    arch = run.summary.get("architecture")
    if isinstance(arch, dict) and isinstance(arch.get("params"), (int, float)) and "name" in arch:
        return describe_architecture(arch)
    name = _get(run.config, "model.name")
    return format_value(name) if name is not None else ""


def model_text(run: RunInfo) -> str:
    """The timm name with the architecture options the run set (`deit_tiny_patch16_224 (patch_size=8, ...)`)."""
    name = _get(run.config, "model.name")
    if name is None:
        return NOT_RECORDED
    kwargs = _get(run.config, "model.kwargs")
    text = name + (f" ({', '.join(f'{k}={format_value(v)}' for k, v in kwargs.items())})" if kwargs else "")
    built = run.summary.get("model_name")
    return text + (f", trained as {built}" if isinstance(built, str) and built != name else "")


def epochs_text(run: RunInfo, stage: str) -> str:
    """The epochs the run's stage was set to train."""
    value = _get(run.config, {"finetune": "finetune.epochs", "transfer": "transfer.epochs"}.get(stage, "train.epochs"))
    return NOT_RECORDED if value is None else format_value(value)


def resolution_text(run: RunInfo, stage: str) -> str:
    """`32 px`, or `32 px, eval 40 px` where evaluation uses another size."""
    train, test = _get(run.config, "resolution.train_size"), _get(run.config, "resolution.eval_size")
    if train is None:
        return NOT_RECORDED
    return f"{train} px" if test in (None, train) else f"{train} px, eval {test} px"


def scratch_text(run: RunInfo) -> str:
    """A from-scratch run's schedule: `pre-train, 5 epochs at 32 px`."""
    epochs = epochs_text(run, "pretrain")
    return f"pre-train, {epochs} epoch{'' if epochs == '1' else 's'} at {resolution_text(run, 'pretrain')}"


def _values(texts: list[str]) -> str:
    """One value, or `differs: A (2 runs) | B (1 run)`."""
    counts = Counter(texts)
    if not counts:
        return "no runs counted"
    if len(counts) == 1:
        return texts[0]
    return "differs: " + " | ".join(f"{v} ({n} run{'s' if n > 1 else ''})" for v, n in counts.items())


def _runs(table: Table) -> list[tuple[str, RunInfo]]:
    """(stage, run) of every run the table counts."""
    return [(stage, run) for _, stage, run, _ in table.counted]


def _per_stage(table: Table, describe: Any) -> str:
    runs = _runs(table)
    parts = []
    for stage in table.stages:
        texts = [describe(run, stage) for s, run in runs if s == stage]
        if texts:
            parts.append(f"{STAGE_NAMES.get(stage, stage)} {_values(texts)}")
    return "; ".join(parts) or "no runs counted"


def _commit(run: RunInfo) -> str:
    commit = run_commit(run)
    return commit[:12] if commit else NOT_RECORDED


def facts(table: Table) -> list[tuple[str, str]]:
    """(label, text) for each thing a reader needs to know about the runs behind a table."""
    runs = [run for _, run in _runs(table)]
    out = [
        ("data", _values([data_text(r) for r in runs])),
        ("model", _values([model_text(r) for r in runs])),
        ("epochs", _per_stage(table, epochs_text)),
        ("resolution", _per_stage(table, resolution_text)),
        ("preset", _values([format_value(get_key(r.config, "preset")) for r in runs])),
        ("commit", _values([_commit(r) for r in runs])),
    ]
    if table.reference_runs:
        out.append((table.reference, _values([scratch_text(r) for r in table.reference_runs])))
    for key in ("filters", "options"):
        if table.meta.get(key):
            out.append((key, str(table.meta[key])))
    return out


def fact_lines(table: Table) -> list[str]:
    """`label: text` per fact."""
    return [f"{label}: {text}" for label, text in facts(table)]


def study_title(table: Table) -> str:
    """The paper table's title, or what the rows are."""
    return table.paper.title if table.paper else f"Runs grouped by {table.rows_key}"


def _short(runs: list[RunInfo], key: str, form: str) -> str:
    """The distinct recorded values of a key joined by ` / `, put into `form`; '' when no run records it."""
    values = [format_value(v) for r in runs if (v := _get(r.config, key)) is not None]
    return form.format(" / ".join(dict.fromkeys(values))) if values else ""


def headline(table: Table) -> str:
    """The study's title and what our runs are, the model as built with its parameters: `Table 8: ... (the paper's
    models; ours: deit_tiny_patch16_224 (patch 8, ..., 1.21 M params) on builtin (10 synthetic shape classes) at
    32 px, demo preset)`."""
    runs = [run for _, run in _runs(table)]
    if not runs:
        return f"{study_title(table)} (no runs counted)"
    model = " / ".join(dict.fromkeys(text for r in runs if (text := built_text(r))))
    data = _short(runs, "data.name", "on {}")
    shapes = " / ".join(dict.fromkeys(text.split(" (")[0] for r in runs if (text := builtin_text(r))))
    data += f" ({shapes})" if data and shapes else ""
    data += _short(runs, "resolution.train_size", " at {} px") if data else ""
    preset = _short(runs, "preset", "{} preset")
    what = ", ".join(p for p in (" ".join(p for p in (model, data) if p), preset) if p)
    paper = "the paper's models; " if table.paper else ""
    return f"{study_title(table)} ({paper}ours: {what or 'settings not recorded'})"


def page_title(table: Table) -> str:
    """A short browser-tab title that does not repeat the heading."""
    return f"deit-aggregate: {table.paper.name if table.paper else table.rows_key}"


def footer(table: Table) -> str:
    """The facts as one paragraph, for a figure's foot."""
    return "What was run: " + " · ".join(f"{label}: {text}" for label, text in facts(table)) + "."

"""Which fusion of a ⚗ model's two heads a cell's figure is, and the same runs' figure under the other rule.

The DeiT paper fuses the class and distillation heads by adding their softmax outputs (`prob`); the released code
and timm evaluate the mean of their logits (`logit`). A distilled run records both (top1_fused by its
distill.fusion, top1_fused_alt by the other; `fusion`, top1_fusion_prob and top1_fusion_logit since they were named),
so a cell of fused figures says which rule it compares with the paper and shows the other beside it."""

from __future__ import annotations

import statistics

from .cells import Cell, Table
from .reader import RunInfo, metric_value
from .select import get_key

NAMES = {"prob": "softmax sum", "logit": "logit mean"}
OTHER = {"prob": "logit", "logit": "prob"}
HEADER = "other fusion"
NOTE = ("Fusion: a ⚗ cell's figure ranks classes by its two heads fused by the rule named after it, the one it "
        "compares with the paper: softmax sum (the DeiT paper's: the heads' softmax outputs added) or logit mean "
        "(the released code's and timm's evaluation; the ↑384 85.42 of CaiT's text). `other fusion` is the top-1 of "
        "the same runs under the other rule, from the same evaluation pass (summary top1_fused_alt).")


def run_fusion(run: RunInfo, key: str) -> tuple[str, float] | None:
    """The rule summary `key` of a ⚗ run ranks by and the run's top-1 under the other rule; None where `key` is
    no fused figure (a head's, an EMA's, a plain model's)."""
    summary = run.summary
    if "top1_fused_alt" not in summary or key not in ("top1", "top1_fused", "top1_fused_alt"):
        return None
    if key == "top1" and "top1_ema_final" in summary:  # the EMA's figure; the fusion figures are the model's
        return None
    rule = summary.get("fusion")
    if rule not in NAMES:  # a run recorded before `fusion` was: its stage's rule from its config
        rule = _config_rule(run)
    other_key = "top1_fused" if key == "top1_fused_alt" else "top1_fused_alt"
    other = metric_value(run, other_key)
    if other is None:
        return None
    return (OTHER[rule], other) if key == "top1_fused_alt" else (rule, other)


def _config_rule(run: RunInfo) -> str:
    """distill.fusion as the run's stage ran it: a stage's overrides (finetune.overrides) before the top level."""
    overrides = get_key(run.config, f"{run.config.get('stage', 'pretrain')}.overrides")
    overrides = overrides if isinstance(overrides, dict) else {}
    for value in (get_key(overrides, "distill.fusion"), get_key(run.config, "distill.fusion")):
        if value in NAMES:
            return str(value)
    return "prob"


def add_run(cell: Cell, run: RunInfo, key: str) -> None:
    """Note a counted run's fusion rule and other-rule figure in its cell."""
    found = run_fusion(run, key)
    if found is None:
        return
    rule, other = found
    cell.fusion = rule if cell.fusion in (None, rule) else "either rule"  # runs of both: no other figure is shown
    cell.other_fusion.append(other)


def stages(table: Table) -> list[str]:
    """The stages with a fused cell: each gets an `other fusion` column."""
    return [s for s in table.stages if any(r.cells[s].other_fusion for r in table.rows)]


def rule_text(cell: Cell) -> str:
    """` · softmax sum` after a fused figure ('' for any other)."""
    return f" · {NAMES.get(cell.fusion, cell.fusion)}" if cell.fusion else ""


def _spread(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and standard deviation of the other rule's figures (None where there are too few)."""
    return (statistics.fmean(values) if values else None, statistics.stdev(values) if len(values) >= 2 else None)


def other_text(cell: Cell, digits: int) -> str:
    """The other rule's mean ± std and its name, '' where the cell has no fused figure."""
    mean, std = _spread(cell.other_fusion)
    if mean is None or cell.fusion not in NAMES:
        return ""
    text = f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")
    return f"{text} · {NAMES[OTHER[cell.fusion]]}"


def record(cell: Cell) -> dict[str, object]:
    """A cell's fusion fields for JSON and CSV (None where it has no fused figure)."""
    mean, std = _spread(cell.other_fusion)
    rule = cell.fusion
    return {"fusion": rule, "other_fusion": OTHER.get(rule) if rule else None, "other_fusion_mean": mean,
            "other_fusion_std": std}

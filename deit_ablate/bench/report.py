"""Benchmark figures, side-by-side comparisons, the printed table and the JSON file."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deit_ablate.core.atomic import write_text_atomic


@dataclass
class Figure:
    """One measured quantity of one variant, with everything needed to reproduce it."""

    name: str  # what was measured, e.g. "train_step"
    variant: str  # "ours", "timm", "ours+fast_jpeg", ...
    value: float  # the median over `samples`
    unit: str
    device: str
    command: str
    settings: dict[str, Any]
    samples: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # secondary figures (per worker, data-wait fraction, ...)


@dataclass
class Comparison:
    """value(variant) / value(reference) for one measurement; higher is better for ours."""

    name: str
    variant: str
    reference: str
    ratio: float  # median(variant) / median(reference)
    target: float | None = None
    paired_ratios: list[float] = field(default_factory=list)  # repeat i of one over repeat i of the other

    @property
    def meets(self) -> bool | None:
        return None if self.target is None else self.ratio >= self.target


def median(values: list[float]) -> float:
    """The median of a non-empty list."""
    return float(statistics.median(values))


class Report:
    """Figures and comparisons gathered by one bench invocation."""

    def __init__(self, device: dict[str, Any], command: str) -> None:
        self.device = device
        self.command = command
        self.figures: list[Figure] = []
        self.comparisons: list[Comparison] = []
        self.notes: list[str] = []

    def add(self, figure: Figure) -> Figure:
        """Record a figure and return it."""
        self.figures.append(figure)
        return figure

    def get(self, name: str, variant: str) -> Figure | None:
        """The figure `name` of `variant`, if measured."""
        return next((f for f in self.figures if f.name == name and f.variant == variant), None)

    def compare(self, name: str, variant: str, reference: str, target: float | None = None,
                lower_is_better: bool = False) -> Comparison | None:
        """Add value(variant)/value(reference) (inverted for times) when both were measured."""
        a, b = self.get(name, variant), self.get(name, reference)
        if a is None or b is None or a.value <= 0 or b.value <= 0:
            return None
        ratio = b.value / a.value if lower_is_better else a.value / b.value
        pairs = list(zip(a.samples, b.samples, strict=False))
        paired = [(y / x if lower_is_better else x / y) for x, y in pairs if x > 0 and y > 0]
        comparison = Comparison(name, variant, reference, ratio, target, [round(r, 3) for r in paired])
        self.comparisons.append(comparison)
        return comparison

    def to_json(self) -> dict[str, Any]:
        """Everything as plain JSON types."""
        return {"device": self.device, "command": self.command, "figures": [asdict(f) for f in self.figures],
                "comparisons": [{**asdict(c), "meets_target": c.meets} for c in self.comparisons],
                "notes": self.notes}

    def write(self, path: str | Path) -> None:
        """Write the JSON file."""
        write_text_atomic(path, json.dumps(self.to_json(), indent=2, default=str) + "\n")

    def table(self) -> str:
        """A fixed-width table of the figures, then one of the comparisons."""
        lines = [f"device: {self.device.get('summary', '?')}", "",
                 f"{'measurement':<26} {'variant':<24} {'value':>10} {'unit':<10} {'n':>3}  extra"]
        lines.append("-" * len(lines[-1]))
        for f in self.figures:
            extra = ", ".join(f"{k}={_short(v)}" for k, v in f.extra.items() if not isinstance(v, (list, dict)))
            value = _short(f.value)
            lines.append(f"{f.name:<26} {f.variant:<24} {value:>10} {f.unit:<10} {len(f.samples):>3}  {extra}")
        if self.comparisons:
            lines += ["", f"{'comparison':<26} {'variant / reference':<40} {'ratio':>7} {'target':>7}  ok   paired"]
            lines.append("-" * len(lines[-1]))
            for c in self.comparisons:
                target = f">={c.target:g}" if c.target is not None else ""
                ok = {True: "yes", False: "NO", None: ""}[c.meets]
                paired = " ".join(f"{r:.2f}" for r in c.paired_ratios)
                lines.append(f"{c.name:<26} {c.variant + ' / ' + c.reference:<40} {c.ratio:>7.2f} {target:>7}  "
                             f"{ok:<4} {paired}")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)

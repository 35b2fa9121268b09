"""The valid range of a numeric schema key, declared with the field (`ranged`, `fraction`) and checked by
validate.check_ranges."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# The largest image side a key may ask for: every image is resized to it, so a side of 200,000 px allocates
# 120 GB per image before anything fails (DeiT and its follow-ups train and evaluate at 224-448 px).
MAX_SIDE = 2048
SIDE_HINT = f"a side in pixels, at most {MAX_SIDE}"


@dataclass(frozen=True)
class Range:
    """The values a numeric key takes: finite, between its bounds (each closed or open, or none); each item of a
    list key the same. `hint` says what the number means, for the message."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    hint: str = ""

    def holds(self, value: float) -> bool:
        """Whether `value` lies in the range."""
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high}"
        return "a finite number"


def ranged(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, hint: str = "") -> Any:
    """A numeric schema field with its valid range (`ge`/`gt`: the lower bound, closed/open; `le`/`lt`: the upper);
    validate.check_ranges checks every such field (null, where the type allows it, is not checked)."""
    bounds = Range(low=gt if gt is not None else ge, high=lt if lt is not None else le, low_open=gt is not None,
                   high_open=lt is not None, hint=hint)
    return field(default=default, metadata={"range": bounds})


def fraction(default: float, hint: str = "") -> Any:
    """A probability or fraction: a numeric field in [0, 1]."""
    return ranged(default, ge=0, le=1, hint=hint)


# The numbers of timm's auto-augment policy strings (augment.auto_augment, validate.check_auto_augment) that set how
# often an op runs per image: each is a loop, so unbounded they stall a loader worker (rand-m9-n1000000: no step in
# 25 s). The magnitudes (m, mmax) need none: timm clamps them.
POLICY_RANGES: dict[str, dict[str, Range]] = {
    "rand": {"n": Range(low=0, high=16, hint="RandAugment's ops per image (DeiT: 2)")},
    "augmix": {"w": Range(low=1, high=16, hint="AugMix's chains per image (default 3)"),
               "d": Range(low=0, high=16, hint="the ops of each AugMix chain (0: 1-3 at random)")},
}

"""Seed noise: Welch's t interval of a row's Δ to its baseline, and the seeds a paper's Δ would need (the t and
normal quantiles from scipy.stats)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats

NO_SPREAD = "n=1, no spread"  # an arm with one seed: no variance, so no interval
ZERO_SPREAD = "s=0, no spread"  # every seed of both arms gave the same value: ν is undefined
LEVEL = 0.95
POWER = 0.8


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p for Student's t with `df` (> 0, not necessarily whole) degrees of freedom."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    return float(stats.t.ppf(p, df))


def z_quantile(p: float) -> float:
    """The standard normal quantile."""
    return float(stats.norm.ppf(p))


@dataclass(frozen=True)
class Interval:
    """Welch's interval of a difference of means; `why` says why there is none (low and high are then None)."""

    delta: float
    n: tuple[int, int]  # seeds of the row, of its baseline
    se: float | None = None
    df: float | None = None
    low: float | None = None
    high: float | None = None
    why: str = ""

    @property
    def contains_zero(self) -> bool | None:
        """Whether the interval holds 0 (the Δ cannot be told from zero); None without an interval."""
        if self.low is None or self.high is None:
            return None
        return self.low <= 0.0 <= self.high


def welch(a: Sequence[float], b: Sequence[float], level: float = LEVEL) -> Interval | None:
    """mean(a) - mean(b) ± t_{(1+level)/2, ν} · sqrt(s_a²/n_a + s_b²/n_b), ν by Welch–Satterthwaite;
    None when an arm is empty."""
    if not a or not b:
        return None
    n = (len(a), len(b))
    delta = statistics.fmean(a) - statistics.fmean(b)
    if min(n) < 2:
        return Interval(delta, n, why=NO_SPREAD)
    va, vb = statistics.variance(a) / n[0], statistics.variance(b) / n[1]
    if va + vb == 0.0:
        return Interval(delta, n, se=0.0, why=ZERO_SPREAD)
    df = (va + vb) ** 2 / (va**2 / (n[0] - 1) + vb**2 / (n[1] - 1))
    se = math.sqrt(va + vb)
    half = t_quantile(0.5 + level / 2.0, df) * se
    return Interval(delta, n, se, df, delta - half, delta + half)


def pooled_std(a: Sequence[float], b: Sequence[float]) -> float | None:
    """sqrt(((n_a - 1) s_a² + (n_b - 1) s_b²) / (n_a + n_b - 2)); None with fewer than one degree of freedom."""
    dof = len(a) + len(b) - 2
    if dof < 1:
        return None
    squares = sum((len(x) - 1) * statistics.variance(x) for x in (a, b) if len(x) >= 2)
    return math.sqrt(squares / dof)


def seeds_needed(s: float, delta: float, alpha: float = 1 - LEVEL, power: float = POWER) -> float | None:
    """Seeds per arm to resolve `delta` at spread `s`: n = 2 (z_{1-α/2} + z_power)² s² / Δ²; None for Δ = 0."""
    if delta == 0:
        return None
    return 2.0 * (z_quantile(1.0 - alpha / 2.0) + z_quantile(power)) ** 2 * s * s / (delta * delta)

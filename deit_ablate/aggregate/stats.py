"""Seed noise: Welch's t interval of a row's Δ to its baseline, and the seeds a paper's Δ would need.

The t quantile is computed here (scipy is not a dependency): Student's t cdf through the regularized
incomplete beta function, evaluated by its continued fraction (DLMF 8.17.22) with the modified Lentz method,
and inverted by bisection. The normal quantiles come from the standard library (`statistics.NormalDist`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

NO_SPREAD = "n=1, no spread"  # an arm with one seed: no variance, so no interval
ZERO_SPREAD = "s=0, no spread"  # every seed of both arms gave the same value: ν is undefined
LEVEL = 0.95
POWER = 0.8
_EPS = 1e-15
_TINY = 1e-300
_MAX_TERMS = 10_000


def _fraction_term(m: int, a: float, b: float, x: float) -> float:
    """The m-th partial numerator d_m of the incomplete beta's continued fraction (m >= 1)."""
    k = m // 2
    if m % 2:
        return -(a + k) * (a + b + k) * x / ((a + 2 * k) * (a + 2 * k + 1))
    return k * (b - k) * x / ((a + 2 * k - 1) * (a + 2 * k))


def _beta_fraction(a: float, b: float, x: float) -> float:
    """1 / (1 + d_1 / (1 + d_2 / (1 + ...))) by the modified Lentz method."""
    f = c = _TINY
    d = 0.0
    for j in range(1, _MAX_TERMS):
        numerator = 1.0 if j == 1 else _fraction_term(j - 1, a, b, x)
        d = 1.0 + numerator * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + numerator / c
        c = c if abs(c) > _TINY else _TINY
        f *= c * d
        if abs(c * d - 1.0) < _EPS:
            return f
    raise ArithmeticError(f"incomplete beta fraction did not converge (a={a}, b={b}, x={x})")


def beta_inc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast only below this point
        return 1.0 - beta_inc(b, a, 1.0 - x)
    log_beta = math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)
    front = math.exp(a * math.log(x) + b * math.log1p(-x) - log_beta) / a
    return front * _beta_fraction(a, b, x)


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` (> 0, not necessarily whole) degrees of freedom."""
    tail = 0.5 * beta_inc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p, for 0 < p < 1 and df > 0 (bisection on the cdf)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, high * 2.0
    while high - low > 1e-12 * max(1.0, high):
        mid = (low + high) / 2.0
        low, high = (mid, high) if t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2.0


def z_quantile(p: float) -> float:
    """The standard normal quantile."""
    return statistics.NormalDist().inv_cdf(p)


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

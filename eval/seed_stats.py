"""Statistics across training seeds: is method A better than method B, as a method, not as one checkpoint?

A method claim's noise is the training seed: two runs of one method differ (data order, sampling, the guard's
choices) by as much as two methods may. So the unit of inference is the seed: each seed trains every method from the
same start with the same prompts and sampling seeds, and gives one paired difference d_s = metric(A, s) - metric(B, s).
(McNemar over questions, eval/paired.py, tests the other noise: which questions were drawn, given two fixed
checkpoints. It says nothing about the method when each method has one seed.)

    exact sign-flip test   under "A and B are the same method", each d_s is as likely to be -d_s; the p value is the
                           share of the 2^n sign assignments whose |sum| is at least the observed |sum| (two-sided).
                           Exact, not mid-p: assignments tying the observed |sum| count as extreme, so the test never
                           rejects more often than its level. Its smallest value is 2 / 2^m for m non-zero
                           differences (a zero difference flips to itself): 0.0625 for 5 seeds, 0.0078 for 8. With
                           5 seeds no comparison can reach p < 0.05, however large the effect.
    bootstrap interval     percentile interval of the mean over resamples of the seeds with replacement; exact (all
                           n^n ordered resamples, each once) when n^n <= `resamples`, else `resamples` draws from a
                           seeded generator: deterministic either way. With few seeds it is too narrow (a 5-seed
                           resample never sees a sixth seed's value): read it as a description, the test as the test.
    Holm                   step-down adjustment over a family declared before the results (Holm 1979): the i-th
                           smallest of m p values is multiplied by m - i + 1, then made monotone. Controls the
                           family-wise error rate under any dependence between the comparisons.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

MAX_SIGN_FLIP_N = 24  # 2^24 sums (128 MiB of float64): beyond this, enumerate no more


def _checked(values: Sequence[float], name: str) -> np.ndarray:
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError(f"{name} must be a non-empty list of numbers, got {values!r}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must be finite, got {list(x)}")
    return x


def sign_flip_sums(differences: Sequence[float]) -> np.ndarray:
    """sum_s sign_s * d_s for every one of the 2^n sign assignments (the test's null distribution, each equally
    likely), built one seed at a time so that n = 20 is a million floats rather than a 2^n x n sign matrix."""
    x = _checked(differences, "differences")
    if len(x) > MAX_SIGN_FLIP_N:
        raise ValueError(f"differences: {len(x)} seeds is more than the {MAX_SIGN_FLIP_N} the exact test enumerates")
    sums = np.zeros(1)
    for d in x:
        sums = np.concatenate([sums + d, sums - d])
    return sums


def sign_flip_p(differences: Sequence[float]) -> float:
    """Two-sided exact paired sign-flip (permutation) p value of the mean difference: the share of sign assignments
    with |sum| >= |observed sum| (ties count as extreme: exact, not mid-p). 1.0 when every difference is 0."""
    x = _checked(differences, "differences")
    sums = sign_flip_sums(x)
    # Equal sums reached by adding in another order can differ in the last bits: a tie within rounding is a tie.
    tolerance = 1e-9 * max(1.0, float(np.abs(x).sum()))
    return float(np.mean(np.abs(sums) >= abs(float(x.sum())) - tolerance))


def smallest_sign_flip_p(nonzero: int) -> float:
    """The smallest p value the two-sided exact sign-flip test can give on `nonzero` non-zero differences: 2 / 2^n
    (every difference of one sign), 1 for none."""
    if nonzero < 0:
        raise ValueError(f"nonzero must be >= 0, got {nonzero}")
    return min(1.0, 2.0 / 2**nonzero)


def bootstrap_interval(values: Sequence[float], level: float = 0.95, resamples: int = 10_000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (one per seed): exact over all n^n ordered resamples
    when there are at most `resamples` of them, else over `resamples` seeded draws."""
    x = _checked(values, "values")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    n = len(x)
    if n**n <= resamples:
        # Every index tuple once: row i of the grid is the base-n digits of i.
        indices = np.array(list(itertools.product(range(n), repeat=n)))
    else:
        indices = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    means = x[indices].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p values, in the order given: compare each to the family's level (reject where
    adjusted <= alpha). The i-th smallest (from 1) is max over j <= i of min(1, (m - j + 1) * p_(j))."""
    p = np.asarray(p_values, dtype=float)
    if p.ndim != 1:
        raise ValueError(f"p_values must be a flat list, got {p_values!r}")
    bad = [i for i, v in enumerate(p) if not 0 <= v <= 1]  # NaN fails both comparisons
    if bad:
        raise ValueError(f"p_values must lie in [0, 1]: index {bad[0]} is {p[bad[0]]}")
    m = len(p)
    order = np.argsort(p, kind="stable")
    adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adjusted
    return [float(v) for v in out]


@dataclass(frozen=True)
class SeedComparison:
    """A - B paired by seed."""

    seeds: tuple[int, ...]
    differences: tuple[float, ...]  # per seed, in `seeds`' order
    mean: float
    ci: tuple[float, float]  # bootstrap percentile interval of the mean difference
    p_value: float  # exact two-sided sign-flip
    smallest_possible_p: float  # what the test could give at best on these seeds (2 / 2^non-zero differences)
    wins: int  # seeds where A - B > 0
    losses: int
    ties: int


def paired_seeds(a: Mapping[int, float], b: Mapping[int, float], level: float = 0.95,
                 resamples: int = 10_000, seed: int = 0) -> SeedComparison:
    """A - B on the same seeds (dicts seed -> metric): mean, bootstrap interval, exact sign-flip p, wins."""
    if a.keys() != b.keys():
        raise ValueError(f"paired seeds need the same seeds: {sorted(a.keys() - b.keys())} only in the first, "
                         f"{sorted(b.keys() - a.keys())} only in the second")
    seeds = tuple(sorted(a))
    d = np.array([a[s] - b[s] for s in seeds], dtype=float)
    return SeedComparison(
        seeds=seeds, differences=tuple(float(v) for v in d), mean=float(d.mean()),
        ci=bootstrap_interval(d, level, resamples, seed), p_value=sign_flip_p(d),
        smallest_possible_p=smallest_sign_flip_p(int(np.count_nonzero(d))),
        wins=int((d > 0).sum()), losses=int((d < 0).sum()), ties=int((d == 0).sum()))


def mean_interval(values: Sequence[float], level: float = 0.95, resamples: int = 10_000,
                  seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high) of one method's metric across seeds, the interval a bootstrap percentile one."""
    x = _checked(values, "values")
    return (float(x.mean()), *bootstrap_interval(x, level, resamples, seed))


def format_p(p: float) -> str:
    """p values as the reports print them: three significant digits, and never "0.000"."""
    if math.isnan(p):
        return "-"
    return "< 0.001" if p < 1e-3 else f"{p:.3g}"

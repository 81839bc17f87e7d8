"""Statistics across seeds: the exact sign-flip test against enumeration in exact (Fraction) arithmetic and hand
counts, the bootstrap interval against a slow loop over every resample, Holm against its rejection rule."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest

from eval.seed_stats import (
    MAX_SIGN_FLIP_N,
    bootstrap_interval,
    holm,
    mean_interval,
    paired_seeds,
    sign_flip_p,
    smallest_sign_flip_p,
)


def enumerated_sign_flip_p(differences: list[Fraction]) -> Fraction:
    """The test's definition in exact arithmetic: the share of the 2^n sign assignments whose |sum| is at least the
    observed |sum|."""
    observed = abs(sum(differences))
    extreme = sum(abs(sum(s * d for s, d in zip(signs, differences, strict=True))) >= observed
                  for signs in itertools.product((1, -1), repeat=len(differences)))
    return Fraction(extreme, 2 ** len(differences))


def test_sign_flip_hand_counts():
    # +-1 +-2 +-3: sums 6 4 2 0 0 -2 -4 -6; |sum| >= 6 twice in 8.
    assert sign_flip_p([1, 2, 3]) == 2 / 8
    # observed 3 - 1 + 2 = 4: 6, 4, -4, -6 reach it.
    assert sign_flip_p([3, -1, 2]) == 4 / 8
    # Five seeds all one way: the smallest p the test can give on 5 seeds.
    assert sign_flip_p([0.5, 0.7, 0.6, 0.8, 0.1]) == 2 / 32 == smallest_sign_flip_p(5)
    # Four large wins and one small loss: only all-plus and the observed assignment reach the observed sum (and
    # their mirror images): 4 / 32, whatever the large values are.
    assert sign_flip_p([0.9, 0.7, 0.6, 0.8, -0.005]) == 4 / 32
    assert sign_flip_p([1, -1]) == 1.0  # sum 0: every assignment is at least as extreme


def test_zero_differences_flip_to_themselves():
    assert sign_flip_p([0, 0, 0]) == 1.0
    # A zero doubles every count and the number of assignments: p as without it.
    assert sign_flip_p([0.3, 0.0, 0.2, 0.0, 0.1]) == sign_flip_p([0.3, 0.2, 0.1]) == 2 / 8
    assert smallest_sign_flip_p(0) == 1.0 and smallest_sign_flip_p(3) == 0.25
    assert smallest_sign_flip_p(8) == pytest.approx(0.0078125)


def test_sums_equal_in_exact_arithmetic_tie_in_floats():
    # -0.1 - 0.2 + 0.3 is 5.6e-17 in floats, 0 in exact arithmetic: every assignment ties it.
    assert sign_flip_p([-0.1, -0.2, 0.3]) == 1.0
    # 0.1 + 0.2 (0.30000000000000004) ties 0.3: {0.3, -0.1, -0.2} and its mirror are as extreme as observed.
    assert sign_flip_p([0.3, 0.1, 0.2]) == float(enumerated_sign_flip_p([Fraction(3, 10), Fraction(1, 10),
                                                                          Fraction(2, 10)]))


@pytest.mark.parametrize("n", range(1, 9))
def test_sign_flip_equals_exact_enumeration(n):
    rng = np.random.default_rng(n)
    for _ in range(40):
        # Held-out EM differences on 200 questions are multiples of 1/200, with ties and zeros among them.
        counts = rng.integers(-6, 7, size=n)
        exact = [Fraction(int(k), 200) for k in counts]
        assert sign_flip_p([k / 200 for k in counts]) == float(enumerated_sign_flip_p(exact))


def test_sign_flip_is_two_sided_and_never_below_its_floor():
    rng = np.random.default_rng(0)
    for n in range(1, 11):
        d = rng.normal(0.3, 1, size=n)
        assert sign_flip_p(d) == sign_flip_p(-d)
        assert sign_flip_p(d) >= smallest_sign_flip_p(n)


def test_sign_flip_refuses_bad_input():
    with pytest.raises(ValueError, match="differences"):
        sign_flip_p([])
    with pytest.raises(ValueError, match="finite"):
        sign_flip_p([0.1, float("nan")])
    with pytest.raises(ValueError, match=str(MAX_SIGN_FLIP_N)):
        sign_flip_p([0.1] * (MAX_SIGN_FLIP_N + 1))


def slow_bootstrap_interval(values: list[float], level: float) -> tuple[float, float]:
    """Every ordered resample once, its mean, then the linear-interpolation percentile written out."""
    means = sorted(sum(values[i] for i in idx) / len(values)
                   for idx in itertools.product(range(len(values)), repeat=len(values)))

    def percentile(q: float) -> float:
        h = (len(means) - 1) * q
        lo = int(h)
        return means[lo] + (h - lo) * (means[min(lo + 1, len(means) - 1)] - means[lo])

    return percentile((1 - level) / 2), percentile(1 - (1 - level) / 2)


def test_bootstrap_hand_case():
    # [0, 1]: resample means 0, 0.5, 0.5, 1; the 2.5th percentile interpolates 0.075 of the way from 0 to 0.5.
    low, high = bootstrap_interval([0.0, 1.0])
    assert low == pytest.approx(0.0375) and high == pytest.approx(0.9625)
    assert bootstrap_interval([0.4, 0.4, 0.4]) == (pytest.approx(0.4), pytest.approx(0.4))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_bootstrap_is_exact_over_every_resample_when_there_are_few(n):
    rng = np.random.default_rng(10 + n)
    values = list(rng.integers(0, 200, size=n) / 200)
    for level in (0.9, 0.95):
        assert bootstrap_interval(values, level) == pytest.approx(slow_bootstrap_interval(values, level), abs=1e-12)


def test_bootstrap_draws_are_seeded_and_near_the_exact_interval():
    values = [0.92, 0.2, 0.15, 0.97, 0.31]  # 3,125 resamples: 3,000 draws are a Monte Carlo estimate
    drawn = bootstrap_interval(values, resamples=3000, seed=1)
    assert drawn == bootstrap_interval(values, resamples=3000, seed=1)
    assert drawn == pytest.approx(bootstrap_interval(values), abs=0.03)  # the exact one: resamples 10,000 >= 3,125
    many = list(np.random.default_rng(0).normal(size=12))
    assert bootstrap_interval(many) == bootstrap_interval(many)  # 12^12 resamples: drawn, deterministically


def test_bootstrap_refuses_bad_input():
    with pytest.raises(ValueError, match="level"):
        bootstrap_interval([0.1, 0.2], level=1.5)
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_interval([0.1, 0.2], resamples=0)
    with pytest.raises(ValueError, match="values"):
        bootstrap_interval([])


def holm_rejects(p: list[float], alpha: float) -> list[bool]:
    """Holm's procedure as stated: walk the p values from the smallest; reject while p_(i) <= alpha / (m - i + 1)."""
    m = len(p)
    rejected = [False] * m
    for rank, i in enumerate(sorted(range(m), key=lambda j: p[j])):
        if p[i] > alpha / (m - rank):
            break
        rejected[i] = True
    return rejected


def test_holm_hand_case():
    # Sorted 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> monotone 0.06.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.2]) == [0.2]
    assert holm([0.5, 0.6]) == [1.0, 1.0]
    assert holm([]) == []


def test_holm_adjusted_p_rejects_exactly_what_the_procedure_rejects():
    rng = np.random.default_rng(0)
    for m in range(1, 9):
        for _ in range(50):
            p = list(np.round(rng.uniform(0, 0.2, size=m) ** 2, 4))  # rounding makes ties
            adjusted = holm(p)
            for alpha in (0.001, 0.005, 0.01, 0.02, 0.05, 0.1):
                assert [a <= alpha for a in adjusted] == holm_rejects(p, alpha), (p, alpha)


def test_holm_over_sixty_five_seed_comparisons_leaves_nothing():
    # The mechanism study's family: 60 comparisons on 5 seeds. Even at the sign-flip test's floor, 60 x 0.0625 > 1.
    assert holm([smallest_sign_flip_p(5)] * 60) == [1.0] * 60


def test_holm_refuses_p_values_outside_zero_one():
    with pytest.raises(ValueError, match="index 1"):
        holm([0.1, 1.2])
    with pytest.raises(ValueError, match="index 0"):
        holm([float("nan")])


def test_paired_seeds():
    a = {0: 0.9, 1: 0.8, 2: 0.5, 3: 0.7}
    b = {3: 0.6, 2: 0.5, 1: 0.9, 0: 0.2}
    r = paired_seeds(a, b)
    assert r.seeds == (0, 1, 2, 3)
    assert r.differences == pytest.approx((0.7, -0.1, 0.0, 0.1))
    assert r.mean == pytest.approx(0.175) and (r.wins, r.losses, r.ties) == (2, 1, 1)
    assert r.p_value == sign_flip_p([0.7, -0.1, 0.0, 0.1]) and r.smallest_possible_p == 0.25
    assert r.ci[0] <= r.mean <= r.ci[1]
    with pytest.raises(ValueError, match=r"same seeds: \[4\] only in the first"):
        paired_seeds({**a, 4: 0.1}, b)
    mean, low, high = mean_interval([0.2, 0.4])
    assert mean == pytest.approx(0.3) and (low, high) == bootstrap_interval([0.2, 0.4])

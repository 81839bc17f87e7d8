"""Paired EM statistics: the exact McNemar p value against enumeration and hand-computed cases, the Agresti-Min
interval against hand arithmetic and its coverage, and per-question results read back from trajectory files."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from agent.trajectory import Trajectory, save_jsonl
from eval.paired import mcnemar_exact_p, paired_difference_interval, paired_em, per_question_em


def enumerated_two_sided_p(a_only: int, b_only: int) -> Fraction:
    """The exact test's definition: the probability, under Binomial(k, 1/2), of every outcome no likelier than the
    observed one."""
    k = a_only + b_only
    observed = math.comb(k, a_only)
    return sum((Fraction(math.comb(k, x), 2**k) for x in range(k + 1) if math.comb(k, x) <= observed), Fraction(0))


def test_mcnemar_p_is_one_when_the_models_never_disagree():
    assert mcnemar_exact_p(0, 0) == 1.0
    same = {f"nq/test/{i}": i % 3 == 0 for i in range(30)}
    result = paired_em(same, dict(same))
    assert (result.a_only, result.b_only, result.difference, result.p_value) == (0, 0, 0.0, 1.0)


def test_mcnemar_p_matches_hand_computed_binomial_tails():
    # 1 vs 9 discordant: 2 * P(X <= 1 | Bin(10, 1/2)) = 2 * (1 + 10) / 1024.
    assert mcnemar_exact_p(1, 9) == pytest.approx(22 / 1024, rel=1e-12)
    assert mcnemar_exact_p(9, 1) == pytest.approx(22 / 1024, rel=1e-12)
    # 0 vs 5: 2 * (1/2)^5.
    assert mcnemar_exact_p(0, 5) == pytest.approx(2 / 32, rel=1e-12)
    # 7 gained, 2 lost (`make compare` in docs/history/benchmarks-2026.md): 2 * (1 + 9 + 36) / 512 = 0.1797.
    assert mcnemar_exact_p(7, 2) == pytest.approx(92 / 512, rel=1e-12)
    assert mcnemar_exact_p(3, 3) == 1.0


@pytest.mark.parametrize("k", range(1, 16))
def test_mcnemar_p_equals_exact_enumeration(k):
    for a_only in range(k + 1):
        expected = float(min(Fraction(1), enumerated_two_sided_p(a_only, k - a_only)))
        assert mcnemar_exact_p(a_only, k - a_only) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_interval_matches_hand_arithmetic():
    # n = 10, 3 vs 1 discordant: cells + 1/2 over n + 2 = 12: p12 = 3.5/12, p21 = 1.5/12, d = 2/12,
    # var = (5/12 - (2/12)^2) / 12 = 0.0324074, se = 0.1800206.
    low, high = paired_difference_interval(3, 1, 10)
    assert low == pytest.approx(2 / 12 - 1.96 * 0.1800206, abs=1e-6)
    assert high == pytest.approx(2 / 12 + 1.96 * 0.1800206, abs=1e-6)
    # No discordant questions: an interval around 0 of non-zero width (plain Wald would be [0, 0]).
    low, high = paired_difference_interval(0, 0, 100)
    assert low == pytest.approx(-high) and 0 < high < 0.05


def test_interval_covers_the_true_difference_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    n, trials = 1000, 4000
    p_a_only, p_b_only = 0.04, 0.02  # the true EM difference is 0.02
    cells = rng.multinomial(n, [p_a_only, p_b_only, 1 - p_a_only - p_b_only], size=trials)
    covered = 0
    for a_only, b_only, _ in cells:
        low, high = paired_difference_interval(int(a_only), int(b_only), n)
        covered += low <= p_a_only - p_b_only <= high
    assert 0.93 <= covered / trials <= 0.97


def test_paired_em_counts_discordant_questions_by_id_not_position():
    a = {"nq/test/1": True, "nq/test/2": True, "triviaqa/test/5": False, "triviaqa/test/9": True}
    b = {"triviaqa/test/9": True, "triviaqa/test/5": True, "nq/test/2": False, "nq/test/1": True}  # other order
    result = paired_em(a, b)
    assert (result.n, result.a_only, result.b_only) == (4, 1, 1)
    assert result.em_a == result.em_b == 0.75 and result.difference == 0.0 and result.p_value == 1.0
    with pytest.raises(ValueError, match="same questions"):
        paired_em(a, {**b, "nq/test/3": True})


def trajectory(example_id: str, question: str, answer: str | None, gold: str) -> Trajectory:
    return Trajectory(uid=f"{example_id}#0", group_id=example_id, question=question, golden_answers=[gold],
                      prompt_ids=[1], answer=answer)


def test_per_question_em_reads_each_datasets_trajectories_as_the_report_scored_them(tmp_path):
    # TriviaQA test really asks one question twice: the id, not the text, tells them apart.
    save_jsonl([trajectory("nq/test/0", "q0", "Paris", "paris"), trajectory("nq/test/4", "q4", None, "x")],
               tmp_path / "trajectories" / "nq.agent.jsonl")
    save_jsonl([trajectory("triviaqa/test/7", "same", "The Beatles", "Beatles"),
                trajectory("triviaqa/test/8", "same", "no", "yes")],
               tmp_path / "trajectories" / "triviaqa.agent.jsonl")
    save_jsonl([trajectory("nq/test/0", "q0", "wrong", "paris")], tmp_path / "trajectories" / "nq.direct.jsonl")
    correct = per_question_em(tmp_path)
    assert correct == {("nq/test/0", "q0"): True, ("nq/test/4", "q4"): False, ("triviaqa/test/7", "same"): True,
                       ("triviaqa/test/8", "same"): False}
    # Other data under the same ids (another source file) does not pair.
    save_jsonl([trajectory("nq/test/0", "other q0", "Paris", "paris"), trajectory("nq/test/4", "q4", None, "x")],
               tmp_path / "other" / "trajectories" / "nq.agent.jsonl")
    save_jsonl([trajectory("triviaqa/test/7", "same", "x", "Beatles"), trajectory("triviaqa/test/8", "same", "x", "y")],
               tmp_path / "other" / "trajectories" / "triviaqa.agent.jsonl")
    with pytest.raises(ValueError, match="same questions"):
        paired_em(correct, per_question_em(tmp_path / "other"))
    with pytest.raises(FileNotFoundError):
        per_question_em(tmp_path / "missing")

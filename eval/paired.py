"""Paired comparison of two models' exact match on the same held-out questions.

Two models answering the same questions are strongly correlated (most questions are easy or hard for both), so
their separate Wilson intervals overlap even when one of them is reliably better. The paired view uses each
question once: only the discordant questions (one model right, the other wrong) carry information about the
difference.

    difference in EM = (a_only - b_only) / n
    95% CI:          Wald after adding 1/2 to each of the four cells (Agresti & Min 2005, "Simple improved
                     confidence intervals for comparing matched proportions"): plain Wald collapses to zero width
                     when there are no discordant questions, this one does not
    p value:         exact McNemar test, two-sided: given k = a_only + b_only discordant questions, a_only is
                     Binomial(k, 1/2) under "equally good"

Per-question results are read from an evaluation's trajectory files and keyed by (example id, question), never by
position: the id ("nq/test/7": dataset, split and the question's index in its source file) is the same in every
evaluation of the same held-out set, where the position need not be; the text alone is not unique (TriviaQA test
asks one question twice), and with the id it makes two evaluations of different data under the same ids refuse to
pair instead of pairing wrong questions.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path

from agent.trajectory import load_jsonl
from eval.metrics import exact_match


@dataclass(frozen=True)
class PairedEM:
    n: int
    em_a: float
    em_b: float
    a_only: int  # questions model a got right and model b wrong
    b_only: int
    difference: float  # em_a - em_b
    ci95: tuple[float, float]
    p_value: float  # exact McNemar, two-sided


def mcnemar_exact_p(a_only: int, b_only: int) -> float:
    """Two-sided exact McNemar p value: the binomial test of a_only successes in a_only + b_only trials at 1/2."""
    from scipy.stats import binomtest

    discordant = a_only + b_only
    if discordant == 0:
        return 1.0  # nothing to tell the models apart
    return float(binomtest(a_only, discordant, 0.5).pvalue)


def paired_difference_interval(a_only: int, b_only: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% CI for em_a - em_b on n paired questions: Wald with 1/2 added to each cell (Agresti-Min)."""
    if n == 0:
        return (0.0, 0.0)
    a, b, total = a_only + 0.5, b_only + 0.5, n + 2
    centre = (a - b) / total
    half = z * math.sqrt((a + b) / total - centre**2) / math.sqrt(total)
    return (max(-1.0, centre - half), min(1.0, centre + half))


def paired_em(a: Mapping[Hashable, bool], b: Mapping[Hashable, bool]) -> PairedEM:
    """EM of a and b on the same questions (dicts keyed by question), their difference and its tests."""
    if a.keys() != b.keys():
        only_a, only_b = sorted(map(str, a.keys() - b.keys())), sorted(map(str, b.keys() - a.keys()))
        raise ValueError(f"paired EM needs the same questions: {len(only_a)} only in the first ({only_a[:3]}), "
                         f"{len(only_b)} only in the second ({only_b[:3]})")
    n = len(a)
    a_only = sum(a[key] and not b[key] for key in a)
    b_only = sum(b[key] and not a[key] for key in a)
    em_a, em_b = sum(a.values()) / max(1, n), sum(b.values()) / max(1, n)
    return PairedEM(n=n, em_a=em_a, em_b=em_b, a_only=a_only, b_only=b_only, difference=em_a - em_b,
                    ci95=paired_difference_interval(a_only, b_only, n), p_value=mcnemar_exact_p(a_only, b_only))


def per_question_em(eval_dir: Path, mode: str = "agent") -> dict[tuple[str, str], bool]:
    """(example id, question) -> exact match of every question an evaluation (eval.harness.evaluate's out_dir)
    answered in `mode`, read from its trajectories/<dataset>.<mode>.jsonl and scored as the report scored them."""
    correct: dict[tuple[str, str], bool] = {}
    files = sorted((Path(eval_dir) / "trajectories").glob(f"*.{mode}.jsonl"))
    if not files:
        raise FileNotFoundError(f"no {mode}-mode trajectories under {Path(eval_dir) / 'trajectories'}")
    for path in files:
        for trajectory in load_jsonl(path):
            key = (trajectory.group_id, trajectory.question)
            if key in correct:
                raise ValueError(f"{path}: question {trajectory.group_id} answered twice")
            correct[key] = bool(exact_match(trajectory.answer, trajectory.golden_answers))
    return correct

"""Answer metrics with FlashRAG's (= SQuAD's) semantics. EM is the RL reward; cover-EM and F1 are reported only.
Answers are compared after data.qa.normalize_answer (there, so that the agent's demonstrations use it too).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from data.qa import normalize_answer

_YES_NO = {"yes", "no", "noanswer"}


def exact_match(prediction: str | None, golden_answers: Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer; no prediction scores 0."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golden_answers))


def cover_exact_match(prediction: str | None, golden_answers: Iterable[str]) -> float:
    """1.0 if any normalised gold answer is a substring of the normalised prediction (FlashRAG's sub-EM)."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(g) in pred for g in golden_answers))


def f1(prediction: str | None, golden_answers: Iterable[str]) -> float:
    """Token-level F1, the max over gold answers. As in FlashRAG, a yes/no/noanswer on either side scores only
    when both are the same word (token overlap would otherwise reward "no" against "yes no")."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    best = 0.0
    for gold in golden_answers:
        ref = normalize_answer(gold)
        if (pred in _YES_NO or ref in _YES_NO) and pred != ref:
            continue
        pred_tokens, ref_tokens = pred.split(), ref.split()
        same = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
        if same == 0:
            continue
        precision, recall = same / len(pred_tokens), same / len(ref_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best

"""EM / cover-EM / F1 against FlashRAG's semantics, written out by hand for tricky strings."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from data.qa import normalize_answer
from eval.metrics import cover_exact_match, exact_match, f1


@pytest.mark.parametrize(
    "raw,normalized",
    [
        ("The Beatles!", "beatles"),
        ("  a  Tale of Two   Cities. ", "tale of two cities"),
        ("theatre", "theatre"),  # "the" only as a whole word
        ("an-apple", "anapple"),  # punctuation is deleted before articles are matched
        ("U.S.A.", "usa"),
        ("Beyoncé", "beyoncé"),  # non-ASCII letters stay
        ("“Smart quotes”", "“smart quotes”"),  # only ASCII punctuation is removed, like FlashRAG
        ("Ａ", "ａ"),  # fullwidth is not ASCII: kept (lowercased)
        ("the.", ""),
        ("", ""),
    ],
)
def test_normalize_answer(raw, normalized):
    assert normalize_answer(raw) == normalized


def test_exact_match():
    assert exact_match("The Eiffel Tower.", ["eiffel tower"]) == 1.0
    assert exact_match("Eiffel", ["eiffel tower"]) == 0.0
    assert exact_match("paris", ["London", "Paris"]) == 1.0
    assert exact_match(None, ["x"]) == 0.0
    assert exact_match("", [""]) == 1.0  # both normalise to the empty string
    assert exact_match("x", []) == 0.0


def test_cover_exact_match():
    assert cover_exact_match("It was Jane Austen, in 1813", ["jane austen"]) == 1.0
    assert cover_exact_match("Austen", ["Jane Austen"]) == 0.0
    assert cover_exact_match(None, ["x"]) == 0.0


def test_f1():
    assert f1("Jane Austen", ["Austen"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert f1("the cat sat", ["cat sat on mat"]) == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert f1("yes", ["no"]) == 0.0
    assert f1("no", ["yes no"]) == 0.0
    assert f1("yes", ["yes"]) == 1.0
    assert f1("", ["a"]) == 0.0
    assert f1("paris france", ["london", "paris"]) == pytest.approx(2 / 3)


@given(st.text(max_size=30), st.lists(st.text(max_size=30), max_size=3))
def test_metric_invariants(pred, golds):
    em, cover, score = exact_match(pred, golds), cover_exact_match(pred, golds), f1(pred, golds)
    assert em in (0.0, 1.0) and cover in (0.0, 1.0) and 0.0 <= score <= 1.0
    assert cover >= em  # an exact match is also covered
    if em and normalize_answer(pred):
        assert score == 1.0
    assert normalize_answer(normalize_answer(pred)) == normalize_answer(pred)

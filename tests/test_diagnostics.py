"""The mechanism diagnostics on constructed batches, against counts worked out by hand: the repeated-search rate
(agent/diagnostics.py) and the share of equal-reward groups (trainer/advantages.py)."""

from __future__ import annotations

import pytest

from agent.diagnostics import normalize_query, repeated_search_rates, repeated_searches
from agent.trajectory import Trajectory, Turn
from trainer.advantages import zero_variance_share


def search(query: str | None, doc_ids: list[str]) -> Turn:
    return Turn("search", 0, 0, "stop", query=query, doc_ids=doc_ids)


def answer() -> Turn:
    return Turn("answer", 0, 0, "stop")


def trajectory(*turns: Turn) -> Trajectory:
    return Trajectory("g#0", "g", "q", ["a"], [1], turns=list(turns))


def test_normalize_query_folds_case_punctuation_and_whitespace():
    assert normalize_query("  Who WROTE\tHamlet? ") == "who wrote hamlet"
    assert normalize_query("U.S.A. capital") == "usa capital"
    assert normalize_query("Beyoncé's album") == "beyoncés album"  # non-ASCII letters stay
    assert normalize_query("") == ""


def test_a_search_repeats_an_earlier_query_or_the_same_documents():
    hamlet = trajectory(
        search("Who wrote Hamlet?", ["1", "2", "3"]),
        search("who wrote  hamlet", ["4", "5"]),  # the first's query, normalised: repeated
        search("author of hamlet", ["3", "2", "1"]),  # the first's documents in another order: repeated
        search("Who wrote Hamlet", ["1", "2", "3"]),  # both at once: one repeat, not two
        answer(),
    )
    assert repeated_searches(hamlet) == 3
    failed = trajectory(search("a", []), search("b", []), answer())  # no documents match nothing
    assert repeated_searches(failed) == 0
    same_documents = trajectory(search("paris", ["7"]), search("london", ["7"]))
    assert repeated_searches(same_documents) == 1
    # Only search turns count: an invalid turn and the final turn (search disabled) are not searches.
    other_turns = trajectory(search("x", ["7"]), Turn("invalid", 0, 0, "stop"), Turn("final", 0, 0, "length"))
    assert repeated_searches(other_turns) == 0
    assert repeated_searches(trajectory(answer())) == 0


def test_repeated_search_rates_over_a_batch():
    batch = [
        trajectory(search("q1", ["1"]), search("Q1", ["2"]), search("q3", ["1"]), answer()),  # 3 searches, 2 repeat
        trajectory(search("a", []), search("b", []), answer()),  # 2 searches, none repeat
        trajectory(answer()),  # none
        trajectory(search("x", ["9"]), answer()),  # 1 search
    ]
    rate, with_repeats = repeated_search_rates(batch)
    assert rate == pytest.approx(2 / 6)  # repeated searches / all searches
    assert with_repeats == pytest.approx(1 / 4)  # trajectories with at least one
    assert repeated_search_rates([trajectory(answer())]) == (0.0, 0.0)
    assert repeated_search_rates([]) == (0.0, 0.0)


def test_zero_variance_share_counts_groups_whose_rewards_are_all_equal():
    rewards = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5]
    groups = ["a", "a", "b", "b", "c", "c", "d"]  # a: all 1, b: mixed, c: all 0, d: a singleton
    assert zero_variance_share(rewards, groups) == pytest.approx(3 / 4)
    assert zero_variance_share([0.0, 1.0], ["a", "a"]) == 0.0
    assert zero_variance_share([0.2, 0.2, 1.2, 0.2], ["a", "b", "a", "b"]) == pytest.approx(1 / 2)  # interleaved
    assert zero_variance_share([], []) == 0.0
    with pytest.raises(ValueError):
        zero_variance_share([1.0], ["a", "b"])

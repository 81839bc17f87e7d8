"""Rewards by name (`reward.name`): eval's own metrics, an unknown name refused naming the field."""

from __future__ import annotations

import pytest

from agent.trajectory import Trajectory, Turn
from eval.metrics import exact_match, f1
from trainer.config import ConfigError, load_config
from trainer.reward import REWARDS, Score, reward

GOLD = ["Leonardo da Vinci", "da Vinci"]


def answered(answer: str | None, invalid: bool = False) -> Trajectory:
    turns = [Turn("invalid", 0, 1, "stop")] * invalid + [Turn("answer", 1, 2, "stop")]
    return Trajectory("g#0", "g", "q", GOLD, [1], turns=turns, answer=answer)


def test_rewards_are_evals_metrics():
    assert REWARDS.names() == ("em", "f1") and REWARDS.get("em") is exact_match and REWARDS.get("f1") is f1


@pytest.mark.parametrize("answer", ["Leonardo da Vinci", "Leonardo", "the painter Leonardo", "Michelangelo", "", None])
def test_f1_reward_is_eval_f1_with_em_logged_apart(answer):
    score = reward(answered(answer), 0.25, "f1")
    assert score == Score(reward=f1(answer, GOLD) + 0.25, em=exact_match(answer, GOLD), format=1.0)
    assert reward(answered(answer, invalid=True), 0.25, "f1").reward == f1(answer, GOLD)


def test_f1_gives_partial_credit_where_em_gives_none():
    # "Leonardo" against "Leonardo da Vinci": precision 1, recall 1/3, F1 = 2 x 1/3 / (4/3) = 1/2.
    assert reward(answered("Leonardo"), name="f1").reward == pytest.approx(0.5)
    assert reward(answered("Leonardo")).reward == 0.0  # the default: EM
    assert reward(answered("Leonardo da Vinci")) == Score(reward=1.0, em=1.0, format=1.0)


def test_reward_name_in_the_config():
    assert load_config().reward.name == "em"
    assert load_config(overrides=["reward.name=f1"]).reward.name == "f1"
    with pytest.raises(ConfigError, match=r"reward\.name: .*unknown reward 'bleu'; registered: em, f1"):
        load_config(overrides=["reward.name=bleu"])

"""Rewards. A reward scores the last <answer> (from the model's own turns) against the gold answers with one of eval's
metrics, chosen by name (`reward.name`: em, the default and the paper's, or f1); an optional format bonus helps a
small model find the protocol. EM and the format are logged apart, whatever the reward, so reports show EM alone.

The metrics are eval.metrics' own functions, registered here by name (REWARDS), so the reward and the evaluation
score an answer the same way. Adding one is one line: `REWARDS.add("name", metric)`, with metric(prediction,
golden_answers) -> float in [0, 1].
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from agent.trajectory import Trajectory
from eval.metrics import exact_match, f1
from trainer.registry import Registry

# (prediction or None, golden answers) -> reward in [0, 1]. Filled right here, where the config finds it (importing
# this module costs no torch), so no name is declared ahead of its registration.
REWARDS: Registry[Callable[[str | None, Iterable[str]], float]] = Registry("reward", "trainer.reward", {})
REWARDS.add("em", exact_match)
REWARDS.add("f1", f1)


@dataclass(frozen=True)
class Score:
    """One trajectory's score. Only `reward` drives learning (the advantages); `em` and `format` are logged."""

    reward: float
    em: float  # exact match of the answer, 0 or 1
    format: float  # 1.0 for a well-formed trajectory (protocol followed, an answer given), else 0.0


def reward(traj: Trajectory, format_bonus: float = 0.0, name: str = "em") -> Score:
    """reward = REWARDS[name](answer, gold) + format_bonus * well_formed. The bonus is < 1 (config-checked), so a
    correct answer always outscores a well-formed wrong one."""
    em = exact_match(traj.answer, traj.golden_answers)
    fmt = float(traj.well_formed)
    return Score(reward=REWARDS.get(name)(traj.answer, traj.golden_answers) + format_bonus * fmt, em=em, format=fmt)

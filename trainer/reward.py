"""Rewards. EM of the last <answer> (from the model's own turns) against any gold answer is the RL reward; an
optional format bonus helps a small model find the protocol. It is logged apart so reports show EM alone."""

from __future__ import annotations

from dataclasses import dataclass

from agent.trajectory import Trajectory
from eval.metrics import exact_match


@dataclass(frozen=True)
class Score:
    """One trajectory's score. Only `reward` drives learning (the advantages); `em` and `format` are logged."""

    reward: float
    em: float  # exact match of the answer, 0 or 1
    format: float  # 1.0 for a well-formed trajectory (protocol followed, an answer given), else 0.0


def reward(traj: Trajectory, format_bonus: float = 0.0) -> Score:
    """reward = em + format_bonus * well_formed. The bonus is < 1 (config-checked), so a correct answer always
    outscores a well-formed wrong one."""
    em = exact_match(traj.answer, traj.golden_answers)
    fmt = float(traj.well_formed)
    return Score(reward=em + format_bonus * fmt, em=em, format=fmt)

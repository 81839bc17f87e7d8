"""Rewards. EM of the last <answer> (from the model's own turns) against any gold answer is the RL reward; an
optional format bonus helps a small model find the protocol. It is logged apart so reports show EM alone."""

from __future__ import annotations

from agent.trajectory import Trajectory
from eval.metrics import exact_match


def reward(traj: Trajectory, format_bonus: float = 0.0) -> tuple[float, float, float]:
    """(reward, em, format) with reward = em + format_bonus * well_formed. The bonus is < 1 (config-checked), so
    a correct answer always outscores a well-formed wrong one."""
    em = exact_match(traj.answer, traj.golden_answers)
    fmt = float(traj.well_formed)
    return em + format_bonus * fmt, em, fmt

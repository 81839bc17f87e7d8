"""An iteration's scores: each trajectory's reward (trainer.reward: `reward.name` plus the format bonus) and the
advantages over its group (`train.advantage`, group id = example id). The training loop and the viewer (`emapg view`)
both call this one function, so a run's rollouts are shown scored as they were trained."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from agent.trajectory import Trajectory
from trainer.config import TrainConfig
from trainer.registry import ADVANTAGE_ESTIMATORS
from trainer.reward import Score, reward

RewardFn = Callable[[Trajectory], Score]


@dataclass(frozen=True)
class Scored:
    scores: list[Score]
    advantages: Tensor  # (N,), one per trajectory


def score_rollouts(trajs: list[Trajectory], cfg: TrainConfig, reward_fn: RewardFn | None = None) -> Scored:
    """Rewards by the config (or `reward_fn`, which must return a Score), then the configured advantages."""
    reward_fn = reward_fn or (lambda traj: reward(traj, cfg.reward.format, cfg.reward.name))
    scores = [reward_fn(traj) for traj in trajs]
    wrong = next((s for s in scores if not isinstance(s, Score)), None)
    if wrong is not None:
        raise TypeError(f"reward_fn must return trainer.reward.Score(reward, em, format), got {wrong!r}")
    estimator = ADVANTAGE_ESTIMATORS.get(cfg.train.advantage)
    advantages = estimator(torch.tensor([s.reward for s in scores]), [traj.group_id for traj in trajs],
                           normalize_std=cfg.train.normalize_adv_std)
    return Scored(scores, advantages)

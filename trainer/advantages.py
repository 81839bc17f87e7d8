"""GRPO advantages: each rollout's reward relative to the other rollouts of the same prompt instance (and two
counts of the groups that teach nothing, logged every iteration).

    A_i = (R_i - mean_group) / (std_group + eps)        GRPO
    A_i =  R_i - mean_group                             Dr. GRPO (normalize_std=False)

The std is the SAMPLE std (Bessel's correction, divide by n - 1), as in verl's `compute_grpo_outcome_advantage`
(`torch.std`, unbiased by default), which Search-R1 and the paper's code build on; a group of rewards {0, 0, 0, 1}
gives A = (-0.5, -0.5, -0.5, 1.5), not the population std's (-0.58, ..., 1.73).

Groups with one member or zero variance carry no learning signal and get exactly 0 (verl instead gives a singleton
A = R / (1 + eps)). The test for zero variance is max == min, not std == 0: the mean of three rewards of 0.1
rounds to 0.10000000000000002, so R - mean would be a tiny non-zero number divided by eps.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor

from trainer.registry import register_advantage_estimator


def group_index(group_ids: list[str]) -> Tensor:
    """Map each string id to a dense integer, in order of first appearance. Groups need not be contiguous."""
    dense: dict[str, int] = {}
    return torch.tensor([dense.setdefault(gid, len(dense)) for gid in group_ids], dtype=torch.long)


@register_advantage_estimator("grpo")
def grpo_advantages(
    rewards: Tensor, group_ids: list[str], *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Per-rollout advantages (N,) from rewards (N,) and one group id per rollout (e.g. "nq/test/7").

    Rollouts are grouped by string equality of `group_ids`, so ids must be unique per prompt instance: "nq/test/7"
    and "hotpotqa/test/7" are different groups. The std is the sample std (n - 1), see the module docstring.
    """
    if rewards.dim() != 1 or rewards.shape[0] != len(group_ids):
        raise ValueError(f"need rewards (N,) and N group ids; got {tuple(rewards.shape)} and {len(group_ids)} ids")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if len(group_ids) == 0:
        return rewards.clone()
    group = group_index(group_ids).to(rewards.device)
    num_groups = int(group.max()) + 1

    def per_group(reduce: str, values: Tensor) -> Tensor:
        out = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
        include_self = reduce == "sum"  # amax/amin must not see the zeros we start from
        return out.scatter_reduce(0, group, values, reduce=reduce, include_self=include_self)

    count = per_group("sum", torch.ones_like(rewards))
    mean = per_group("sum", rewards) / count
    centered = rewards - mean[group]
    # A group is informative only if its rewards differ; this covers singletons (max == min) too.
    informative = (per_group("amax", rewards) > per_group("amin", rewards))[group]

    if normalize_std:
        sum_sq = per_group("sum", centered.square())
        std = (sum_sq / (count - 1).clamp_min(1)).sqrt()  # sample std; clamp only guards singletons, masked below
        advantages = centered / (std[group] + eps)
    else:
        advantages = centered
    return torch.where(informative, advantages, torch.zeros_like(advantages))


def broadcast_to_tokens(advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """(N,) sequence advantages -> (N, T) token advantages: A_i on the model's own tokens, 0 elsewhere."""
    if advantages.dim() != 1 or loss_mask.dim() != 2 or loss_mask.shape[0] != advantages.shape[0]:
        shapes = f"{tuple(advantages.shape)} and {tuple(loss_mask.shape)}"
        raise ValueError(f"need advantages (N,) and loss_mask (N, T); got {shapes}")
    zero = torch.zeros((), dtype=advantages.dtype, device=advantages.device)
    return torch.where(loss_mask.bool(), advantages[:, None], zero)


def zero_variance_share(rewards: Sequence[float], group_ids: Sequence[str]) -> float:
    """Share of groups whose rewards are all equal: GRPO gives every member advantage 0, so they teach nothing (a
    group of one included). 0.0 for no groups."""
    groups: dict[str, list[float]] = defaultdict(list)
    for reward, group in zip(rewards, group_ids, strict=True):
        groups[group].append(reward)
    return sum(max(g) == min(g) for g in groups.values()) / max(1, len(groups))


def zero_advantage_groups(advantages: Tensor, group_ids: list) -> int:
    """How many groups have every advantage exactly 0 (all rewards equal under GRPO): they add no policy gradient."""
    groups: dict = {}
    for advantage, group in zip(advantages.tolist(), group_ids, strict=True):
        groups[group] = groups.get(group, True) and advantage == 0.0
    return sum(groups.values())

"""Per-iteration diagnostics of the GRPO signal (the repeated-search rate, which eval/ reports too, is in
agent/diagnostics.py; the KL term's share of the gradient, `kl/grad_share`, comes from the learner)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence


def zero_variance_share(rewards: Sequence[float], group_ids: Sequence[str]) -> float:
    """Share of groups whose rewards are all equal: GRPO gives every member advantage 0, so they teach nothing (a
    group of one included). 0.0 for no groups."""
    groups: dict[str, list[float]] = defaultdict(list)
    for reward, group in zip(rewards, group_ids, strict=True):
        groups[group].append(reward)
    return sum(max(g) == min(g) for g in groups.values()) / max(1, len(groups))

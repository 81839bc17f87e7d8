"""GRPO advantages against a plain-loop reference: string group ids, non-contiguous groups, sample std."""

from __future__ import annotations

import math
import random

import pytest
import torch

from trainer.advantages import broadcast_to_tokens, grpo_advantages

EPS = 1e-6


def reference_advantages(rewards: list[float], group_ids: list[str], normalize_std: bool = True) -> list[float]:
    """Written out plainly: for each rollout, look at every rollout with the same id."""
    out = []
    for i, gid in enumerate(group_ids):
        members = [r for r, g in zip(rewards, group_ids) if g == gid]
        if len(members) == 1 or max(members) == min(members):
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        if not normalize_std:
            out.append(rewards[i] - mean)
            continue
        std = math.sqrt(sum((r - mean) ** 2 for r in members) / (len(members) - 1))  # sample std
        out.append((rewards[i] - mean) / (std + EPS))
    return out


def shuffled_batch(seed: int) -> tuple[list[float], list[str]]:
    """Groups of varied sizes from two datasets sharing indices, interleaved at random."""
    rng = random.Random(seed)
    ids = []
    for dataset in ("nq/test", "hotpotqa/test"):
        for index in range(6):
            ids += [f"{dataset}/{index}"] * rng.choice([1, 2, 3, 5])
    rng.shuffle(ids)
    rewards = [rng.choice([0.0, 1.0, rng.random()]) for _ in ids]
    return rewards, ids


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_matches_loop_reference_on_shuffled_string_groups(seed, normalize_std):
    rewards, ids = shuffled_batch(seed)
    got = grpo_advantages(torch.tensor(rewards, dtype=torch.float64), ids, normalize_std=normalize_std)
    want = torch.tensor(reference_advantages(rewards, ids, normalize_std), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_same_index_in_different_datasets_is_a_different_group():
    ids = ["nq/test/7", "hotpotqa/test/7", "nq/test/7", "hotpotqa/test/7"]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    # Each dataset's group is constant, so no signal; keyed by the bare index "7" they would be +-0.87.
    assert torch.equal(grpo_advantages(rewards, ids), torch.zeros(4))


def test_sample_std_with_bessel_correction():
    # {0, 0, 0, 1}: mean 0.25, sample std sqrt(0.75 / 3) = 0.5 (population std would give 1.73 for the 1).
    got = grpo_advantages(torch.tensor([0.0, 0.0, 1.0, 0.0]), ["g"] * 4, eps=0.0)
    assert torch.allclose(got, torch.tensor([-0.5, -0.5, 1.5, -0.5]))


def test_zero_variance_and_singleton_groups_give_exactly_zero():
    # 0.1 three times: the float mean is 0.10000000000000002, so R - mean alone would not be exactly 0.
    ids = ["a", "b", "a", "c", "a", "b"]
    rewards = torch.tensor([0.1, 1.0, 0.1, 0.7, 0.1, 1.0], dtype=torch.float64)
    for normalize_std in (True, False):
        got = grpo_advantages(rewards, ids, normalize_std=normalize_std)
        assert torch.equal(got, torch.zeros(6, dtype=torch.float64))


def test_dr_grpo_subtracts_the_group_mean_only():
    got = grpo_advantages(torch.tensor([3.0, 1.0, 5.0, 2.0]), ["x", "x", "y", "y"], normalize_std=False)
    assert torch.equal(got, torch.tensor([1.0, -1.0, 1.5, -1.5]))


def test_integer_rewards_and_empty_batch():
    got = grpo_advantages(torch.tensor([1, 0]), ["g", "g"])
    assert got.dtype == torch.get_default_dtype()
    assert got[0] > 0 > got[1]
    assert grpo_advantages(torch.zeros(0), []).shape == (0,)


def test_length_mismatch_is_refused():
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(3), ["a", "b"])


def test_broadcast_to_tokens_puts_a_on_model_tokens_only():
    advantages = torch.tensor([0.5, -2.0, 0.0])
    loss_mask = torch.tensor([[0, 1, 1, 0, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    got = broadcast_to_tokens(advantages, loss_mask)
    want = torch.zeros(3, 5)
    for i in range(3):
        for t in range(5):
            if loss_mask[i, t]:
                want[i, t] = advantages[i]
    assert torch.equal(got, want)
    assert torch.equal(broadcast_to_tokens(advantages, loss_mask.bool()), want)

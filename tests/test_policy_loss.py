"""PPO clip loss against a per-token loop reference: both aggregations, clip fraction, exact zero gradient on mask."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.policy_loss import masked_mean, ppo_clip_loss

CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def reference_loss(logprob, old_logprob, advantages, loss_mask, aggregation):
    """Per-token loop with scalar torch ops (so autograd gives the reference gradient too)."""
    n, t_max = loss_mask.shape
    seq_losses, token_losses, clipped, ratios, kls = [], [], 0, [], []
    for i in range(n):
        row = []
        for t in range(t_max):
            if not loss_mask[i, t]:
                continue
            ratio = torch.exp(logprob[i, t] - old_logprob[i, t])
            a = float(advantages[i, t])
            r = ratio.item()
            r_clipped = min(max(r, 1 - CLIP_LOW), 1 + CLIP_HIGH)
            if -a * r_clipped > -a * r:  # the clipped term is the max: a constant, no gradient
                row.append(torch.tensor(-a * r_clipped, dtype=torch.float32))
                clipped += 1
            else:
                row.append(-a * ratio)
            ratios.append(r)
            kls.append((old_logprob[i, t] - logprob[i, t]).item())
        token_losses += row
        if row:
            seq_losses.append(sum(row) / len(row))
    loss = sum(token_losses) / len(token_losses) if aggregation == "token-mean" else sum(seq_losses) / len(seq_losses)
    stats = {
        "clip_fraction": clipped / len(token_losses),
        "approx_kl_old": sum(kls) / len(kls),
        "ratio_mean": sum(ratios) / len(ratios),
    }
    return loss, stats


def random_batch(seed: int, n: int = 5, t_max: int = 9):
    g = torch.Generator().manual_seed(seed)
    old_logprob = -torch.rand(n, t_max, generator=g) * 3
    logprob = old_logprob + torch.randn(n, t_max, generator=g) * 0.3  # ratios from ~0.4 to ~2.5: many clip
    advantages = torch.randn(n, 1, generator=g).expand(n, t_max).clone()
    loss_mask = torch.rand(n, t_max, generator=g) < 0.6
    loss_mask[0] = False  # a sequence without model tokens: left out of the sequence mean
    loss_mask[1, 0] = True
    return logprob, old_logprob, advantages, loss_mask


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("seed", range(3))
def test_matches_per_token_loop_reference(seed, aggregation):
    logprob, old_logprob, advantages, loss_mask = random_batch(seed)
    logprob_ref = logprob.clone().requires_grad_(True)
    logprob.requires_grad_(True)

    loss, stats = ppo_clip_loss(logprob, old_logprob, advantages, loss_mask, aggregation=aggregation)
    want_loss, want_stats = reference_loss(logprob_ref, old_logprob, advantages, loss_mask, aggregation)
    torch.testing.assert_close(loss, want_loss.float(), rtol=1e-5, atol=1e-6)

    loss.backward()
    want_loss.backward()
    torch.testing.assert_close(logprob.grad, logprob_ref.grad, rtol=1e-5, atol=1e-7)

    assert 0 < want_stats["clip_fraction"] < 1, "the batch should exercise both branches"
    for key, want in want_stats.items():
        assert float(stats[key]) == pytest.approx(want, rel=1e-5, abs=1e-7), key
        assert not stats[key].requires_grad


def test_aggregations_differ_by_sequence_weighting():
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert float(masked_mean(x, mask, "token-mean")) == pytest.approx((4 * 1.0 + 5.0) / 5)
    assert float(masked_mean(x, mask, "seq-mean-token-mean")) == pytest.approx((1.0 + 5.0) / 2)
    assert float(masked_mean(x, torch.zeros_like(mask), "token-mean")) == 0.0
    assert float(masked_mean(x, torch.zeros_like(mask), "seq-mean-token-mean")) == 0.0
    with pytest.raises(ValueError):
        masked_mean(x, mask, "sum")  # type: ignore[arg-type]


def test_clip_fraction_counts_only_the_active_clipped_branch():
    # ratio, advantage -> is the clipped term the active (max) one?
    cases = [
        (1.50, +1.0, True),  # above 1 + 0.28 with A > 0: clipped
        (1.25, +1.0, False),  # inside the asymmetric upper bound
        (0.50, -1.0, True),  # below 1 - 0.2 with A < 0: clipped
        (0.50, +1.0, False),  # below the bound but A > 0: the unclipped term is the worse one
        (1.50, -1.0, False),  # above the bound but A < 0: unclipped stays active (no upper limit on the loss)
        (3.00, 0.0, False),  # A = 0: both terms are 0
    ]
    ratio = torch.tensor([[r for r, _, _ in cases]])
    advantages = torch.tensor([[a for _, a, _ in cases]])
    logprob = torch.log(ratio).requires_grad_(True)
    loss, stats = ppo_clip_loss(logprob, torch.zeros_like(logprob), advantages, torch.ones_like(ratio))
    assert float(stats["clip_fraction"]) == pytest.approx(2 / 6)
    loss.backward()
    expected_zero_grad = torch.tensor([[c or a == 0 for _, a, c in cases]])
    assert torch.equal(logprob.grad == 0, expected_zero_grad)


def test_masked_tokens_get_exactly_zero_gradient_even_with_extreme_values():
    logprob, old_logprob, advantages, loss_mask = random_batch(7)
    # Extreme but finite values where the mask is 0: exp(-0.001 + 500) overflows fp32, and a 0/1 multiply
    # would then give 0 * inf = NaN in the backward pass.
    logprob = torch.where(loss_mask, logprob, torch.full_like(logprob, -1e-3))
    old_logprob = torch.where(loss_mask, old_logprob, torch.full_like(old_logprob, -500.0))
    advantages = torch.where(loss_mask, advantages, torch.full_like(advantages, -1e30))
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        leaf = logprob.clone().requires_grad_(True)
        loss, stats = ppo_clip_loss(leaf, old_logprob, advantages, loss_mask, aggregation=aggregation)
        loss.backward()
        assert math.isfinite(loss.item()) and all(math.isfinite(float(v)) for v in stats.values())
        assert torch.isfinite(leaf.grad).all()
        assert (leaf.grad[~loss_mask] == 0.0).all()
        assert (leaf.grad[loss_mask] != 0.0).any()


def test_bf16_logprobs_flow_gradient_in_their_own_dtype():
    logprob, old_logprob, advantages, loss_mask = random_batch(3)
    leaf = logprob.bfloat16().requires_grad_(True)
    loss, _ = ppo_clip_loss(leaf, old_logprob.bfloat16(), advantages, loss_mask)
    loss.backward()
    assert loss.dtype == torch.float32 and leaf.grad.dtype == torch.bfloat16
    assert (leaf.grad[~loss_mask] == 0).all()

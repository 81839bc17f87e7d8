"""PPO clipped policy-gradient loss with asymmetric clip bounds (DAPO's clip-higher), aggregated over `loss_mask`.

Per token t of a trajectory (only the model's own tokens count: `loss_mask` is 0 on prompt, observation and pad):

    rho_t  = pi_theta(a_t) / pi_old(a_t) = exp(logprob_t - old_logprob_t)
    loss_t = max(-A rho_t, -A clip(rho_t, 1 - clip_low, 1 + clip_high))

Masked positions never enter the arithmetic: they are replaced by a constant with `torch.where` before the ratio,
so their gradient is exactly 0 even if they hold extreme log-probs (multiplying by a 0/1 mask would turn an
overflowed exp into 0 * inf = NaN in the backward pass).
"""

from __future__ import annotations

import torch
from torch import Tensor

from trainer.registry import LOSS_AGGREGATIONS, register_loss_aggregation


def masked_tokens(mask: Tensor) -> Tensor:
    return mask.sum()


def non_empty_sequences(mask: Tensor) -> Tensor:
    return (mask.sum(dim=-1) > 0).sum()


@register_loss_aggregation("token-mean", count=masked_tokens)
def token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of x over all masked tokens / number of masked tokens (every token weighs the same: long trajectories
    weigh more)."""
    return x.sum() / masked_tokens(mask).clamp_min(1)


@register_loss_aggregation("seq-mean-token-mean", count=non_empty_sequences)
def seq_mean_token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean over sequences of each sequence's own token-mean (every trajectory weighs the same); sequences with no
    masked token are left out."""
    tokens_per_seq = mask.sum(dim=-1)
    seq_means = x.sum(dim=-1) / tokens_per_seq.clamp_min(1)
    return seq_means[tokens_per_seq > 0].sum() / non_empty_sequences(mask).clamp_min(1)


def masked_mean(x: Tensor, mask: Tensor, aggregation: str = "token-mean") -> Tensor:
    """Mean of x (N, T) over positions where mask (N, T) is set, by a registered loss aggregation; a scalar.
    An empty mask gives 0 (with zero gradient), not NaN.

    For gradient accumulation over micro-batches, weight each micro-batch's value by its share of the mini-batch's
    `count` (trainer.registry.LossAggregation: masked tokens for "token-mean", non-empty sequences for
    "seq-mean-token-mean").
    """
    reduce = LOSS_AGGREGATIONS.get(aggregation).reduce
    mask = mask.bool()
    return reduce(torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)), mask)


def ppo_clip_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    aggregation: str = "token-mean",
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clip loss over (N, T) token tensors; returns (scalar loss, detached stats).

    logprob:     log pi_theta of each sampled token (carries the gradient)
    old_logprob: log pi_old, the sampling policy's log-prob (no gradient)
    advantages:  per-token advantages (N, T), e.g. `broadcast_to_tokens(grpo_advantages(...), loss_mask)`
    token_weights: detached (N, T) weights on each token's loss before aggregation (truncated importance sampling,
                 trainer/rollout_correction.py); None: all 1
    stats (token-means over the mask, whatever `aggregation` is):
      clip_fraction: share of tokens where the clipped term is the active one (its gradient is 0 there)
      approx_kl_old: mean of old_logprob - logprob (k1 estimate of KL(pi_old || pi_theta))
      ratio_mean:    mean of rho
    """
    mask = loss_mask.bool()
    # float32 math whatever the model dtype: exp of a bf16 log-ratio is too coarse near 1.
    log_ratio = torch.where(mask, logprob.float() - old_logprob.float().detach(), torch.zeros((), device=mask.device))
    ratio = torch.exp(log_ratio)
    advantages = advantages.float().detach()

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token_loss = torch.maximum(unclipped, clipped)  # pessimistic bound: take the worse of the two
    if token_weights is not None:
        per_token_loss = per_token_loss * token_weights.detach()
    loss = masked_mean(per_token_loss, mask, aggregation)

    with torch.no_grad():
        clip_active = (clipped > unclipped).float()
        stats = {
            "clip_fraction": masked_mean(clip_active, mask),
            "approx_kl_old": masked_mean(-log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats

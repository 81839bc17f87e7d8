"""Truncated importance sampling (TIS) for the rollout-learner mismatch.

The rollout engine samples from its own copy of the policy, q (vLLM kernels, bf16 weights), while the PPO loss takes
the expectation under pi_old, the learner's log-probs of the same weights. When they differ, the policy gradient
E_q[A grad log pi] is not the one PPO means, E_pi_old[A grad log pi]. Reweighting each sampled token by
pi_old / q makes it so; capping that weight at C trades a little bias (tokens q favours far less than pi_old) for
bounded variance (Yao et al., "Your efficient RL framework secretly brings you off-policy RL training", 2025; verl's
`tis_imp_ratio_cap`). The weight is detached: it rescales each token's policy-gradient term, never differentiated.

    token level:     w_t = min(pi_old(a_t) / q(a_t), C)
    sequence level:  w   = min(prod_t pi_old(a_t) / q(a_t), C), the same for every token of the trajectory

Off by default (`train.tis_cap: null`): with the CPU engines here in fp32 the gap is ~1e-3 nats a token
(`loss/sampler_trainer_logprob_gap_mean`) and the correction is a no-op in expectation; turn it on for bf16 engines
on GPUs, where the gap is larger.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

TISLevel = Literal["token", "sequence"]


@torch.no_grad()
def truncated_is_weights(old_logprob: Tensor, sampler_logprob: Tensor, mask: Tensor, cap: float,
                         level: TISLevel = "token") -> Tensor:
    """(N, T) detached weights min(pi_old / q, cap) at the masked (model) tokens, 1 elsewhere; at `level` "sequence"
    the ratio is the product over each trajectory's model tokens. Log-space, in float32 (float64 input stays)."""
    mask = mask.bool()
    dtype = torch.promote_types(old_logprob.dtype, torch.float32)
    log_ratio = torch.where(mask, old_logprob.to(dtype) - sampler_logprob.to(dtype), torch.zeros((), dtype=dtype,
                                                                                                  device=mask.device))
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    weights = torch.exp(log_ratio).clamp(max=cap)
    return torch.where(mask, weights, torch.ones((), dtype=dtype, device=mask.device))

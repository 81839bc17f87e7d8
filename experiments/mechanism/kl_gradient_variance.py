"""The KL gradient's mean and variance over the sampled token, exactly, at given states (the estimators of
docs/algorithm.md §4).

At a state (one position of a trajectory) the policy has logits z (V,), the anchor pi_ref, the sampling policy
pi_old. The KL term of the loss is an estimator f(p; z) of the sampled token p ~ pi_old (trainer/kl.py), and its
gradient with respect to the state's logits, g(p) = grad_z f(p; z), is a random vector. This module returns, with
p enumerated over the whole vocabulary (no sampling),

    mean      E_p[g(p)]                    (V,)  what the estimator's gradient is on average (its bias: mean - grad KL)
    variance  E_p ||g(p) - E_p[g(p)]||^2   ()    the trace of its covariance: the noise one sampled token adds

Logit space, not parameter space: the parameter gradient is the same linear map (the network's Jacobian at that
state) of g(p) for every estimator, so this compares the estimators themselves, with no model in the way.

How it stays exact at V = 49,152 without V x V gradients. Every estimator in trainer/kl.py depends on z only through
the log-probs of the head ids H (top-k; empty for the sampled kinds) and of p. So g(p) lives in a small space:

    g(p) = sum_{j in H u {p}} u_j (e_j - pi) = v(p) + rho(p) pi,   v supported on H u {p}

and the estimator can be evaluated on a reduced vocabulary of k + 2 slots [H..., p, rest] whose logits are the true
log-probs of H and p and the log of the remaining mass: the same log-probs, so the same value, and its gradient
in slot s is g(p) at the token of slot s, while the rest slot's gradient, divided by the rest mass, is rho(p). The
estimator itself (trainer/kl.py's `topk_kl` / `sampled_kl`) is what runs, on V rows of k + 2 logits per state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.kl import SAMPLED_KL_KINDS, exact_kl, gather_logprobs, sampled_kl, topk_kl

ESTIMATORS = ("topk", *SAMPLED_KL_KINDS)
_ABSENT_LOGIT = -1e4  # the p slot when p is already in the head: no mass, finite (kl.py assumes finite logits)
_TINY = 1e-300  # floor of the rest mass, so its log stays finite (float64)


@dataclass(frozen=True)
class GradientMoments:
    mean: Tensor  # (N, V) E_p[g(p)], float64
    variance: Tensor  # (N,) E_p ||g(p) - mean||^2, float64
    true_gradient: Tensor  # (N, V) grad_z KL(direction), the exact gradient the estimator is meant to follow

    @property
    def bias(self) -> Tensor:
        """(N,) ||E_p[g(p)] - grad KL||."""
        return (self.mean - self.true_gradient).norm(dim=-1)


def kl_gradient_moments(
    logits: Tensor, ref_logits: Tensor, estimator: str, *, old_logits: Tensor | None = None, topk: int = 32,
    direction: str = "reverse", importance_weight: bool = True, iw_clip: float | None = None,
) -> GradientMoments:
    """Exact mean and variance of one estimator's per-token gradient at N states: logits (N, V) of the policy,
    ref_logits (N, V) of the anchor, old_logits (N, V) of the sampling policy (default: the policy itself, as on the
    first PPO epoch). The estimator's inputs are made as the learner makes them: head ids = top-k of the sampling
    policy (reverse) or of the anchor (forward); the importance weight s = sg(pi / pi_old) when `importance_weight`.
    For the sampled kinds (k1..k5) `topk` and `direction` are not used; `direction` picks the true gradient."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be (N, V), got shape {tuple(logits.shape)}")
    old_logits = logits if old_logits is None else old_logits
    for name, other in (("ref_logits", ref_logits), ("old_logits", old_logits)):
        if other.shape != logits.shape:
            raise ValueError(f"{name} has shape {tuple(other.shape)}, expected {tuple(logits.shape)} (logits')")
    k = topk if estimator == "topk" else 0
    if not 0 <= k <= logits.shape[1]:
        raise ValueError(f"topk must be in [0, V = {logits.shape[1]}], got {k}")
    means, variances = [], []
    for z, ref, old in zip(logits.detach(), ref_logits.detach(), old_logits.detach(), strict=True):
        head_source = old if direction == "reverse" else ref
        head = head_source.topk(k).indices if k else torch.zeros(0, dtype=torch.long)
        mean, variance = _state_moments(z, ref, old, head, estimator, direction, importance_weight, iw_clip)
        means.append(mean)
        variances.append(variance)
    return GradientMoments(torch.stack(means), torch.stack(variances), true_kl_gradient(logits, ref_logits, direction))


def true_kl_gradient(logits: Tensor, ref_logits: Tensor, direction: str) -> Tensor:
    """(N, V) grad_z of the exact KL (trainer/kl.py's `exact_kl`), float64."""
    z = logits.detach().float().requires_grad_()
    (grad,) = torch.autograd.grad(exact_kl(z, ref_logits.detach(), direction).sum(), z)
    return grad.double()


def _state_moments(z: Tensor, ref: Tensor, old: Tensor, head: Tensor, estimator: str, direction: str,
                   importance_weight: bool, iw_clip: float | None) -> tuple[Tensor, Tensor]:
    """(mean (V,), variance ()) at one state; p enumerated over all V tokens, one row of k + 2 slots each."""
    vocab, k = z.shape[0], head.shape[0]
    logp = torch.log_softmax(z.double(), -1)
    ref_logp = torch.log_softmax(ref.double(), -1)
    old_logp = torch.log_softmax(old.double(), -1)
    pi, q = logp.exp(), old_logp.exp()  # the policy, and the sampling distribution of p

    tokens = torch.arange(vocab)
    in_head = torch.zeros(vocab, dtype=torch.bool)
    in_head[head] = True
    head_slot = torch.full((vocab,), k, dtype=torch.long)  # p's slot: its head position, or the p slot (k)
    head_slot[head] = torch.arange(k)
    outside_mass = pi[~in_head].sum()  # mass outside H, summed (not 1 - P_H: no cancellation)
    rest_mass = torch.where(in_head, outside_mass, outside_mass - pi).clamp(min=_TINY)

    # Reduced logits, (V rows, k + 2 slots): log pi on H, log pi(p) (absent when p is in H), log of the rest.
    reduced = torch.cat([
        logp[head].expand(vocab, k),
        torch.where(in_head, torch.full_like(logp, _ABSENT_LOGIT), logp)[:, None],
        rest_mass.log()[:, None],
    ], dim=1).requires_grad_()
    old_token = old_logp if importance_weight else None
    if estimator == "topk":
        values = topk_kl(
            reduced[None], ref_logp[head].expand(vocab, k)[None], ref_logp[None], torch.arange(k).expand(vocab, k)[None],
            head_slot[None], direction=direction, old_token_logprob=None if old_token is None else old_token[None],
            iw_clip=iw_clip,
        )[0]
    else:  # p's log-prob read off the reduced row (its normaliser is 1 up to rounding, as the learner's is)
        token_logprob = gather_logprobs(reduced, head_slot[:, None])[:, 0]
        values = sampled_kl(token_logprob, ref_logp, estimator, old_logprob=old_token)
    (slot_grad,) = torch.autograd.grad(values.sum(), reduced)  # rows are independent: row p is g(p) per slot
    slot_grad = slot_grad.double()

    slot_probs = reduced.detach().exp()  # pi at each slot's token (0 for an absent p slot), rest mass last
    rho = torch.where(slot_probs[:, -1] > 1e-30, slot_grad[:, -1] / slot_probs[:, -1], torch.zeros_like(pi))
    v = slot_grad[:, :-1] - rho[:, None] * slot_probs[:, :-1]  # (V, k + 1): g(p) = v(p) on H u {p} + rho(p) pi
    slot_tokens = torch.cat([head.expand(vocab, k), tokens[:, None]], dim=1)

    mean = (q * rho).sum() * pi
    mean.index_add_(0, head, (q[:, None] * v[:, :k]).sum(0))
    mean += q * v[:, k]
    v_dot_pi = (v * pi[slot_tokens]).sum(-1)
    # ||v||^2 over distinct coordinates: p's slot and its head slot never both hold a value (v is 0 in an absent slot).
    second_moment = (v.square().sum(-1) + 2 * rho * v_dot_pi + rho.square() * pi.square().sum())
    variance = (q * second_moment).sum() - mean.square().sum()
    return mean, variance.clamp(min=0.0)

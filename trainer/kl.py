"""Token-level KL estimators between the policy pi_theta and the anchor pi_ref (docs/algorithm.md §4).

Pure functions on per-token tensors: no masks, no reduction over tokens, no models. All math is in float32
whatever the input dtype. Gradients flow only through the policy's side (`logprob` / `logits`); everything
that belongs to the anchor or to the sampling policy pi_old is detached here, whatever the caller passes.

Notation, for a sampled token p (a constant: sampling is not differentiated):
    log w = log pi_ref(p) - log pi_theta(p)
    r     = pi_theta(p) / sg(pi_theta(p))     value 1, gradient = grad log pi_theta(p)
    s     = sg(pi_theta(p) / pi_old(p))       importance weight when p was drawn from pi_old, not pi_theta

"Expected gradient" below means E_p[grad estimator(p)] with p held fixed, i.e. what autograd on a batch of
sampled tokens gives on average. It is not grad E_p[estimator]: the score-function term of sampling is
never seen by autograd, and the factor r is how an estimator puts it back.

| kind  | expression               | E[value]   | E[gradient]                           |
|-------|--------------------------|------------|---------------------------------------|
| k1    | -log w                   | reverse KL | 0                                     |
| k2    | (log w)^2 / 2            | biased     | grad reverse KL                       |
| k3    | w - 1 - log w            | reverse KL | grad forward KL (not reverse)         |
| k3pp  | r (w - 1 - log w)        | reverse KL | grad reverse KL                       |
| k4    | r sg(-log w)             | reverse KL | grad reverse KL                       |
| k5    | sg(w) log w + log r      | forward KL | grad forward KL                       |
| k3_clamped | k3 with log w clamped to [-20, 20], then the value to [-10, 10] | as k3 where the clamps do not bind | as k3 there, 0 where they bind |

k3_clamped is verl's `low_var_kl`, the KL of the authors' GRPO baseline (LunjunZhang/ema-pg, docs/fidelity.md). The
value clamp binds where w = pi_ref(p) / pi_theta(p) > 13.61 (log w > 2.611) or w < 1 / 59,873 (log w < -11.0); the
log-w clamp only keeps exp() finite, as the value clamp has bound before it. Where the clamp binds the token's
gradient is zero: a token whose probability the policy raised 59,873-fold over the anchor's, or cut below a 13.6th
of it, gets no pull back. A name of its own so that `k3` stays the plain estimator.

reverse KL = KL(pi_theta || pi_ref), forward KL = KL(pi_ref || pi_theta). Logits are assumed finite (a -inf
logit makes 0 * inf terms); log-probs are always normalised over the full vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.registry import KLReads, register_kl_estimator

DIRECTIONS = ("reverse", "forward")
TOPK_GRADIENTS = ("unbiased", "released")


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")


def _check_same_shape(name: str, tensor: Tensor, expected: torch.Size, expected_name: str) -> None:
    if tensor.shape != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(expected)} (the shape of {expected_name})")


# The authors' released code clamps log-ratios to [-20, 20] before exponentiating them (verl's numerical guard):
# the importance weight's, the forward tail's log w, and k3's log w (docs/fidelity.md has the lines).
RELEASED_LOG_RATIO_CLAMP = 20.0
RELEASED_K3_VALUE_CLAMP = 10.0


def importance_weight(
    logprob: Tensor, old_logprob: Tensor, iw_clip: float | None = None, log_ratio_clamp: float | None = None
) -> Tensor:
    """s = sg(pi_theta(p) / pi_old(p)), optionally clamped to at most `iw_clip` (the clamp biases it); with
    `log_ratio_clamp` the log-ratio is first clamped to [-c, c] (the released code's guard)."""
    log_s = (logprob.float() - old_logprob.float()).detach()
    if log_ratio_clamp is not None:
        log_s = log_s.clamp(-log_ratio_clamp, log_ratio_clamp)
    s = torch.exp(log_s)
    return s if iw_clip is None else s.clamp(max=iw_clip)


# The sampled estimators as functions of log w and log r (module docstring's table); r = exp(log r) has value 1.
def _k1(log_w: Tensor, log_r: Tensor) -> Tensor:
    return -log_w


def _k2(log_w: Tensor, log_r: Tensor) -> Tensor:
    return 0.5 * log_w.square()


def _k3(log_w: Tensor, log_r: Tensor) -> Tensor:
    return torch.expm1(log_w) - log_w  # w - 1 - log w; expm1 keeps precision when w ~ 1


def _k3pp(log_w: Tensor, log_r: Tensor) -> Tensor:
    return torch.exp(log_r) * (torch.expm1(log_w) - log_w)


def _k4(log_w: Tensor, log_r: Tensor) -> Tensor:
    return torch.exp(log_r) * (-log_w).detach()


def _k5(log_w: Tensor, log_r: Tensor) -> Tensor:
    return torch.exp(log_w).detach() * log_w + log_r


def _k3_clamped(log_w: Tensor, log_r: Tensor) -> Tensor:
    log_w = log_w.clamp(-RELEASED_LOG_RATIO_CLAMP, RELEASED_LOG_RATIO_CLAMP)
    return _k3(log_w, log_r).clamp(-RELEASED_K3_VALUE_CLAMP, RELEASED_K3_VALUE_CLAMP)


SAMPLED_KL = {"k1": _k1, "k2": _k2, "k3": _k3, "k3pp": _k3pp, "k4": _k4, "k5": _k5, "k3_clamped": _k3_clamped}
SAMPLED_KL_KINDS = tuple(SAMPLED_KL)


def sampled_kl(logprob: Tensor, ref_logprob: Tensor, kind: str, *, old_logprob: Tensor | None = None,
               iw_clip: float | None = None) -> Tensor:
    """Per-token sampled KL estimate, same shape as the inputs (typically (B, T)).

    logprob:     log pi_theta(p) of the sampled token, carries the gradient.
    ref_logprob: log pi_ref(p) (detached here).
    old_logprob: log pi_old(p) of the policy that sampled p. If given, the estimate is multiplied by
                 s = sg(exp(logprob - old_logprob)), so that E_{p~pi_old}[s f(p)] = E_{p~pi_theta}[f(p)] in
                 value and, since s is a constant, in expected gradient too. Without it p is taken to be
                 drawn from pi_theta itself (s = 1, as on the first PPO epoch where pi_theta == pi_old).
    iw_clip:     clamps s to at most this (biasing it); needs old_logprob.
    """
    if kind not in SAMPLED_KL_KINDS:
        raise ValueError(f"kind must be one of {SAMPLED_KL_KINDS}, got {kind!r}")
    _check_same_shape("ref_logprob", ref_logprob, logprob.shape, "logprob")
    if old_logprob is not None:
        _check_same_shape("old_logprob", old_logprob, logprob.shape, "logprob")
    if iw_clip is not None and old_logprob is None:
        raise ValueError("iw_clip clamps the importance weight, which needs old_logprob")

    logprob = logprob.float()
    log_w = ref_logprob.float().detach() - logprob  # gradient: -grad log pi
    log_r = logprob - logprob.detach()  # value 0, gradient grad log pi
    kl = SAMPLED_KL[kind](log_w, log_r)
    if old_logprob is not None:
        kl = importance_weight(logprob, old_logprob, iw_clip) * kl
    return kl


def exact_kl(logits: Tensor, ref_logits: Tensor, direction: str) -> Tensor:
    """Full-vocabulary KL per token: logits (..., V) -> (...). Gradient flows through `logits` only.

    reverse: KL(pi_theta || pi_ref) = sum_j pi_theta(j) (log pi_theta(j) - log pi_ref(j))
    forward: KL(pi_ref || pi_theta) = sum_j pi_ref(j)   (log pi_ref(j)   - log pi_theta(j))
    Memory: O(V) per token for both models (the thing top-k avoids).
    """
    _check_direction(direction)
    _check_same_shape("ref_logits", ref_logits, logits.shape, "logits")
    if logits.dim() < 1:
        raise ValueError("logits need a vocabulary dimension")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ref_logprobs = torch.log_softmax(ref_logits.float().detach(), dim=-1)
    if direction == "reverse":
        return (logprobs.exp() * (logprobs - ref_logprobs)).sum(-1)
    return (ref_logprobs.exp() * (ref_logprobs - logprobs)).sum(-1)


def gather_logprobs(logits: Tensor, ids: Tensor) -> Tensor:
    """log softmax(logits)[..., ids] in float32, normalised over the full vocabulary: (..., V), (..., n) -> (..., n).

    Uses logsumexp + gather instead of log_softmax: autograd keeps the (fp32) logits it already has plus one
    number per token, not a second (..., V) tensor of log-probs.
    """
    logits = logits.float()
    log_normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)
    return logits.gather(-1, ids) - log_normaliser


def topk_kl(
    logits: Tensor, ref_topk_logprobs: Tensor, ref_token_logprob: Tensor, topk_ids: Tensor, tokens: Tensor, **options
) -> Tensor:
    """`topk_kl_from_logprobs` from the policy's whole logits (B, T, V) (the only input that carries gradient):
    the reference form, where the learner computes the log-probs chunk by chunk (trainer.learner.logprobs). `options`:
    direction, old_token_logprob, iw_clip, gradient. k may also be V (the exact KL)."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    batch_shape, vocab = logits.shape[:2], logits.shape[2]
    _check_topk_ids(topk_ids, tokens, batch_shape, "logits[..., 0]")
    if topk_ids.shape[2] > vocab:
        raise ValueError(f"k = {topk_ids.shape[2]} exceeds the vocabulary size {vocab}")
    # One gather for the head ids and the sampled token: (B, T, k + 1), nothing of size V beyond the logits.
    logprobs = gather_logprobs(logits, torch.cat([topk_ids, tokens.unsqueeze(-1)], dim=-1))
    return topk_kl_from_logprobs(logprobs[..., :-1], logprobs[..., -1], ref_topk_logprobs, ref_token_logprob, topk_ids,
                                 tokens, **options)


def _check_topk_ids(topk_ids: Tensor, tokens: Tensor, batch_shape: torch.Size, batch_name: str) -> None:
    if topk_ids.dim() != len(batch_shape) + 1 or topk_ids.shape[:-1] != batch_shape:
        raise ValueError(f"topk_ids must be {tuple(batch_shape)} + (k,), got {tuple(topk_ids.shape)}")
    if topk_ids.dtype != torch.long or tokens.dtype != torch.long:
        raise ValueError(f"topk_ids and tokens must be int64 ids, got {topk_ids.dtype} and {tokens.dtype}")
    _check_same_shape("tokens", tokens, batch_shape, batch_name)


def topk_kl_from_logprobs(
    head_logprobs: Tensor,
    token_logprob: Tensor,
    ref_topk_logprobs: Tensor,
    ref_token_logprob: Tensor,
    topk_ids: Tensor,
    tokens: Tensor,
    *,
    direction: str,
    old_token_logprob: Tensor | None = None,
    iw_clip: float | None = None,
    gradient: str = "unbiased",
) -> Tensor:
    """Top-k KL per token (docs/algorithm.md §4): exact on the head q, a sampled estimate on the tail, -> (...).

    From all the estimator reads of the policy's logits: its log-probs (normalised over the full vocabulary) at the
    head ids and at the sampled token, the only inputs that carry gradient. So the learner can compute them chunk by
    chunk (trainer.learner.logprobs) without ever holding (..., V); `topk_kl` takes the whole logits instead.

    head_logprobs:     (..., k) log pi_theta at topk_ids.
    token_logprob:     (...)    log pi_theta(p) of the sampled token.
    topk_ids:          (..., k) q: the sampling policy pi_old's top-k for "reverse", the anchor's for "forward".
                       k may be 0 (reduces to k4 / k5).
    ref_topk_logprobs: (..., k) log pi_ref at topk_ids.
    ref_token_logprob: (...)    log pi_ref(p) of the sampled token.
    tokens:            (...)    the sampled tokens p.
    old_token_logprob: (...)    log pi_old(p); if given the tail is weighted by s = sg(pi_theta(p) / pi_old(p)),
                       clamped to at most `iw_clip` if that is given.

    With P_q = sum_{j in q} pi_theta(j):
      reverse: sum_{j in q} pi_theta(j) (log pi_theta(j) - log pi_ref(j))
               + s 1[p not in q] r sg(log pi_theta(p) - log pi_ref(p))  - (P_q - sg(P_q))
      forward: sum_{j in q} pi_ref(j) (log pi_ref(j) - log pi_theta(j))
               + s 1[p not in q] (sg(w) log w + log r)                 + (P_q - sg(P_q))
    The last term is zero in value. Its gradient cancels the tail estimator's missing (reverse) or extra
    (forward) sum_{j not in q} grad pi_theta(j) = -grad P_q, so the expected gradient equals grad KL at any k.

    gradient: "unbiased" (the above) or "released", the authors' released estimator (docs/fidelity.md): the same
    value without that last term, so its expected gradient is grad KL + grad P_q (reverse) or grad KL - grad P_q
    (forward); and their numerical guards, log-ratios clamped to [-20, 20] in the importance weight and in the
    forward tail's log w (they bind only where a ratio passes e^20 ~ 4.9e8).
    """
    _check_direction(direction)
    if gradient not in TOPK_GRADIENTS:
        raise ValueError(f"gradient must be one of {TOPK_GRADIENTS}, got {gradient!r}")
    released = gradient == "released"
    batch_shape = token_logprob.shape
    _check_topk_ids(topk_ids, tokens, batch_shape, "token_logprob")
    _check_same_shape("head_logprobs", head_logprobs, topk_ids.shape, "topk_ids")
    _check_same_shape("ref_topk_logprobs", ref_topk_logprobs, topk_ids.shape, "topk_ids")
    _check_same_shape("ref_token_logprob", ref_token_logprob, batch_shape, "token_logprob")
    if old_token_logprob is not None:
        _check_same_shape("old_token_logprob", old_token_logprob, batch_shape, "token_logprob")
    if iw_clip is not None:
        if old_token_logprob is None:
            raise ValueError("iw_clip clamps the importance weight, which needs old_token_logprob")
        if not iw_clip > 0:
            raise ValueError(f"iw_clip must be positive, got {iw_clip}")

    head_logprobs, token_logprob = head_logprobs.float(), token_logprob.float()
    head_probs = head_logprobs.exp()
    head_mass = head_probs.sum(-1)  # P_q
    ref_head_logprobs = ref_topk_logprobs.float().detach()
    ref_token_logprob = ref_token_logprob.float().detach()

    # The tail estimate counts only tokens outside q (their mass is already exact in the head).
    tail_weight = (topk_ids != tokens.unsqueeze(-1)).all(-1).float()  # 1[p not in q]; all() of nothing is True
    log_ratio_clamp = RELEASED_LOG_RATIO_CLAMP if released else None
    if old_token_logprob is not None:
        tail_weight = tail_weight * importance_weight(token_logprob, old_token_logprob, iw_clip, log_ratio_clamp)

    log_ratio = token_logprob - ref_token_logprob  # log pi_theta(p) - log pi_ref(p) = -log w
    log_r = token_logprob - token_logprob.detach()
    # value 0, gradient grad P_q; the released estimator has no such term
    mass_grad_only = torch.zeros_like(head_mass) if released else head_mass - head_mass.detach()

    if direction == "reverse":
        head = (head_probs * (head_logprobs - ref_head_logprobs)).sum(-1)
        tail = tail_weight * torch.exp(log_r) * log_ratio.detach()  # k4 on the tail
        return head + tail - mass_grad_only
    head = (ref_head_logprobs.exp() * (ref_head_logprobs - head_logprobs)).sum(-1)
    log_w = -log_ratio if log_ratio_clamp is None else (-log_ratio).clamp(-log_ratio_clamp, log_ratio_clamp)
    tail = tail_weight * (torch.exp(log_w).detach() * log_w + log_r)  # k5 on the tail
    return head + tail + mass_grad_only


@dataclass(frozen=True)
class KLInputs:
    """What a registered KL estimator (trainer.registry) gets from the learner: per-token values at a micro-batch's M
    model tokens (packed). Only the policy's log-probs carry gradient. Which optional fields are set depends on what
    the estimator `reads`: `head_logprobs`, `topk_ids` and `ref_topk_logprobs` for "topk", `exact_kl` for "exact"."""

    token_logprob: Tensor  # (M,) log pi_theta(p) of the sampled token
    ref_token_logprob: Tensor | None  # (M,) log pi_ref(p); None for "exact" (prepare runs no anchor pass for it)
    tokens: Tensor  # (M,) the sampled tokens p
    direction: str  # "reverse" KL(pi_theta || pi_ref) or "forward" KL(pi_ref || pi_theta)
    old_token_logprob: Tensor | None = None  # (M,) log pi_old(p), when the config asks for the importance weight
    iw_clip: float | None = None
    head_logprobs: Tensor | None = None  # (M, k) log pi_theta at topk_ids
    topk_ids: Tensor | None = None  # (M, k)
    ref_topk_logprobs: Tensor | None = None  # (M, k) log pi_ref at topk_ids
    exact_kl: Tensor | None = None  # (M,) the full-vocabulary KL in `direction`


def _register_topk(name: str, gradient: str) -> None:
    @register_kl_estimator(name, KLReads("topk"))
    def estimator(x: KLInputs) -> Tensor:
        return topk_kl_from_logprobs(x.head_logprobs, x.token_logprob, x.ref_topk_logprobs, x.ref_token_logprob,
                                     x.topk_ids, x.tokens, direction=x.direction,
                                     old_token_logprob=x.old_token_logprob, iw_clip=x.iw_clip, gradient=gradient)


_register_topk("topk", "unbiased")  # ours


@register_kl_estimator("exact", KLReads("exact", importance_weight=False))
def exact_estimator(x: KLInputs) -> Tensor:
    return x.exact_kl  # computed beside the policy's LM head, chunk by chunk (trainer.learner.logprobs)


def _register_sampled(kind: str) -> None:
    @register_kl_estimator(kind, KLReads("token"))
    def estimator(x: KLInputs) -> Tensor:
        return sampled_kl(x.token_logprob, x.ref_token_logprob, kind, old_logprob=x.old_token_logprob,
                          iw_clip=x.iw_clip)


for _kind in SAMPLED_KL_KINDS:
    _register_sampled(_kind)
# The authors' released Top-k estimator (docs/fidelity.md), after the built-ins: config errors list those first.
_register_topk("topk_released", "released")

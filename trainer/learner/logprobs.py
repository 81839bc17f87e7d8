"""Per-token log-prob statistics through the LM head, chunk by chunk over tokens (docs/algorithm.md §6, "Chunked
log-probs").

Per model token the learner needs a few numbers from the V-wide logits z = W h / temperature, never z itself:

    log pi(j) = z_j - logsumexp(z)        at a few ids j (the sampled token, the Top-k ids)
    entropy   = logsumexp(z) - sum_j pi(j) z_j
    exact KL  against a reference head (the `exact` estimator only)
    the top-k ids of z                     (pi_old's or the anchor's, in the no-grad prepare pass)

`token_logprobs` computes them `chunk_tokens` tokens at a time, so at most a (chunk, V) block of logits is alive
(Qwen's V = 151,936 makes a full (tokens, V) fp32 block ~0.6 MB per token). With gradients the block is not kept for
the backward pass: `ChunkedHead.backward` recomputes it from the hidden states and the head weight (one more head
matmul per chunk; logsumexp is saved, one number per token) and forms d loss / dz in closed form, with
pi = softmax(z) and g the incoming gradients:

    d log pi(i) / dz_k =  1[i = k] - pi(k)
    d entropy   / dz_k = -pi(k) (log pi(k) + entropy)
    d KL(pi||q) / dz_k =  pi(k) (log pi(k) - log q(k) - KL)      reverse
    d KL(q||pi) / dz_k =  pi(k) - q(k)                          forward

    dz = pi * (slope * log pi + shift [- g_kl log q]) [- g_kl q] + scatter(ids, g_logprobs)
    slope = -g_entropy [+ g_kl]     shift = -sum(g_logprobs) - g_entropy entropy [- g_kl KL | + g_kl]

then dh = dz W and dW = dz^T h, exactly what autograd would give for the unchunked expressions, in fewer V-wide
temporaries. `chunk_tokens = 0` is that unchunked path: the whole (tokens, V) logits at once, through autograd (the
reference the chunked path is tested against).

The passes over a padded batch (trainer/learner/batch.py's layout) are here too: final hidden states, logits or
these statistics at the response positions, and the trainer's mixed precision. The learner slices the decoder's
hidden states to the response columns (to its model tokens, in fact) before the LM head: the prompt's V-wide logits
are never built, and with chunking neither are all of the response's at once.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from functools import cache
from typing import Literal, NamedTuple

import torch
from torch import Tensor, nn

from trainer.learner.batch import RolloutBatch, shared_prefix_width
from trainer.kl import DIRECTIONS, exact_kl, gather_logprobs


class TokenLogprobs(NamedTuple):
    """Per-token results for M tokens (a NamedTuple: DDP and FSDP find the tensors in it)."""

    logprobs: Tensor  # (M, n) log pi at the requested ids, normalised over the full vocabulary
    entropy: Tensor | None  # (M,) when asked for
    topk_ids: Tensor | None  # (M, k) the top-k ids of these logits (no gradient), when asked for
    topk_logprobs: Tensor | None  # (M, k) log pi at topk_ids (no gradient)
    kl: Tensor | None  # (M,) exact KL to the reference's logits, when a reference is given


def compute_dtype(weight: Tensor) -> torch.dtype:
    """The head matmul's dtype: autocast's where it is on (as `nn.Linear` would run), else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def _logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """(c, V) float32 logits of hidden (c, H) under weight (V, H), both already in the compute dtype."""
    z = (hidden @ weight.t()).float()
    return z.div_(temperature) if temperature != 1.0 else z


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class _Blocks(NamedTuple):
    logprobs: Tensor
    lse: Tensor
    entropy: Tensor | None
    kl: Tensor | None
    ref_lse: Tensor | None
    topk_ids: Tensor | None
    topk_logprobs: Tensor | None


@torch.no_grad()
def _forward_blocks(hidden, weight, ids, ref_hidden, ref_weight, temperature, chunk_tokens, entropy, topk, direction,
                    dtype) -> _Blocks:
    """The statistics, one (chunk, V) block of logits at a time; weights already cast to `dtype`."""
    m = hidden.shape[0]

    def empty(*shape, dtype=torch.float32):
        return hidden.new_empty((m, *shape), dtype=dtype)

    logprobs, lse = empty(ids.shape[1]), empty()
    ent = empty() if entropy else None
    kl, ref_lse = (empty(), empty()) if ref_hidden is not None else (None, None)
    top_ids, top_logprobs = (empty(topk, dtype=torch.long), empty(topk)) if topk is not None else (None, None)
    for c in _chunks(m, chunk_tokens):
        z = _logits(hidden[c].to(dtype), weight, temperature)
        lse[c] = torch.logsumexp(z, dim=-1)
        logprobs[c] = z.gather(-1, ids[c]) - lse[c, None]
        if top_ids is not None:
            values, indices = z.topk(topk, dim=-1)
            top_ids[c], top_logprobs[c] = indices, values - lse[c, None]
        if ent is None and kl is None:
            continue
        logp = z.sub_(lse[c, None])  # in place: z itself is not needed any more
        p = logp.exp()
        if ent is not None:
            ent[c] = -(p * logp).sum(-1)
        if kl is not None:
            r = _logits(ref_hidden[c].to(dtype), ref_weight, temperature)
            ref_lse[c] = torch.logsumexp(r, dim=-1)
            logq = r.sub_(ref_lse[c, None])
            kl[c] = (p * (logp - logq)).sum(-1) if direction == "reverse" else (logq.exp() * (logq - logp)).sum(-1)
    return _Blocks(logprobs, lse, ent, kl, ref_lse, top_ids, top_logprobs)


class ChunkedHead(torch.autograd.Function):
    """log pi at ids, the entropy and (with a reference) the exact KL for each token, from hidden states and the head
    weight, a chunk of tokens at a time; the logits are recomputed in the backward pass (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, ref_hidden, ref_weight, temperature, chunk_tokens, entropy, direction):
        dtype = compute_dtype(weight)
        # Cast once, not per chunk (autocast would cast on every call).
        ref_w = None if ref_weight is None else ref_weight.to(dtype)
        out = _forward_blocks(hidden, weight.to(dtype), ids, ref_hidden, ref_w, temperature, chunk_tokens, entropy,
                              None, direction, dtype)
        ctx.save_for_backward(hidden, weight, ids, out.lse, out.entropy, ref_hidden, ref_weight, out.ref_lse, out.kl)
        ctx.temperature, ctx.chunk_tokens, ctx.direction, ctx.dtype = temperature, chunk_tokens, direction, dtype
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: its term is skipped
        return out.logprobs, out.entropy, out.kl

    @staticmethod
    def backward(ctx, g_logprobs, g_entropy, g_kl):
        hidden, weight, ids, lse, ent, ref_hidden, ref_weight, ref_lse, kl = ctx.saved_tensors
        temperature, reverse, dtype = ctx.temperature, ctx.direction == "reverse", ctx.dtype
        w = weight.detach().to(dtype)
        ref_w = None if ref_weight is None else ref_weight.detach().to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for c in _chunks(hidden.shape[0], ctx.chunk_tokens):
            h = hidden[c].detach().to(dtype)
            logp = _logits(h, w, temperature).sub_(lse[c, None])
            # Only log-probs at ids in the loss (the usual case): pi = exp(log pi) in place, one (chunk, V) buffer.
            p = logp.exp_() if g_entropy is None and g_kl is None else logp.exp()
            # dz = p * (slope * log p + shift - [reverse] g_kl log q) - [forward] g_kl q + scatter(ids, g_logprobs)
            shift = -g_logprobs[c].sum(-1) if g_logprobs is not None else torch.zeros_like(lse[c])
            slope = None
            if g_entropy is not None:
                shift = shift - g_entropy[c] * ent[c]
                slope = -g_entropy[c]
            logq = None
            if g_kl is not None:
                logq = _logits(ref_hidden[c].to(dtype), ref_w, temperature).sub_(ref_lse[c, None])
                if reverse:
                    shift = shift - g_kl[c] * kl[c]
                    slope = g_kl[c] if slope is None else slope + g_kl[c]
                else:
                    shift = shift + g_kl[c]
            inner = shift[:, None] if slope is None else logp.mul_(slope[:, None]).add_(shift[:, None])
            if logq is not None and reverse:
                inner = inner - logq.mul_(g_kl[c, None])
            dz = p.mul_(inner)
            if logq is not None and not reverse:
                dz.sub_(logq.exp_().mul_(g_kl[c, None]))
            if g_logprobs is not None:
                dz.scatter_add_(-1, ids[c], g_logprobs[c])
            if temperature != 1.0:
                dz.div_(temperature)
            dz = dz.to(dtype)
            if grad_hidden is not None:
                grad_hidden[c] = dz @ w
            if grad_weight is None:
                continue
            if dtype == torch.float32:
                grad_weight.addmm_(dz.t(), h)  # in place: no (V, H) temporary
            else:  # a (V, H) product in the compute dtype, accumulated in fp32 over the chunks
                grad_weight.add_(dz.t() @ h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def token_logprobs(
    hidden: Tensor,
    head: nn.Module,
    ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 0,
    entropy: bool = False,
    entropy_grad: bool = False,
    topk: int | None = None,
    reference: tuple[Tensor, nn.Module] | None = None,
    direction: str = "reverse",
) -> TokenLogprobs:
    """Per-token statistics of the logits head(hidden) / temperature for M tokens.

    hidden:       (M, H) the decoder's final hidden states at the tokens.
    head:         the output layer (an `nn.Linear` without bias when chunking).
    ids:          (M, n) int64: log pi is returned at these ids (e.g. the sampled token, the Top-k ids).
    entropy:      also the entropy; `entropy_grad` lets gradient flow through it (else it comes back detached).
    topk:         also the top-k ids of the logits and log pi there, without gradient (the prepare pass; k may be 0).
    reference:    (ref_hidden (M, H), ref_head): also the exact KL per token (`direction` as in `exact_kl`);
                  no gradient reaches the reference.
    chunk_tokens: tokens per block of logits; 0 = all at once through autograd (the unchunked reference path).
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if hidden.dim() != 2 or ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"hidden must be (M, H) and ids (M, n); got {tuple(hidden.shape)} and {tuple(ids.shape)}")
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be >= 0 (0 = unchunked), got {chunk_tokens}")
    if chunk_tokens == 0:
        return _unchunked(hidden, head, ids, temperature, entropy, entropy_grad, topk, reference, direction)
    for name, module in (("head", head), ("reference head", None if reference is None else reference[1])):
        if module is not None and (not isinstance(module, nn.Linear) or module.bias is not None):
            raise ValueError(f"chunked log-probs need the {name} to be an nn.Linear without bias, got {module!r}; "
                             "set train.logprob_chunk_tokens=0")
    grad = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    if grad and topk is not None:
        raise ValueError("topk ids are for no-grad passes (prepare); compute them under torch.no_grad()")
    ref_hidden = ref_weight = None
    if reference is not None:
        ref_hidden, ref_weight = reference[0].detach(), reference[1].weight.detach()
    if not grad:  # nothing to differentiate: the forward blocks alone (with top-k if asked)
        dtype = compute_dtype(head.weight)
        out = _forward_blocks(hidden, head.weight.to(dtype), ids, ref_hidden,
                              None if ref_weight is None else ref_weight.to(dtype), temperature, chunk_tokens,
                              entropy, topk, direction, dtype)
        return TokenLogprobs(out.logprobs, out.entropy, out.topk_ids, out.topk_logprobs, out.kl)
    logprobs, ent, kl = ChunkedHead.apply(hidden, head.weight, ids, ref_hidden, ref_weight, temperature,
                                          chunk_tokens, entropy, direction)
    return TokenLogprobs(logprobs, ent if entropy_grad or ent is None else ent.detach(), None, None, kl)


def _unchunked(hidden, head, ids, temperature, entropy, entropy_grad, topk, reference, direction) -> TokenLogprobs:
    """The same statistics from the whole (M, V) logits through autograd: the reference path."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = gather_logprobs(logits, ids)
    ent = top_ids = top_logprobs = kl = None
    if entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            logp = torch.log_softmax(logits, dim=-1)
            ent = -(logp.exp() * logp).sum(-1)
    if topk is not None:
        with torch.no_grad():
            values, top_ids = logits.topk(topk, dim=-1)
            top_logprobs = values - torch.logsumexp(logits, dim=-1, keepdim=True)
    if reference is not None:
        with torch.no_grad():
            ref_logits = reference[1](reference[0]).float()
            if temperature != 1.0:
                ref_logits = ref_logits / temperature
        kl = exact_kl(logits, ref_logits, direction)
    return TokenLogprobs(logprobs, ent, top_ids, top_logprobs, kl)


def decoder_states(model, batch: RolloutBatch, share_prefix: bool = False) -> Tensor:
    """(N, P + T, H) final hidden states. With `share_prefix`, the columns every row has alike
    (`shared_prefix_width`) run once, as one row whose keys and values every row's rest attends to: the same causal
    attention over the same tokens, so the same states (up to float rounding) for less compute; gradients reach the
    shared pass through the repeated cache. Not in a training pass under activation checkpointing, where
    transformers drops the cache from checkpointed layers."""
    decoder = model.get_decoder()
    width = shared_prefix_width(batch) if share_prefix and len(batch) > 1 else 0
    if width and model.training and getattr(model, "is_gradient_checkpointing", False):
        width = 0
    if width == 0:  # no KV cache: nothing is generated here, and a cache would hold every layer's K/V
        return decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids, use_cache=False).last_hidden_state
    shared = decoder(input_ids=batch.input_ids[:1, :width], attention_mask=batch.attention_mask[:1, :width],
                     position_ids=batch.position_ids[:1, :width], use_cache=True)
    cache = shared.past_key_values
    cache.batch_repeat_interleave(len(batch))
    rest = decoder(input_ids=batch.input_ids[:, width:], attention_mask=batch.attention_mask,
                   position_ids=batch.position_ids[:, width:], past_key_values=cache, use_cache=True)
    return torch.cat([shared.last_hidden_state.expand(len(batch), -1, -1), rest.last_hidden_state], dim=1)


def response_hidden(model, batch: RolloutBatch, only: Tensor | None = None, share_prefix: bool = False) -> Tensor:
    """(N, T, H) final hidden states predicting each response token, or with `only` (an (N, T) bool mask) the (M, H)
    states at those positions alone: the LM head never runs where nothing is learned (observations)."""
    hidden = decoder_states(model, batch, share_prefix)
    p, t = batch.prompt_width, batch.response_ids.shape[1]
    hidden = hidden[:, p - 1 : p - 1 + t]
    return hidden if only is None else hidden[only]


def response_logits(model, batch: RolloutBatch, temperature: float = 1.0, only: Tensor | None = None) -> Tensor:
    """(N, T, V) float32 logits predicting each response token, divided by the sampling temperature so that
    log-probs are those of the distribution the rollout sampled from; with `only`, the (M, V) logits there."""
    logits = model.get_output_embeddings()(response_hidden(model, batch, only)).float()
    return logits / temperature if temperature not in (0.0, 1.0) else logits


class ResponseLogprobs(torch.nn.Module):
    """Per-token log-prob statistics of `model` at a micro-batch's model tokens (loss_mask), as a module: DDP syncs
    gradients only for passes through its wrapper's forward, and FSDP gathers a root's weights in the root's
    forward, so the learner wraps this (not the causal LM, whose own forward would build the prompt's logits too).
    `chunk_tokens` > 0: the LM head runs that many tokens at a time (trainer.learner.logprobs), never on all of them;
    `share_prefix`: the rows' common leading columns run once (`decoder_states`)."""

    def __init__(self, model, temperature: float = 1.0, chunk_tokens: int = 0, share_prefix: bool = False):
        super().__init__()
        self.model = model
        self.temperature = temperature or 1.0  # greedy (0) evaluates at temperature 1
        self.chunk_tokens = chunk_tokens
        self.share_prefix = share_prefix

    def forward(self, batch: RolloutBatch, ids: Tensor | None = None, **options) -> TokenLogprobs | Tensor:
        """`token_logprobs` at the (M, n) `ids` of the micro-batch's M model tokens (options: entropy, entropy_grad,
        topk, reference, direction); without `ids`, the (M, H) hidden states there (the exact KL's reference)."""
        hidden = response_hidden(self.model, batch, only=batch.loss_mask, share_prefix=self.share_prefix)
        if ids is None:
            return hidden
        return token_logprobs(hidden, self.model.get_output_embeddings(), ids, temperature=self.temperature,
                              chunk_tokens=self.chunk_tokens, **options)


def native_bf16(device_type: str) -> bool:
    """Whether torch runs bf16 matmuls natively on this device: a CUDA GPU with bf16, or a CPU with AVX512-BF16 or
    AMX (torch's own CPU feature check, the one its oneDNN kernels dispatch on)."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device_type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


@cache  # once per process and device: the check reads CPU flags, and the warning should appear once
def resolve_autocast(kind: str, device_type: str) -> Literal["none", "bfloat16"]:
    """"auto" -> bfloat16 where it is native, else none. An explicit bfloat16 where it is emulated is kept but
    warned about: emulated bf16 matmuls measured 55x slower than fp32 on a CPU without AVX-512 (issue 12)."""
    if kind == "auto":
        return "bfloat16" if native_bf16(device_type) else "none"
    if kind == "bfloat16" and not native_bf16(device_type):
        warnings.warn(
            f"autocast=bfloat16 on a {device_type} without native bf16: torch emulates it, measured up to 55x slower "
            "than fp32 (one 512x576 @ 576x1536 matmul: 709 ms against 13 ms); use autocast=auto or none",
            stacklevel=2,
        )
    if kind not in ("none", "bfloat16"):
        raise ValueError(f"autocast must be none, bfloat16 or auto, got {kind!r}")
    return kind  # type: ignore[return-value]


def autocast(kind: str, model):
    """The trainer's mixed precision: bf16 matmuls under torch.autocast on the model's device, or nothing
    (`kind` "auto" chooses bf16 only where the device runs it natively)."""
    device_type = next(model.parameters()).device.type
    if resolve_autocast(kind, device_type) == "none":
        return nullcontext()
    return torch.autocast(device_type, dtype=torch.bfloat16)

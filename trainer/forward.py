"""The policy's passes over a padded batch (trainer/batch.py's layout): final hidden states, logits or per-token
log-prob statistics at the response positions, and the trainer's mixed precision.

The learner slices the decoder's hidden states to the response columns (to its model tokens, in fact) before the LM
head: the prompt's V-wide logits are never built, and with chunking (trainer.logprobs) neither are all of the
response's at once.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from functools import cache
from typing import Literal

import torch
from torch import Tensor

from trainer.batch import RolloutBatch, shared_prefix_width
from trainer.logprobs import TokenLogprobs, token_logprobs


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
    `chunk_tokens` > 0: the LM head runs that many tokens at a time (trainer.logprobs), never on all of them;
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

"""Trajectories -> padded tensors for the learner, and the policy's hidden states, logits or per-token log-prob
statistics at the response positions.

Layout: prompts left-padded to width P, responses right-padded to width T, so response token j of every row sits at
column P + j and is predicted by the logits at column P + j - 1 (each tensor field declares its columns: `columns`).
The learner slices the decoder's hidden states to those T columns (to its model tokens, in fact) before the LM head:
the prompt's V-wide logits are never built, and with chunking (trainer.logprobs) neither are all of the response's at
once.
"""

from __future__ import annotations

import math
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Literal, Self

import torch
from torch import Tensor

from agent.trajectory import Trajectory
from trainer.logprobs import TokenLogprobs, token_logprobs


def columns(layout: Literal["sequence", "response"]):
    """A field whose columns are the whole sequence (P + T) or the response (T): what `select` cuts."""
    return field(metadata={"columns": layout})


@dataclass(frozen=True)
class RolloutBatch:
    """Scored trajectories as tensors (`collate`), what the learner's `prepare` starts from."""

    input_ids: Tensor = columns("sequence")  # (N, P + T)
    attention_mask: Tensor = columns("sequence")  # (N, P + T)
    position_ids: Tensor = columns("sequence")  # (N, P + T)
    response_ids: Tensor = columns("response")  # (N, T)
    loss_mask: Tensor = columns("response")  # (N, T) bool: the model's own tokens
    sampler_logprobs: Tensor = columns("response")  # (N, T) what the rollout engine reported
    advantages: Tensor  # (N,)
    prompt_width: int

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> Self:
        """Every tensor moved to `device` (the learner's; collate builds on CPU)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return type(self)(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in values.items()})

    def response_lengths(self) -> Tensor:
        return self.attention_mask[:, self.prompt_width :].sum(-1)

    def select(self, rows: Tensor) -> Self:
        """The sub-batch of these rows (a mini- or micro-batch), cut to its longest response: the dropped columns
        are padding after every row's end, which no earlier position attends to (causal), so nothing changes."""
        width = self.response_ids.shape[1]
        keep = max(int(self.attention_mask[rows, self.prompt_width :].sum(-1).max()), 1) if len(rows) else width
        cut = {"sequence": self.prompt_width + keep, "response": keep}
        values = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                v = v[rows]
                if "columns" in f.metadata:
                    v = v[:, : cut[f.metadata["columns"]]]
            values[f.name] = v
        return type(self)(**values)


@dataclass(frozen=True)
class PreparedBatch(RolloutBatch):
    """A RolloutBatch with what `Learner.prepare` computed before any update, at loss_mask positions (0 elsewhere):
    the only batch `Learner.update` takes."""

    old_logprobs: Tensor = columns("response")  # (N, T) pi_old, recomputed by the trainer
    topk_ids: Tensor = columns("response")  # (N, T, k) top-k of pi_old (reverse KL) or of the anchor (forward)
    ref_topk_logprobs: Tensor = columns("response")  # (N, T, k) the anchor's log-probs at topk_ids
    ref_token_logprob: Tensor = columns("response")  # (N, T) the anchor's log-prob of the sampled token


def collate(trajectories: list[Trajectory], advantages: Tensor, pad_id: int) -> RolloutBatch:
    n = len(trajectories)
    width_p = max(len(t.prompt_ids) for t in trajectories)
    width_t = max(max(len(t.response_ids) for t in trajectories), 1)
    input_ids = torch.full((n, width_p + width_t), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width_p + width_t), dtype=torch.long)
    response = torch.full((n, width_t), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((n, width_t), dtype=torch.bool)
    sampler = torch.zeros((n, width_t), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, width_p - p : width_p] = torch.tensor(t.prompt_ids)
        input_ids[i, width_p : width_p + r] = torch.tensor(t.response_ids, dtype=torch.long)
        attention[i, width_p - p : width_p + r] = 1
        response[i, :r] = torch.tensor(t.response_ids, dtype=torch.long)
        loss_mask[i, :r] = torch.tensor(t.loss_mask, dtype=torch.bool)
        sampler[i, :r] = torch.tensor(t.sampler_logprobs)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return RolloutBatch(input_ids, attention, positions, response, loss_mask, sampler, advantages.float(), width_p)


def shared_prefix_width(batch: RolloutBatch) -> int:
    """How many leading columns every row has alike (ids and mask): the prompt, for rollouts of one question, and
    more where they also began their response alike (the same search, so the same documents). At most all but the
    last column, so that each row keeps at least one column of its own; 0 where the common columns are padding alone
    (prompts of one length), which would save nothing."""
    same = ((batch.input_ids == batch.input_ids[:1]) & (batch.attention_mask == batch.attention_mask[:1])).all(0)
    width = min(int(same.long().cumprod(0).sum()), batch.input_ids.shape[1] - 1)
    return width if int(batch.attention_mask[0, :width].sum()) else 0


def prefix_order(batch: RolloutBatch) -> Tensor:
    """The rows in lexicographic order of their (left-padded) ids: rows that share a prefix sit next to each other."""
    rows = [(ids, mask) for ids, mask in zip(batch.input_ids.tolist(), batch.attention_mask.tolist(), strict=True)]
    return torch.tensor(sorted(range(len(rows)), key=rows.__getitem__), dtype=torch.long)


def pass_cost(rows: int, width: int, shared: int, overhead: float) -> float:
    """Token rows one decoder pass over a micro-batch runs: its shared columns once, the rest of each row, plus a
    fixed `overhead` per pass (in token rows) so that rows with nothing to share still fill a micro-batch."""
    return shared + rows * (width - shared) + overhead


def prefix_micro_batches(batch: RolloutBatch, size: int) -> list[Tensor]:
    """Micro-batches of at most `size` rows, runs of `prefix_order`, chosen to minimise the token rows the decoder
    runs (`pass_cost`, one mean row of overhead per pass): dynamic programming over where each run ends. A run's
    shared width is what `shared_prefix_width` finds for it (the smallest common prefix of neighbours in the
    order); its width is the prompt's plus its longest response (`select` cuts it there)."""
    order = prefix_order(batch)
    n = len(order)
    ids, mask = batch.input_ids[order], batch.attention_mask[order]
    lengths = batch.response_lengths()[order].tolist()
    common = ((ids[1:] == ids[:-1]) & (mask[1:] == mask[:-1])).long().cumprod(1).sum(1).tolist()  # neighbours'
    left_pad = (mask.cumsum(1) == 0).sum(1).tolist()  # each row's leading padding columns (as lists: no device reads)
    overhead = batch.prompt_width + sum(lengths) / max(n, 1)
    best, start = [0.0] + [math.inf] * n, [0] * (n + 1)  # best[j]: the cheapest split of the first j rows
    for end in range(1, n + 1):
        shared, longest = math.inf, 0
        for first in range(end - 1, max(end - size, 0) - 1, -1):  # the run first .. end - 1
            longest = max(longest, lengths[first])
            width = batch.prompt_width + max(longest, 1)
            if first < end - 1:
                shared = min(shared, common[first])
            s = 0 if first == end - 1 else min(shared, width - 1)
            if s <= left_pad[first]:
                s = 0  # padding alone: nothing shared (shared_prefix_width)
            cost = best[first] + pass_cost(end - first, width, s, overhead)
            if cost < best[end]:
                best[end], start[end] = cost, first
    runs, end = [], n
    while end:
        runs.append(order[start[end] : end])
        end = start[end]
    return runs[::-1]


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


def scatter_tokens(values: Tensor, mask: Tensor) -> Tensor:
    """(M, ...) values at the M set positions of an (N, T) mask -> (N, T, ...), zeros elsewhere; differentiable.
    The inverse of `x[mask]`: per-token math runs on the model tokens only, losses see the usual layout."""
    out = values.new_zeros((*mask.shape, *values.shape[1:]))
    out[mask] = values
    return out

"""Trajectories -> padded tensors for the learner, and how a batch is cut into micro-batches. No model runs here: the
passes over a batch (hidden states, logits, log-prob statistics, mixed precision) are trainer/learner/logprobs.py's.

Layout: prompts left-padded to width P, responses right-padded to width T, so response token j of every row sits at
column P + j and is predicted by the logits at column P + j - 1 (each tensor field declares its columns: `columns`).
The learner slices the decoder's hidden states to those T columns (to its model tokens, in fact) before the LM head:
the prompt's V-wide logits are never built, and with chunking (trainer.learner.logprobs) neither are all of the response's at
once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal, Self

import torch
from torch import Tensor

from agent.trajectory import Trajectory


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


def scatter_tokens(values: Tensor, mask: Tensor) -> Tensor:
    """(M, ...) values at the M set positions of an (N, T) mask -> (N, T, ...), zeros elsewhere; differentiable.
    The inverse of `x[mask]`: per-token math runs on the model tokens only, losses see the usual layout."""
    out = values.new_zeros((*mask.shape, *values.shape[1:]))
    out[mask] = values
    return out

"""Trajectories -> padded tensors for the learner, and how a batch is cut into micro-batches. No model runs here: the
passes over a batch (hidden states, logits, log-prob statistics, mixed precision) are trainer/learner/logprobs.py's.

Layout: prompts left-padded to width P, responses right-padded to width T, so response token j of every row sits at
column P + j and is predicted by the logits at column P + j - 1 (each tensor field declares its columns: `columns`).
The learner slices the decoder's hidden states to those T columns (to its model tokens, in fact) before the LM head:
the prompt's V-wide logits are never built, and with chunking (trainer.learner.logprobs) neither are all of the
response's at once.
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
    runs (`pass_cost`, one mean row of overhead per pass): `cheapest_runs` with a row limit. A run's shared width is
    what `shared_prefix_width` finds for it (the smallest common prefix of neighbours in the order); its width is the
    prompt's plus its longest response (`select` cuts it there)."""
    lengths = batch.response_lengths()
    overhead = batch.prompt_width + float(lengths.sum()) / max(len(batch), 1)
    return cheapest_runs(batch, prefix_order(batch), overhead, share_prefix=True, max_rows=size)[1]


def neighbour_prefixes(batch: RolloutBatch, order: Tensor) -> tuple[list[int], list[int]]:
    """For rows in `order`: the common prefix (columns of equal ids and mask) of each row with the next, and each
    row's leading padding columns (as lists: no device reads in the loops that use them)."""
    ids, mask = batch.input_ids[order], batch.attention_mask[order]
    common = ((ids[1:] == ids[:-1]) & (mask[1:] == mask[:-1])).long().cumprod(1).sum(1).tolist()
    return common, (mask.cumsum(1) == 0).sum(1).tolist()


def cheapest_runs(batch: RolloutBatch, order: Tensor, overhead: float, share_prefix: bool, max_rows: int | None = None,
                  budget: int | None = None) -> tuple[float, list[Tensor]]:
    """The cheapest split of `order` into runs (micro-batches) and its cost, the sum of the runs' `pass_cost`:
    dynamic programming over where each run ends. A run holds at most `max_rows` rows and, with a `budget`, runs at
    most that many decoder tokens (a single row over it is a run of its own). With `share_prefix`, a run's shared
    width is the smallest common prefix of neighbours in it (0 where that is padding alone: `shared_prefix_width`).
    A run's cost only grows as it takes in rows (a width no smaller, a shared prefix no longer), so each run end
    tries starts back until a limit is reached: O(rows x rows per pass)."""
    n, prompt = len(order), batch.prompt_width
    lengths = batch.response_lengths()[order].tolist()
    common, left_pad = neighbour_prefixes(batch, order) if share_prefix and n > 1 else (None, None)
    best, start = [0.0] + [math.inf] * n, [0] * (n + 1)  # best[j]: the cheapest split of the first j rows
    for end in range(1, n + 1):
        shared, longest = math.inf, 0
        for first in range(end - 1, -1, -1):  # the run first .. end - 1
            rows = end - first
            longest = max(longest, lengths[first])
            width = prompt + max(longest, 1)
            if common is not None and rows > 1:
                shared = min(shared, common[first])
            s = 0 if common is None or rows == 1 else min(shared, width - 1)
            s = 0 if s and s <= left_pad[first] else s  # padding alone: nothing shared
            if (max_rows is not None and rows > max_rows) or (
                    budget is not None and rows > 1 and s + rows * (width - s) > budget):
                break  # and so would every longer run
            cost = best[first] + pass_cost(rows, width, s, overhead)
            if cost < best[end]:
                best[end], start[end] = cost, first
    runs, end = [], n
    while end:
        runs.append(order[start[end] : end])
        end = start[end]
    return best[n], runs[::-1]


def scatter_tokens(values: Tensor, mask: Tensor) -> Tensor:
    """(M, ...) values at the M set positions of an (N, T) mask -> (N, T, ...), zeros elsewhere; differentiable.
    The inverse of `x[mask]`: per-token math runs on the model tokens only, losses see the usual layout."""
    out = values.new_zeros((*mask.shape, *values.shape[1:]))
    out[mask] = values
    return out


# Micro-batches cut by tokens (train.micro_batch_tokens): what a pass runs, not how many rows it holds.
#
# Padding-free packing would go further: rows concatenated into one row, each restarting its positions, attention
# kept within each row by flash-attn's varlen kernel (cu_seqlens; transformers' packed position_ids under
# attn_implementation="flash_attention_2"), so a pass runs the real tokens alone and the budget counts those. That
# pass belongs in trainer.learner.logprobs.decoder_states (a packed layout beside this padded one, chosen where the
# attention implementation supports it) and `pass_tokens` would count it. It is not implemented: torch's SDPA and
# eager attention (CPU, and GPUs without flash-attn) have no varlen kernel, and nothing here needs one.


def pass_tokens(mb: RolloutBatch, share_prefix: bool = False) -> tuple[int, int]:
    """(tokens, of which padding) that the decoder runs for the micro-batch `mb` (as `select` cut it): rows x its
    width, or with `share_prefix` its shared columns once (`shared_prefix_width`) and each row's rest, as
    trainer.learner.logprobs.decoder_states runs it."""
    rows, width = mb.input_ids.shape
    shared = shared_prefix_width(mb) if share_prefix and rows > 1 else 0
    tokens = shared + rows * (width - shared)
    real = int(mb.attention_mask[0, :shared].sum()) + int(mb.attention_mask[:, shared:].sum())
    return tokens, tokens - real


def length_prefix_order(batch: RolloutBatch) -> Tensor:
    """The rows as a walk of their prefix tree (rows sharing a prefix stay side by side, as in `prefix_order`), each
    node's branches taken shortest first (by their longest response): neighbours share prefixes and have similar
    lengths, so runs of this order pad little. The branches of a node are the runs of the lexicographic order
    split where the neighbours' common prefix is shortest."""
    order = prefix_order(batch)
    n = len(order)
    common = neighbour_prefixes(batch, order)[0]
    lengths = batch.response_lengths()[order].tolist()
    walk, stack = [], [(0, n)] if n else []
    while stack:
        lo, hi = stack.pop()
        if hi - lo == 1:
            walk.append(lo)
            continue
        depth = min(common[lo : hi - 1])
        cuts = [lo, *(i + 1 for i in range(lo, hi - 1) if common[i] == depth), hi]
        branches = sorted(zip(cuts, cuts[1:]), key=lambda b: max(lengths[b[0] : b[1]]))  # stable: ties lexicographic
        stack.extend(reversed(branches))
    return order[torch.tensor(walk, dtype=torch.long)]


def token_budget_micro_batches(batch: RolloutBatch, budget: int, share_prefix: bool = False) -> list[Tensor]:
    """Micro-batches whose decoder pass runs at most `budget` tokens (`pass_tokens`: rows x (prompt width + their
    longest response), less a shared prefix run once with `share_prefix`); a row longer than the budget is a
    micro-batch of its own. `cheapest_runs` with the budget in place of a row count:
    runs of an order, chosen to minimise the tokens the decoder runs plus one mean row per pass (`pass_cost`), so
    rows of similar lengths go together and a pass is split off where that saves more padding than a row. Short
    rows go many to a pass, long ones few. The order: rows by response length; with `share_prefix` also
    `length_prefix_order` (prefixes together, shortest branches first), and whichever splits cheaper (sharing a
    ~150-token prompt saves less than grouping rollouts of very different lengths pads, unless they share more).

    A run's cost only grows as it takes in rows (more rows, a width no smaller, a shared prefix no longer), so each
    run end tries starts back until the budget is spent: O(rows x rows per pass) per order."""
    if budget < 1:
        raise ValueError(f"a token budget must be >= 1, got {budget}")
    overhead = batch.prompt_width + float(batch.response_lengths().float().mean()) if len(batch) else 0.0
    orders = [length_prefix_order(batch)] if share_prefix else []
    orders.append(batch.response_lengths().argsort(stable=True))
    return min((cheapest_runs(batch, order, overhead, share_prefix, budget=budget) for order in orders),
               key=lambda split: split[0])[1]


def split_for_ranks(runs: list[Tensor], world_size: int) -> list[Tensor]:
    """`runs` with the ones of most rows halved until their number is a multiple of `world_size`, so that every
    data-parallel rank runs as many passes (FSDP's ranks gather weights together); a part of a run stays within
    the run's budget. Unchanged in one process, or where no run has two rows left to split."""
    runs = list(runs)
    while len(runs) % world_size:
        i = max(range(len(runs)), key=lambda j: len(runs[j]))
        if len(runs[i]) < 2:
            break
        half = (len(runs[i]) + 1) // 2
        runs[i : i + 1] = [runs[i][:half], runs[i][half:]]
    return runs

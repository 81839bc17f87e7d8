"""The learner: one EMA-PG update from a batch of scored trajectories.

    prepare:  pi_old log-probs and top-k ids from the policy (no grad), the anchor's log-probs at those ids: a new,
              PreparedBatch (the RolloutBatch is left as it was)
    update:   PPO epochs x mini-batches (one optimizer step each) x micro-batches (gradient accumulation)
              loss = PPO-clip(A) + beta * KL(policy, anchor) - entropy_coef * entropy, all over loss_mask
              a step with a non-finite micro-batch loss or gradient norm is skipped whole (trainer.guard)
    then the caller applies the EMA anchor update on its period.
"""

from __future__ import annotations

import math
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import fields

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.advantages import broadcast_to_tokens
from trainer.batch import (PreparedBatch, ResponseLogprobs, RolloutBatch, autocast, prefix_micro_batches,
                           scatter_tokens)
from trainer.config import KL_OFF, GuardSection, KLSection, TrainSection
from trainer.ema import EmaAnchor, LoraEmaAnchor
from trainer.guard import StepGuard
from trainer.kl import KLInputs
from trainer.logprobs import TokenLogprobs
from trainer.policy_loss import masked_mean, ppo_clip_loss
from trainer.registry import KL_ESTIMATORS, LOSS_AGGREGATIONS


def micro_batches(rows: Tensor, size: int) -> list[Tensor]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def micro_batch_shares(loss_mask: Tensor, micro_rows: list[Tensor], aggregation: str = "token-mean") -> list[float]:
    """Each micro-batch's share of the mini-batch mean (its tokens, or its sequences, over the mini-batch's), so
    that accumulating share x micro-batch mean gives exactly the gradient of the whole mini-batch's mean."""
    count = LOSS_AGGREGATIONS.get(aggregation).count
    counts = [float(count(loss_mask[r])) for r in micro_rows]
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


def enable_gradient_checkpointing(model) -> None:
    """transformers' per-decoder-layer activation checkpointing (active in train mode only: the learner's gradient
    passes; its no-grad passes run in eval mode). Non-reentrant: the one that composes with FSDP2 and with inputs
    that need no gradient. Called before sharding."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def fsdp_logits(model, temperature: float, mesh) -> ResponseLogprobs:
    """FSDP2 over `mesh`: each decoder layer is one unit (its full weights exist only during its forward and
    backward), the rest (embeddings, final norm, tied output layer) belongs to the root. The root is the
    ResponseLogprobs wrapper, not the causal LM: the learner never calls the LM's own forward, and FSDP gathers a
    root's weights in the root's forward."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(ResponseLogprobs(model, temperature), mesh=mesh)


class Learner:
    """One process's learner. Data-parallel (torch.distributed initialised, world size W): every rank holds the
    same batch; prepare() splits its micro-batches over the ranks and sums the results, update() gives rank r every
    W-th micro-batch of each mini-batch and DDP (or FSDP, when given sharded `policy_logits` / `anchor_logits` from
    `fsdp_logits`) sums the gradients, so each optimizer step equals the one-process step on the whole mini-batch.
    Under FSDP every rank must run the same number of passes (they gather weights together): the config makes the
    micro-batches a multiple of W."""

    def __init__(
        self, policy, anchor: EmaAnchor | LoraEmaAnchor, optimizer, scheduler, train: TrainSection, kl: KLSection,
        temperature: float = 1.0, autocast_kind: str = "none", policy_logits=None, anchor_logits=None,
        guard: GuardSection | None = None,
    ):
        self.policy = policy
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train = train
        self.kl = kl
        self.kl_estimator = None if kl.estimator == KL_OFF else KL_ESTIMATORS.get(kl.estimator)
        # Log-probs are those of the sampling distribution; greedy (0) evaluates at temperature 1.
        self.temperature = temperature or 1.0
        self.autocast_kind = autocast_kind
        guard = guard or GuardSection()
        self.step_guard = StepGuard(guard.max_consecutive_skips) if guard.enabled else None
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if self.distributed else (0, 1)
        self.policy_logits = policy_logits or ResponseLogprobs(policy, self.temperature)
        self.anchor_logits = anchor_logits or ResponseLogprobs(anchor.module, self.temperature)
        # The learner's setting, also on wrappers made elsewhere (fsdp_logits).
        self.policy_logits.chunk_tokens = self.anchor_logits.chunk_tokens = train.logprob_chunk_tokens
        self.sharded = hasattr(self.policy_logits, "set_requires_gradient_sync")  # an FSDP2 module
        # FSDP's ranks gather each layer's weights together, so they must run the same passes: a micro-batch that
        # shares a prefix runs the decoder twice. Off there.
        self.share_prefix = train.share_prefix and not self.sharded
        self.policy_logits.share_prefix = self.anchor_logits.share_prefix = self.share_prefix
        if self.distributed and not self.sharded:
            from torch.nn.parallel import DistributedDataParallel

            # DDP broadcasts rank 0's weights at construction, so every rank starts from the same policy.
            self.policy_logits = DistributedDataParallel(self.policy_logits)

    def token_stats(self, mb: RolloutBatch, ids: Tensor | None = None, anchor: bool = False,
                    **options) -> TokenLogprobs | Tensor:
        """Per-token log-prob statistics at the micro-batch's M model tokens (loss_mask), packed: log pi at the
        (M, n) `ids` and what `options` ask for (trainer.logprobs.token_logprobs). Every per-token quantity is
        computed there only, never at observations or padding (nothing is learned there, and they are most of a
        search trajectory's tokens). The policy's, or the anchor's; without `ids`, the (M, H) hidden states."""
        with autocast(self.autocast_kind, self.policy):
            return (self.anchor_logits if anchor else self.policy_logits)(mb, ids, **options)

    def gradient_sync(self, enabled: bool):
        """Context for one backward: with `enabled` False, gradients only accumulate locally (all but a rank's last
        micro-batch of a mini-batch); the last one's backward sums them over the ranks."""
        if self.distributed and self.sharded:
            self.policy_logits.set_requires_gradient_sync(enabled)
        elif self.distributed and not enabled:
            return self.policy_logits.no_sync()
        return nullcontext()

    def first_bad_micro_batch(self, mine: int | None) -> int | None:
        """The first micro-batch of the mini-batch with a non-finite loss on any rank (`mine`: this rank's), so that
        every rank skips the same steps."""
        if not self.distributed:
            return mine
        sentinel = torch.iinfo(torch.int64).max
        # On the model's device: NCCL reduces only GPU tensors.
        first = torch.tensor([sentinel if mine is None else mine], device=next(self.policy.parameters()).device)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        return None if int(first) == sentinel else int(first)

    def micro_rows(self, batch: RolloutBatch) -> list[Tensor]:
        """The batch's micro-batches (row indices): runs of rows that share prefixes where the learner shares them,
        else length-sorted (each micro-batch is cut to its longest response, so length-sorted ones pad least)."""
        if self.share_prefix:
            return prefix_micro_batches(batch, self.train.micro_batch_size)
        return micro_batches(batch.response_lengths().argsort(), self.train.micro_batch_size)

    def my_share(self, micro_rows: list) -> list:
        """This rank's micro-batches: every world_size-th (neighbours in the order, so ranks get similar work)."""
        return micro_rows[self.rank :: self.world_size]

    @torch.no_grad()
    def prepare(self, batch: RolloutBatch) -> PreparedBatch:
        """The batch with pi_old's token log-probs and the anchor's values at the top-k ids, computed micro-batch by
        micro-batch: k + 1 values per token are kept, and no pass holds more of the vocabulary than one chunk of
        tokens' logits (train.logprob_chunk_tokens; all of a micro-batch's at 0)."""
        k, direction = self.kl.topk, self.kl.direction
        n, width = batch.response_ids.shape
        device = batch.response_ids.device
        old_logprobs = torch.zeros(n, width, device=device)
        topk_ids = torch.zeros(n, width, k, dtype=torch.long, device=device)
        ref_topk_logprobs = torch.zeros(n, width, k, device=device)
        ref_token_logprob = torch.zeros(n, width, device=device)
        self.policy.eval()
        for rows in self.my_share(self.micro_rows(batch)):
            mb = batch.select(rows)  # cut to its longest response: w <= width columns
            w, mask = mb.response_ids.shape[1], mb.loss_mask
            tokens = mb.response_ids[mask][:, None]  # (M, 1)
            if direction == "reverse":  # q: pi_old's top-k; the anchor's log-probs there and at the token
                policy = self.token_stats(mb, tokens, topk=k)
                top = policy.topk_ids
                anchor_values = self.token_stats(mb, torch.cat([top, tokens], dim=-1), anchor=True).logprobs
                ref_topk, ref_token = anchor_values[:, :-1], anchor_values[:, -1]
            else:  # q: the anchor's top-k
                anchor = self.token_stats(mb, tokens, anchor=True, topk=k)
                top, ref_topk, ref_token = anchor.topk_ids, anchor.topk_logprobs, anchor.logprobs[:, 0]
                policy = self.token_stats(mb, tokens)
            old_logprobs[rows, :w] = scatter_tokens(policy.logprobs[:, 0], mask)
            topk_ids[rows, :w] = scatter_tokens(top, mask)
            ref_topk_logprobs[rows, :w] = scatter_tokens(ref_topk, mask)
            ref_token_logprob[rows, :w] = scatter_tokens(ref_token, mask)
        if self.distributed:  # each rank filled its own rows (zeros elsewhere): the sum is the whole batch
            for values in (old_logprobs, topk_ids, ref_topk_logprobs, ref_token_logprob):
                dist.all_reduce(values)
        self.reshard()
        rollout = {f.name: getattr(batch, f.name) for f in fields(RolloutBatch)}  # a PreparedBatch's are replaced
        return PreparedBatch(**rollout, old_logprobs=old_logprobs, topk_ids=topk_ids,
                             ref_topk_logprobs=ref_topk_logprobs, ref_token_logprob=ref_token_logprob)

    def reshard(self) -> None:
        """FSDP keeps a root's weights gathered after a forward pass with no backward (the root expects one next):
        free them, so the anchor's EMA update and the optimizer see shards on both sides."""
        if self.sharded:
            self.policy_logits.reshard()
            self.anchor_logits.reshard()

    def kl_per_token(self, stats: TokenLogprobs, mb: PreparedBatch) -> Tensor:
        """(N, T) per-token KL estimate from the policy's packed statistics (`micro_loss` asked for what the
        registered estimator reads: log pi at the top-k ids and the token, or the exact KL)."""
        mask, reads = mb.loss_mask, self.kl_estimator.reads
        inputs = KLInputs(
            token_logprob=stats.logprobs[:, -1], ref_token_logprob=mb.ref_token_logprob[mask],
            tokens=mb.response_ids[mask], direction=self.kl.direction,
            old_token_logprob=mb.old_logprobs[mask] if self.kl.importance_weight else None, iw_clip=self.kl.iw_clip,
            head_logprobs=stats.logprobs[:, :-1] if reads == "topk" else None,
            topk_ids=mb.topk_ids[mask] if reads == "topk" else None,
            ref_topk_logprobs=mb.ref_topk_logprobs[mask] if reads == "topk" else None,
            exact_kl=stats.kl if reads == "exact" else None,
        )
        return scatter_tokens(self.kl_estimator.fn(inputs), mask)

    def micro_loss(self, mb: PreparedBatch, weight: float) -> dict[str, float]:
        """Backward of this micro-batch's share of the mini-batch loss; returns its (weighted) stats."""
        mask = mb.loss_mask
        reads = self.kl_estimator.reads if self.kl_estimator else None
        ids = mb.response_ids[mask][:, None]  # the sampled token; the Top-k ids before it for estimators reading them
        if reads == "topk":
            ids = torch.cat([mb.topk_ids[mask], ids], dim=-1)
        reference = None
        if reads == "exact":  # the anchor's hidden states; its head runs beside the policy's, per chunk
            with torch.no_grad():
                reference = (self.token_stats(mb, anchor=True), self.anchor_logits.model.get_output_embeddings())
        # Entropy is always logged; it carries gradient only when it is in the loss.
        stats = self.token_stats(mb, ids, entropy=True, entropy_grad=self.train.entropy_coef > 0,
                                 reference=reference, direction=self.kl.direction)
        token_logprob = scatter_tokens(stats.logprobs[:, -1], mask)
        advantages = broadcast_to_tokens(mb.advantages, mask)
        pg_loss, pg_stats = ppo_clip_loss(
            token_logprob, mb.old_logprobs, advantages, mask,
            clip_low=self.train.clip_low, clip_high=self.train.clip_high, aggregation=self.train.aggregation,
        )
        loss = pg_loss
        out = {"policy_loss": float(pg_loss.detach()), **{k: float(v) for k, v in pg_stats.items()}}
        if self.kl_estimator is not None:
            kl = masked_mean(self.kl_per_token(stats, mb), mask, self.train.aggregation)
            loss = loss + self.kl.beta * kl
            out["kl"] = float(kl.detach())
        entropy = masked_mean(scatter_tokens(stats.entropy, mask), mask, self.train.aggregation)
        if self.train.entropy_coef > 0:
            loss = loss - self.train.entropy_coef * entropy
        out["entropy"] = float(entropy.detach())
        out["loss"] = float(loss.detach())
        # DDP and FSDP average gradients over ranks; x world_size makes it the sum of the ranks' shares of the mean.
        (loss * weight * self.world_size).backward()
        return {k: v * weight for k, v in out.items()}

    def update(self, batch: PreparedBatch, generator: torch.Generator | None = None,
               iteration: int = 0) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches of prepare()'s batch; returns stats averaged over the optimizer steps
        taken. With the guard on, a step with a non-finite micro-batch loss or gradient norm is skipped whole
        (`guard_skipped_steps`)."""
        if not isinstance(batch, PreparedBatch):
            raise TypeError(f"update() takes the PreparedBatch that prepare() returns, got {type(batch).__name__}")
        self.policy.train()
        totals: dict[str, float] = defaultdict(float)  # micro-batch stats (each rank has its share of them)
        step_totals: dict[str, float] = defaultdict(float)  # per optimizer step (the same on every rank)
        steps = skipped = 0
        for _ in range(self.train.ppo_epochs):
            order = torch.randperm(len(batch), generator=generator)
            for mini_rows in micro_batches(order, self.train.mini_batch_size):
                mini = batch.select(mini_rows)
                self.optimizer.zero_grad(set_to_none=True)
                micro_rows = self.micro_rows(mini)  # the accumulated gradient is the same sum in any grouping
                shares = micro_batch_shares(mini.loss_mask, micro_rows, self.train.aggregation)
                mine = list(zip(self.my_share(micro_rows), self.my_share(shares), strict=True))
                micro_totals: dict[str, float] = defaultdict(float)  # this step's; kept only if the step is taken
                bad_micro_batch = None  # this rank's first micro-batch (index in the mini-batch) with a non-finite loss
                for i, (rows, weight) in enumerate(mine):
                    if weight == 0.0 and not self.distributed:  # DDP/FSDP need every rank's backward passes
                        continue
                    with self.gradient_sync(enabled=i == len(mine) - 1):
                        micro_stats = self.micro_loss(mini.select(rows), weight)
                    if bad_micro_batch is None and not math.isfinite(micro_stats["loss"]):
                        bad_micro_batch = self.rank + i * self.world_size
                    for key, value in micro_stats.items():
                        micro_totals[key] += value
                # After the all-reduce (DDP/FSDP): the same norm on every rank.
                grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.train.grad_clip)
                if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
                    grad_norm = grad_norm.full_tensor()
                if self.step_guard is not None and self.step_guard.skip(
                        self.first_bad_micro_batch(bad_micro_batch), float(grad_norm),
                        f"iteration {iteration}, optimizer step {steps + skipped + 1}"):
                    self.optimizer.zero_grad(set_to_none=True)  # nothing of this step reaches weights or moments
                    skipped += 1
                    continue
                for key, value in micro_totals.items():
                    totals[key] += value
                step_totals["grad_norm"] += float(grad_norm)
                step_totals["lr"] += self.scheduler.get_last_lr()[0]
                self.optimizer.step()
                self.scheduler.step()
                steps += 1
        self.policy.eval()
        self.reshard()
        if self.distributed:  # every rank's share of the micro-batch stats, summed: the whole batch's
            keys = sorted(totals)
            # On the model's device: NCCL reduces only GPU tensors.
            summed = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=batch.loss_mask.device)
            dist.all_reduce(summed)
            totals = defaultdict(float, zip(keys, summed.tolist(), strict=True))
        stats = {k: v / max(steps, 1) for k, v in {**totals, **step_totals}.items()}
        mask = batch.loss_mask
        gap = (batch.sampler_logprobs - batch.old_logprobs).abs()[mask]
        stats["sampler_trainer_logprob_gap_mean"] = float(gap.mean()) if gap.numel() else 0.0
        stats["sampler_trainer_logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
        stats["optimizer_steps"] = steps
        stats["guard_skipped_steps"] = skipped
        return stats

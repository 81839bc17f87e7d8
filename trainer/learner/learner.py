"""The learner: one EMA-PG update from a batch of scored trajectories.

    prepare:  pi_old log-probs from the policy (no grad; on a strictly on-policy update the update's own forward gives
              them instead: `pi_old_from_update`) and what the KL estimator reads of the anchor (its `KLReads`):
              its log-prob at the token ("token"), also at pi_old's or its own top-k ids ("topk"), nothing
              ("exact", and the KL off): a new PreparedBatch (the RolloutBatch is left as it was)
    update:   PPO epochs x mini-batches (one optimizer step each) x micro-batches (gradient accumulation)
              loss = PPO-clip(A) [x TIS weights] + beta * KL(policy, anchor) - entropy_coef * entropy, over loss_mask
              a step with a non-finite micro-batch loss or gradient norm is skipped whole (trainer.run.guard)
    then the caller applies the EMA anchor update on its period.

Stats come back under flat names, which trainer.run.metrics_log.namespaced maps to the logged ones (`kl` -> kl/anchor,
...), except the gradient probe's grad/ metrics (trainer.gradient_probe), returned under their logged names.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import fields, replace

import torch
from torch import Tensor

from trainer.advantages import broadcast_to_tokens
from trainer.config import KL_OFF, GuardSection, KLSection, TrainSection
from trainer.ema import EmaAnchor, LoraEmaAnchor
from trainer.gradient_probe import GradientProbe
from trainer.kl import KLInputs
from trainer.learner.batch import (
    PreparedBatch,
    RolloutBatch,
    prefix_micro_batches,
    scatter_tokens,
    split_for_ranks,
    token_budget_micro_batches,
)
from trainer.learner.data_parallel import data_parallel
from trainer.learner.logprobs import ResponseLogprobs, TokenLogprobs, autocast
from trainer.policy_loss import masked_mean, ppo_clip_loss
from trainer.registry import KL_ESTIMATORS, LOSS_AGGREGATIONS
from trainer.rollout_correction import truncated_is_weights
from trainer.learner.step_guard import StepGuard


def micro_batches(rows: Tensor, size: int) -> list[Tensor]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def micro_batch_shares(loss_mask: Tensor, micro_rows: list[Tensor], aggregation: str = "token-mean") -> list[float]:
    """Each micro-batch's share of the mini-batch mean (its tokens, or its sequences, over the mini-batch's), so
    that accumulating share x micro-batch mean gives exactly the gradient of the whole mini-batch's mean."""
    count = LOSS_AGGREGATIONS.get(aggregation).count
    counts = [float(count(loss_mask[r])) for r in micro_rows]
    total = sum(counts)
    return [c / total if total else 0.0 for c in counts]


def add_into(totals: dict[str, float], values: dict[str, float]) -> None:
    for key, value in values.items():
        totals[key] += value


def sampler_gap(batch: PreparedBatch) -> dict[str, float]:
    """|log-prob the rollout engine reported - pi_old's| over model tokens: how far sampler and learner disagree."""
    gap = (batch.sampler_logprobs - batch.old_logprobs).abs()[batch.loss_mask]
    return {"sampler_trainer_logprob_gap_mean": float(gap.mean()) if gap.numel() else 0.0,
            "sampler_trainer_logprob_gap_max": float(gap.max()) if gap.numel() else 0.0}


def enable_gradient_checkpointing(model) -> None:
    """transformers' per-decoder-layer activation checkpointing (active in train mode only: the learner's gradient
    passes; its no-grad passes run in eval mode). Non-reentrant: the one that composes with FSDP2 and with inputs
    that need no gradient. Called before sharding."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class Learner:
    """One process's learner. Data-parallel (torch.distributed initialised, world size W): every rank holds the
    same batch; prepare() splits its micro-batches over the ranks and sums the results, update() gives rank r every
    W-th micro-batch of each mini-batch and DDP (or FSDP, when given sharded `policy_logits` / `anchor_logits` from
    `trainer.learner.data_parallel.fsdp_logits`) sums the gradients, so each optimizer step equals the one-process
    step on the whole mini-batch; `self.parallel` (trainer.learner.data_parallel) says how. Under FSDP every rank must
    run the same
    number of passes (they gather weights together): the config makes the micro-batches a multiple of W."""

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
        reads = self.kl_estimator.reads if self.kl_estimator else None
        self.reads_anchor = reads is not None and reads.values != "exact"  # in prepare; "exact" reads it in update
        self.reads_topk = reads is not None and reads.values == "topk"
        self.importance_weight = reads is not None and reads.importance_weight and kl.importance_weight
        # Log-probs are those of the sampling distribution; greedy (0) evaluates at temperature 1.
        self.temperature = temperature or 1.0
        self.autocast_kind = autocast_kind
        guard = guard or GuardSection()
        self.step_guard = StepGuard(guard.max_consecutive_skips) if guard.enabled else None
        self.policy_logits = policy_logits or ResponseLogprobs(policy, self.temperature)
        self.anchor_logits = anchor_logits or ResponseLogprobs(anchor.module, self.temperature)
        # The learner's setting, also on wrappers made elsewhere (fsdp_logits).
        self.policy_logits.chunk_tokens = self.anchor_logits.chunk_tokens = train.logprob_chunk_tokens
        self.parallel = data_parallel(self.policy_logits)
        self.share_prefix = train.share_prefix and self.parallel.share_prefix
        self.policy_logits.share_prefix = self.anchor_logits.share_prefix = self.share_prefix
        self.policy_logits = self.parallel.wrap(self.policy_logits)

    def token_stats(self, mb: RolloutBatch, ids: Tensor | None = None, anchor: bool = False,
                    **options) -> TokenLogprobs | Tensor:
        """Per-token log-prob statistics at the micro-batch's M model tokens (loss_mask), packed: log pi at the
        (M, n) `ids` and what `options` ask for (trainer.learner.logprobs.token_logprobs). Every per-token quantity is
        computed there only, never at observations or padding (nothing is learned there, and they are most of a
        search trajectory's tokens). The policy's, or the anchor's; without `ids`, the (M, H) hidden states."""
        with autocast(self.autocast_kind, self.policy):
            return (self.anchor_logits if anchor else self.policy_logits)(mb, ids, **options)

    def micro_rows(self, batch: RolloutBatch) -> list[Tensor]:
        """The batch's micro-batches (row indices): runs of rows that share prefixes where the learner shares them,
        else length-sorted (each micro-batch is cut to its longest response, so length-sorted ones pad least). With
        train.micro_batch_tokens, runs of at most that many decoder tokens each (`token_budget_micro_batches`),
        priced as this pass runs them (no shared prefix in a training pass under activation checkpointing), their
        number a multiple of the world size (FSDP's ranks run the same passes)."""
        if self.train.micro_batch_tokens:
            checkpointed = self.policy.training and getattr(self.policy, "is_gradient_checkpointing", False)
            runs = token_budget_micro_batches(batch, self.train.micro_batch_tokens,
                                              share_prefix=self.share_prefix and not checkpointed)
            return split_for_ranks(runs, self.parallel.world_size)
        if self.share_prefix:
            return prefix_micro_batches(batch, self.train.micro_batch_size)
        return micro_batches(batch.response_lengths().argsort(), self.train.micro_batch_size)

    def my_share(self, micro_rows: list) -> list:
        """This rank's micro-batches: every world_size-th (neighbours in the order, so ranks get similar work)."""
        return micro_rows[self.parallel.rank :: self.parallel.world_size]

    @torch.no_grad()
    def prepare(self, batch: RolloutBatch) -> PreparedBatch:
        """The batch with pi_old's token log-probs and what the KL estimator reads of the anchor (`KLReads`), computed
        micro-batch by micro-batch: no pass the estimator does not read (no top-k for the sampled estimators, no
        anchor pass for the exact KL, whose update pass reads the anchor, or with the KL off); at most k + 1 values
        per token are kept, and no pass holds more of the vocabulary than one chunk of tokens' logits
        (train.logprob_chunk_tokens; all of a micro-batch's at 0)."""
        k, forward_topk = self.kl.topk, self.kl.direction == "forward"
        pi_old_in_update = self.pi_old_from_update(batch)
        n, width = batch.response_ids.shape
        device = batch.response_ids.device
        old_logprobs = torch.zeros(n, width, device=device)
        ref_token_logprob = torch.zeros(n, width, device=device) if self.reads_anchor else None
        topk_ids = torch.zeros(n, width, k, dtype=torch.long, device=device) if self.reads_topk else None
        ref_topk_logprobs = torch.zeros(n, width, k, device=device) if self.reads_topk else None
        self.policy.eval()
        for rows in self.my_share(self.micro_rows(batch)):
            mb = batch.select(rows)  # cut to its longest response: w <= width columns
            w, mask = mb.response_ids.shape[1], mb.loss_mask
            tokens = mb.response_ids[mask][:, None]  # (M, 1)
            # q: pi_old's top-k (reverse) or the anchor's (forward); the anchor's log-probs there and at the token.
            if not pi_old_in_update:  # else the update's own forward gives pi_old (left 0 here until then)
                policy = self.token_stats(mb, tokens, topk=k if self.reads_topk and not forward_topk else None)
                old_logprobs[rows, :w] = scatter_tokens(policy.logprobs[:, 0], mask)
            if not self.reads_anchor:
                continue
            if self.reads_topk and forward_topk:
                anchor = self.token_stats(mb, tokens, anchor=True, topk=k)
                top, ref_topk, ref_token = anchor.topk_ids, anchor.topk_logprobs, anchor.logprobs[:, 0]
            elif self.reads_topk:
                top = policy.topk_ids
                anchor_values = self.token_stats(mb, torch.cat([top, tokens], dim=-1), anchor=True).logprobs
                ref_topk, ref_token = anchor_values[:, :-1], anchor_values[:, -1]
            else:
                ref_token = self.token_stats(mb, tokens, anchor=True).logprobs[:, 0]
            ref_token_logprob[rows, :w] = scatter_tokens(ref_token, mask)
            if self.reads_topk:
                topk_ids[rows, :w] = scatter_tokens(top, mask)
                ref_topk_logprobs[rows, :w] = scatter_tokens(ref_topk, mask)
        # Each rank filled its own rows (zeros elsewhere): the sum is the whole batch.
        self.parallel.sum(*(v for v in (old_logprobs, topk_ids, ref_topk_logprobs, ref_token_logprob) if v is not None))
        self.reshard()
        rollout = {f.name: getattr(batch, f.name) for f in fields(RolloutBatch)}  # a PreparedBatch's are replaced
        return PreparedBatch(**rollout, old_logprobs=old_logprobs, topk_ids=topk_ids,
                             ref_topk_logprobs=ref_topk_logprobs, ref_token_logprob=ref_token_logprob)

    def pi_old_from_update(self, batch: RolloutBatch) -> bool:
        """Strictly on-policy (one epoch, one mini-batch, one process): the update's forward, before its only step, is
        pi_old itself, so prepare runs no policy pass and the update reads pi_old off its own forward, detached (the
        PPO ratio is then exactly 1, as in TRL's GRPO step). Not with reverse Top-k, whose anchor pass in prepare
        needs pi_old's top-k ids first (and gets pi_old's log-probs from that same pass at no extra cost)."""
        return (self.train.ppo_epochs == 1 and self.train.mini_batch_size >= len(batch)
                and self.parallel.world_size == 1 and not (self.reads_topk and self.kl.direction == "reverse"))

    def reshard(self) -> None:
        """FSDP keeps a root's weights gathered after a forward pass with no backward (the root expects one next):
        free them, so the anchor's EMA update and the optimizer see shards on both sides."""
        self.parallel.reshard(self.policy_logits, self.anchor_logits)

    def kl_per_token(self, stats: TokenLogprobs, mb: PreparedBatch) -> Tensor:
        """(N, T) per-token KL estimate from the policy's packed statistics (`micro_loss` asked for what the
        registered estimator reads: log pi at the top-k ids and the token, or the exact KL)."""
        mask, weighted = mb.loss_mask, self.importance_weight
        inputs = KLInputs(
            token_logprob=stats.logprobs[:, -1],
            ref_token_logprob=mb.ref_token_logprob[mask] if self.reads_anchor else None,
            tokens=mb.response_ids[mask], direction=self.kl.direction,
            old_token_logprob=mb.old_logprobs[mask] if weighted else None,
            iw_clip=self.kl.iw_clip if weighted else None,
            head_logprobs=stats.logprobs[:, :-1] if self.reads_topk else None,
            topk_ids=mb.topk_ids[mask] if self.reads_topk else None,
            ref_topk_logprobs=mb.ref_topk_logprobs[mask] if self.reads_topk else None,
            exact_kl=stats.kl,
        )
        return scatter_tokens(self.kl_estimator.fn(inputs), mask)

    def micro_loss(self, mb: PreparedBatch, weight: float, probe: GradientProbe | None = None,
                   pi_old_in_update: bool = False) -> tuple[dict[str, float], Tensor]:
        """Backward of this micro-batch's share of the mini-batch loss; returns its (weighted) stats and the pi_old
        log-probs it used, (n, w). With a `probe`, the KL term's share of that gradient is also taken apart for it
        (one backward more, of the KL term alone). With `pi_old_in_update`, pi_old is this forward's own log-probs,
        detached (`pi_old_from_update`)."""
        mask = mb.loss_mask
        ids = mb.response_ids[mask][:, None]  # the sampled token; the Top-k ids before it for estimators reading them
        if self.reads_topk:
            ids = torch.cat([mb.topk_ids[mask], ids], dim=-1)
        reference = None
        if self.kl_estimator is not None and self.kl_estimator.reads.values == "exact":
            with torch.no_grad():  # the anchor's hidden states; its head runs beside the policy's, per chunk
                reference = (self.token_stats(mb, anchor=True), self.anchor_logits.model.get_output_embeddings())
        # Entropy is always logged; it carries gradient only when it is in the loss.
        stats = self.token_stats(mb, ids, entropy=True, entropy_grad=self.train.entropy_coef > 0,
                                 reference=reference, direction=self.kl.direction)
        token_logprob = scatter_tokens(stats.logprobs[:, -1], mask)
        if pi_old_in_update:
            mb = replace(mb, old_logprobs=token_logprob.detach())
        advantages = broadcast_to_tokens(mb.advantages, mask)
        tis = None
        if self.train.tis_cap is not None:
            tis = truncated_is_weights(mb.old_logprobs, mb.sampler_logprobs, mask, self.train.tis_cap,
                                       self.train.tis_level)
        pg_loss, pg_stats = ppo_clip_loss(
            token_logprob, mb.old_logprobs, advantages, mask,
            clip_low=self.train.clip_low, clip_high=self.train.clip_high, aggregation=self.train.aggregation,
            token_weights=tis,
        )
        loss = pg_loss
        out = {"policy_loss": float(pg_loss.detach()), **{k: float(v) for k, v in pg_stats.items()}}
        if tis is not None:  # token means over the mask, whatever the aggregation
            out["loss/tis_weight_mean"] = float(masked_mean(tis, mask))
            out["loss/tis_capped_fraction"] = float(masked_mean((tis >= self.train.tis_cap).float(), mask))
        kl_term = None
        if self.kl_estimator is not None:
            kl = masked_mean(self.kl_per_token(stats, mb), mask, self.train.aggregation)
            kl_term = self.kl.beta * kl
            loss = loss + kl_term
            out["kl"] = float(kl.detach())
        entropy = masked_mean(scatter_tokens(stats.entropy, mask), mask, self.train.aggregation)
        if self.train.entropy_coef > 0:
            loss = loss - self.train.entropy_coef * entropy
        out["entropy"] = float(entropy.detach())
        out["loss"] = float(loss.detach())
        # DDP and FSDP average gradients over ranks; x world_size makes it the sum of the ranks' shares of the mean.
        scale = weight * self.parallel.world_size
        if probe is not None and kl_term is not None:
            probe.add(kl_term * scale)
        (loss * scale).backward()
        return {k: v * weight for k, v in out.items()}, mb.old_logprobs

    def probe_now(self, iteration: int) -> GradientProbe | None:
        """A probe for this iteration's first step, every `train.grad_probe_every` iterations from the first (one
        process only: under DDP/FSDP the extra backward would have to run on every rank, in lockstep)."""
        every = self.train.grad_probe_every
        if every == 0 or (iteration - 1) % every or self.parallel.lockstep:
            return None
        return GradientProbe([p for p in self.policy.parameters() if p.requires_grad])

    def update(self, batch: PreparedBatch, generator: torch.Generator | None = None,
               iteration: int = 0) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches of prepare()'s batch, one optimizer step each; returns stats averaged
        over the steps taken, and on a probed iteration (`probe_now`) the grad/ metrics of its first step. With the
        guard on, a step with a non-finite micro-batch loss or gradient norm is skipped whole
        (`guard_skipped_steps`)."""
        if not isinstance(batch, PreparedBatch):
            raise TypeError(f"update() takes the PreparedBatch that prepare() returns, got {type(batch).__name__}")
        self.policy.train()
        totals: dict[str, float] = defaultdict(float)  # micro-batch stats (each rank has its share of them)
        step_totals: dict[str, float] = defaultdict(float)  # per optimizer step (the same on every rank)
        probe, probed = self.probe_now(iteration), {}
        pi_old_in_update = self.pi_old_from_update(batch)
        steps = skipped = 0
        for _ in range(self.train.ppo_epochs):
            order = torch.randperm(len(batch), generator=generator)
            for mini_rows in micro_batches(order, self.train.mini_batch_size):
                mini = batch.select(mini_rows)
                micro_totals, bad_micro_batch = self.accumulate(mini, probe, pi_old_in_update)
                if pi_old_in_update:  # what the update read as pi_old: the batch's, for the sampler-gap metric
                    batch.old_logprobs[mini_rows, : mini.old_logprobs.shape[1]] = mini.old_logprobs
                if probe is not None:  # before clipping: the gradient as the loss made it
                    probed, probe = probe.finish(), None
                # After the all-reduce (DDP/FSDP): the same norm on every rank.
                grad_norm = float(self.parallel.whole(
                    torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.train.grad_clip)))
                if self.skip_step(bad_micro_batch, grad_norm, batch, f"iteration {iteration}, optimizer step "
                                  f"{steps + skipped + 1}"):
                    skipped += 1
                    continue
                add_into(totals, micro_totals)
                add_into(step_totals, {"grad_norm": grad_norm, "lr": self.scheduler.get_last_lr()[0]})
                self.optimizer.step()
                self.scheduler.step()
                steps += 1
        self.policy.eval()
        self.reshard()
        stats = {k: v / max(steps, 1) for k, v in {**self.summed_over_ranks(totals, batch), **step_totals}.items()}
        return {**stats, **sampler_gap(batch), "optimizer_steps": steps, "guard_skipped_steps": skipped, **probed}

    def accumulate(self, mini: PreparedBatch, probe: GradientProbe | None,
                   pi_old_in_update: bool = False) -> tuple[dict[str, float], int | None]:
        """Forward and backward of this rank's micro-batches of one mini-batch into fresh .grad (each weighted by its
        share of the mini-batch mean); returns their summed stats and the index of this rank's first micro-batch with
        a non-finite loss (None when all are finite). With `pi_old_in_update`, the pi_old each micro-batch read off
        its forward is written into `mini.old_logprobs`."""
        parallel = self.parallel
        self.optimizer.zero_grad(set_to_none=True)
        micro_rows = self.micro_rows(mini)  # the accumulated gradient is the same sum in any grouping
        shares = micro_batch_shares(mini.loss_mask, micro_rows, self.train.aggregation)
        mine = list(zip(self.my_share(micro_rows), self.my_share(shares), strict=True))
        totals: dict[str, float] = defaultdict(float)
        bad_micro_batch = None
        for i, (rows, weight) in enumerate(mine):
            if weight == 0.0 and not parallel.lockstep:  # DDP/FSDP need every rank's backward passes
                continue
            with parallel.gradient_sync(self.policy_logits, enabled=i == len(mine) - 1):
                micro_stats, old = self.micro_loss(mini.select(rows), weight, probe, pi_old_in_update)
            if pi_old_in_update:
                mini.old_logprobs[rows, : old.shape[1]] = old
            if bad_micro_batch is None and not math.isfinite(micro_stats["loss"]):
                bad_micro_batch = parallel.rank + i * parallel.world_size
            add_into(totals, micro_stats)
        return totals, bad_micro_batch

    def skip_step(self, bad_micro_batch: int | None, grad_norm: float, batch: PreparedBatch, where: str) -> bool:
        """The guard's call on this step (every rank agrees); a skipped step's gradient is dropped, so nothing of it
        reaches weights, moments or schedule."""
        if self.step_guard is None:
            return False
        bad = self.parallel.first_bad_micro_batch(bad_micro_batch, batch.loss_mask.device)
        if not self.step_guard.skip(bad, grad_norm, where):
            return False
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def summed_over_ranks(self, totals: dict[str, float], batch: PreparedBatch) -> dict[str, float]:
        """Every rank's share of the micro-batch stats, summed: the whole batch's (on the batch's device: NCCL reduces
        only GPU tensors)."""
        keys = sorted(totals)
        summed = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=batch.loss_mask.device)
        self.parallel.sum(summed)
        return dict(zip(keys, summed.tolist(), strict=True))

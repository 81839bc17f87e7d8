"""The SFT warm start: maximise the log-likelihood of demonstration trajectories on their model tokens only.

    loss = token-mean over loss_mask of -log pi(token)

Observations are in the input (the model learns to read them) but never in the loss, exactly as in RL. The final
checkpoint is in the trainer's format, its anchor equal to its policy, so `emapg train --init` starts EMA-PG from
it with the anchor at the SFT model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor
from transformers import get_constant_schedule_with_warmup

from agent.trajectory import Trajectory
from trainer.learner.batch import collate
from trainer.learner.logprobs import autocast, response_logits
from trainer.run.metrics_log import RunLogger
from trainer.run.sampler import PromptSampler
from trainer.run.checkpoint import Checkpoint, rng_state, save_checkpoint
from trainer.config import TrainConfig
from trainer.kl import gather_logprobs
from trainer.learner.learner import micro_batch_shares, micro_batches


def sft_loss(token_logits: Tensor, token_ids: Tensor) -> Tensor:
    """Mean negative log-likelihood of the model tokens: (M, V) logits at the loss_mask positions, (M,) ids."""
    return -gather_logprobs(token_logits, token_ids[:, None])[:, 0].mean()


class SFTTrainer:
    def __init__(self, cfg: TrainConfig, policy, demonstrations: list[Trajectory], pad_id: int):
        if not demonstrations:
            raise ValueError("no demonstrations to train on")
        self.cfg, self.policy, self.pad_id = cfg, policy, pad_id
        s = cfg.sft
        # Per-tensor AdamW, not trainer.schedule.adamw's fused one: an SFT start is identified by its weights' sha256
        # (the studies' start rules, `emapg compare`'s resume), and the fused step rounds differently.
        self.optimizer = torch.optim.AdamW(policy.parameters(), lr=s.lr, betas=cfg.train.betas,
                                           weight_decay=s.weight_decay)
        self.scheduler = get_constant_schedule_with_warmup(self.optimizer, s.warmup_steps)
        self.sampler = PromptSampler(demonstrations, cfg.seed)  # seeded epochs over the demonstrations
        self.steps = math.ceil(len(demonstrations) * s.epochs / s.batch_size)
        self.step_count = 0

    def step(self) -> dict[str, float]:
        s = self.cfg.sft
        start = time.perf_counter()
        batch = collate(self.sampler.next(s.batch_size), torch.zeros(s.batch_size), self.pad_id)
        batch = batch.to(next(self.policy.parameters()).device)
        self.policy.train()
        self.optimizer.zero_grad(set_to_none=True)
        micro_rows = micro_batches(batch.response_lengths().argsort(), s.micro_batch_size)
        loss_total = 0.0
        for rows, share in zip(micro_rows, micro_batch_shares(batch.loss_mask, micro_rows), strict=True):
            mb = batch.select(rows)
            with autocast(self.cfg.autocast, self.policy):
                logits = response_logits(self.policy, mb, only=mb.loss_mask)
            loss = sft_loss(logits, mb.response_ids[mb.loss_mask])
            (loss * share).backward()
            loss_total += float(loss.detach()) * share
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), s.grad_clip))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.policy.eval()
        self.step_count += 1
        return {"loss/sft": loss_total, "loss/grad_norm": grad_norm, "loss/lr": lr,
                "loss/model_tokens": float(batch.loss_mask.sum()), "time/step_s": time.perf_counter() - start}

    def state(self) -> Checkpoint:
        weights = self.policy.state_dict()
        return Checkpoint(
            iteration=self.step_count, policy=weights, anchor=weights, optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict(), rng=rng_state(), data_cursor=self.sampler.cursor(),
            config=self.cfg.model_dump(mode="json"),
        )

    def run(self, progress: Callable[[int, dict], None] | None = None) -> Path:
        """Train for the configured epochs; returns the final checkpoint's folder."""
        logger = RunLogger(self.cfg.sft_dir, self.cfg, job_type="sft")
        try:
            while self.step_count < self.steps:
                metrics = self.step()
                logger.log(self.step_count, metrics)
                if progress:
                    progress(self.step_count, metrics)
        finally:
            logger.close()
        return save_checkpoint(self.state(), self.cfg.sft_dir, keep=self.cfg.checkpoint.keep)

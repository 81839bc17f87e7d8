"""The EMA-PG training loop (in-process; trainer.distributed runs the same loop with Ray actors behind it).

Per iteration:
    0. weight sync: an engine with its own copy of the weights (vLLM) gets the policy's, in place
    1. sample B prompts (a seeded permutation per epoch; the cursor is checkpointed)
    2. G rollouts each with the current policy (token-exact trajectories, retrieval over HTTP)
    3. rewards (EM, + optional format bonus) -> GRPO advantages per group (group id = example id)
    4. learner.prepare (pi_old, anchor top-k) and learner.update (PPO epochs, AdamW)
    5. EMA anchor update on every `ema.period`-th iteration
    6. log (TensorBoard + JSONL), checkpoint every `checkpoint.every` iterations
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from agent.backend import SamplingParams
from agent.hf_backend import TransformersBackend
from agent.rollout import RolloutConfig, SearchAgent
from agent.trajectory import Trajectory, save_jsonl
from data.qa import QAExample
from trainer.advantages import grpo_advantages
from trainer.batch import RolloutBatch, collate
from trainer.checkpoint import (
    Checkpoint,
    check_compatible,
    latest_checkpoint,
    load_checkpoint,
    load_policy_weights,
    optimizer_state_by_index,
    optimizer_state_by_name,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainer.config import TrainConfig
from trainer.ema import EmaAnchor, LoraEmaAnchor, ema_anchor, should_update_ema
from trainer.learner import Learner, enable_gradient_checkpointing, fsdp_logits
from trainer.lora import (
    apply_lora,
    engine_weights,
    load_policy_checkpoint_state,
    merged_weights,
    policy_checkpoint_state,
    uses_lora,
)
from trainer.reward import reward

RewardFn = Callable[[Trajectory], tuple[float, float, float]]  # -> (reward, em, format)


@dataclass
class PromptSampler:
    """Epochs over a fixed example list, each in a seeded random order; (epoch, position) is the cursor."""

    examples: list[QAExample]
    seed: int
    epoch: int = 0
    position: int = 0

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.examples))

    def next(self, n: int) -> list[QAExample]:
        out: list[QAExample] = []
        while len(out) < n:
            order = self._order()
            take = order[self.position : self.position + n - len(out)]
            out += [self.examples[i] for i in take]
            self.position += len(take)
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def cursor(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "size": len(self.examples)}

    def restore(self, cursor: dict) -> None:
        if cursor.get("size") != len(self.examples) or cursor.get("seed") != self.seed:
            raise ValueError(f"checkpoint data cursor {cursor} does not match {len(self.examples)} train examples")
        self.epoch, self.position = cursor["epoch"], cursor["position"]


class RunLogger:
    """Per-iteration metrics to `metrics.jsonl` and TensorBoard (`tb/`)."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self.tb = SummaryWriter(str(run_dir / "tb"))

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        self.jsonl.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        self.jsonl.flush()
        for key, value in metrics.items():
            self.tb.add_scalar(key, value, iteration)
        self.tb.flush()

    def close(self) -> None:
        self.jsonl.close()
        self.tb.close()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps)))


def rollout_metrics(trajs: list[Trajectory], scores: list[tuple[float, float, float]]) -> dict[str, float]:
    n = len(trajs)
    total_turns = sum(len(t.turns) for t in trajs)
    mask_tokens = sum(len(t.loss_mask) for t in trajs)
    return {
        "reward": sum(s[0] for s in scores) / n,
        "em": sum(s[1] for s in scores) / n,
        "format": sum(s[2] for s in scores) / n,
        "response_tokens": sum(t.model_tokens for t in trajs) / n,
        "observation_tokens": sum(t.observation_tokens for t in trajs) / n,
        "searches": sum(t.num_searches for t in trajs) / n,
        "turns": total_turns / n,
        "invalid_action_rate": sum(t.num_invalid for t in trajs) / max(1, total_turns),
        "loss_mask_coverage": sum(t.model_tokens for t in trajs) / max(1, mask_tokens),
    }


def rollout_config(cfg: TrainConfig) -> RolloutConfig:
    r = cfg.rollout
    return RolloutConfig(max_turns=r.max_turns, max_tokens_per_turn=r.max_tokens_per_turn,
                         max_obs_tokens=r.max_obs_tokens, topk=cfg.retriever.topk, mode=r.mode)


def rollout_backend(cfg: TrainConfig, policy, tokenizer):
    """The configured rollout engine. transformers samples from `policy` itself; vLLM holds its own copy of the
    weights, which `Trainer` syncs in place after every update."""
    r = cfg.rollout
    if r.backend == "transformers":
        return TransformersBackend(policy, tokenizer, max_batch_size=r.batch_size)
    from agent.policy import resolve_policy
    from agent.vllm_backend import VLLMBackend

    return VLLMBackend(resolve_policy(cfg.model), dtype=r.dtype or cfg.dtype, seed=cfg.seed,
                       gpu_memory_utilization=r.gpu_memory_utilization, max_model_len=r.max_model_len)


class PolicyTrainer:
    """The learning side of a run in one process: policy, EMA anchor, optimizer and schedule, and the EMA-PG step
    on a scored batch. The in-process Trainer holds one; under Ray every learner rank holds one (trainer.distributed).
    With torch.distributed initialised and `distributed.strategy=fsdp`, policy and anchor are sharded the same way
    over the ranks (each rank updates its own shard of the anchor) and the optimizer holds only this rank's shard.
    """

    def __init__(self, cfg: TrainConfig, policy):
        self.cfg = cfg
        self.policy = policy
        t = cfg.train
        if cfg.lora.rank:  # in place: a rollout engine sampling from `policy` itself samples with the adapters
            apply_lora(policy, cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules, cfg.lora.dropout)
        self.anchor = ema_anchor(policy, dtype=getattr(torch, cfg.ema.dtype))
        if t.gradient_checkpointing:  # the policy only: the anchor never runs a gradient pass
            enable_gradient_checkpointing(policy)
        self.sharded = cfg.distributed.strategy == "fsdp" and torch.distributed.is_initialized()
        logits = {}
        if self.sharded:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(next(policy.parameters()).device.type, (torch.distributed.get_world_size(),))
            temperature = cfg.rollout.temperature or 1.0
            logits = {"policy_logits": fsdp_logits(policy, temperature, mesh),
                      "anchor_logits": fsdp_logits(self.anchor.module, temperature, mesh)}
        # After sharding: the optimizer must hold the sharded parameters; the trained ones only (LoRA: the adapters).
        trained = [(name, p) for name, p in policy.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW([p for _, p in trained], lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        self.scheduler = warmup_schedule(self.optimizer, t.warmup_steps)
        self.parameter_names = [name for name, _ in trained]  # the optimizer's parameter order
        self.learner = Learner(policy, self.anchor, self.optimizer, self.scheduler, t, cfg.kl, cfg.rollout.temperature,
                               cfg.autocast, **logits)

    def train_step(self, batch: RolloutBatch, iteration: int) -> dict[str, float]:
        """learner.prepare (pi_old, anchor top-k), learner.update (PPO epochs, AdamW), then the EMA anchor update on
        its period; returns the update's stats and timings."""
        cfg = self.cfg
        batch = batch.to(next(self.policy.parameters()).device)
        start = time.perf_counter()
        self.learner.prepare(batch)
        timings = {"time_prepare_s": time.perf_counter() - start}
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(cfg.seed * 7919 + iteration)
        stats = self.learner.update(batch, generator)
        timings["time_update_s"] = time.perf_counter() - start
        start = time.perf_counter()
        if should_update_ema(iteration, cfg.ema.period):
            self.anchor.update(self.policy, cfg.ema.tau)
        timings["time_ema_s"] = time.perf_counter() - start
        return {**stats, "anchor_distance": self.anchor.distance(self.policy), **timings}

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's full weights on CPU (for the rollout engines), one independent copy per name: tied weights
        come back as separate tensors, which safetensors (vLLM's sync) requires. Sharded: a collective, as `state()`."""
        if not self.sharded:  # LoRA: merged, W0 + s B A under the base model's names
            return {name: t.detach().to("cpu", copy=True)
                    for name, t in merged_weights(self.policy, self.policy.state_dict().items())}
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        full = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {name: t.clone() for name, t in full.items()}

    def state(self) -> dict:
        """Full (unsharded) tensors. Sharded: a collective (every rank must call it); rank 0 gets the state on CPU,
        the others empty dicts."""
        if not self.sharded:  # LoRA: the adapters, not the frozen base
            return {"policy": policy_checkpoint_state(self.policy), "anchor": self.anchor.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        anchor = get_model_state_dict(self.anchor.module, options=full)
        optimizer = get_optimizer_state_dict(self.policy, self.optimizer, options=full)
        return {"policy": get_model_state_dict(self.policy, options=full),
                "anchor": {name: anchor[name] for name in self.anchor.state_dict()} if anchor else {},
                "optimizer": optimizer_state_by_index(optimizer, self.parameter_names) if optimizer else {},
                "scheduler": self.scheduler.state_dict()}

    def load_state(self, state: dict) -> None:
        """From `state()`'s full tensors (every rank gets the same dict; sharded, each keeps its own shard)."""
        if not self.sharded:
            load_policy_checkpoint_state(self.policy, state["policy"])
            self.anchor.load_state_dict(state["anchor"])
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            full = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.policy, state["policy"], options=full)
            # The anchor's state names tied weights once; the tied copy is the same parameter.
            set_model_state_dict(self.anchor.module, state["anchor"], options=StateDictOptions(full_state_dict=True,
                                                                                              strict=False))
            set_optimizer_state_dict(self.policy, self.optimizer,
                                     optimizer_state_by_name(state["optimizer"], self.parameter_names), options=full)
        self.scheduler.load_state_dict(state["scheduler"])

    def init_from(self, path: Path) -> None:
        """Start RL from another run's checkpoint or run folder (e.g. SFT): its policy, and the anchor set to it."""
        if uses_lora(self.policy):  # its checkpoints hold adapters only: a resume would reload `model` as the base
            raise ValueError("lora.rank > 0 adapts `model`'s own weights; starting from another run's checkpoint "
                             "(--init) is not supported yet")
        weights = load_policy_weights(path)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            set_model_state_dict(self.policy, weights, options=StateDictOptions(full_state_dict=True))
        else:
            self.policy.load_state_dict(weights)
        self.anchor.reset_to(self.policy)


class Trainer:
    """A run: rollouts, rewards, advantages, the learning step, weight sync, logs and checkpoints. In-process here;
    `trainer.distributed.RayTrainer` runs the same loop (`step`, `run`) with Ray actors behind `rollout`, `learn`,
    `sync_weights`, `learner_state` and `load_learner_state`."""

    def __init__(self, cfg: TrainConfig, policy, tokenizer, examples: list[QAExample], *, retriever=None,
                 reward_fn: RewardFn | None = None, backend=None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.sampler = PromptSampler(examples, cfg.seed)
        self.reward_fn = reward_fn or (lambda traj: reward(traj, cfg.reward.format))
        self.iteration = 0
        # An engine with its own copy of the weights (vLLM) gets the policy's before the first rollout (it loaded the
        # base model; the run may start from an SFT checkpoint or resume) and after every update.
        self.weights_stale = True
        if policy is None:  # a subclass runs the policy elsewhere (Ray actors)
            return
        self.learning = PolicyTrainer(cfg, policy)
        self.backend = backend or rollout_backend(cfg, policy, tokenizer)
        self.agent = SearchAgent(self.backend, tokenizer, retriever, rollout_config(cfg))

    @property
    def policy(self):
        return self.learning.policy

    @property
    def anchor(self) -> EmaAnchor | LoraEmaAnchor:
        return self.learning.anchor

    # --- what a distributed trainer replaces ----------------------------------------------------------------------
    def rollout(self, examples: list[QAExample], params: SamplingParams) -> list[Trajectory]:
        return self.agent.rollout(examples, params, self.cfg.train.rollouts_per_prompt)

    def learn(self, batch: RolloutBatch) -> dict[str, float]:
        return self.learning.train_step(batch, self.iteration)

    def sync_weights(self) -> None:
        """Copy the policy into the rollout engine in place (vLLM); the transformers backend samples from it."""
        if self.weights_stale and hasattr(self.backend, "load_weights"):
            self.backend.load_weights(engine_weights(self.policy))  # LoRA: merged weights
        self.weights_stale = False

    def learner_state(self) -> dict:
        return self.learning.state()

    def load_learner_state(self, state: dict) -> None:
        self.learning.load_state(state)

    def init_from(self, path: Path) -> None:
        self.learning.init_from(path)
        self.weights_stale = True

    # --- the loop ---------------------------------------------------------------------------------------------------
    def state(self) -> Checkpoint:
        return Checkpoint(iteration=self.iteration, **self.learner_state(), rng=rng_state(),
                          data_cursor=self.sampler.cursor(), config=self.cfg.model_dump(mode="json"))

    def restore(self, path: Path) -> None:
        ckpt = load_checkpoint(path)
        check_compatible(ckpt.config, self.cfg.model_dump(mode="json"), keys=("model", "seed"))
        self.load_learner_state({"policy": ckpt.policy, "anchor": ckpt.anchor, "optimizer": ckpt.optimizer,
                                 "scheduler": ckpt.scheduler})
        self.sampler.restore(ckpt.data_cursor)
        set_rng_state(ckpt.rng)
        self.iteration = ckpt.iteration
        self.weights_stale = True

    def step(self) -> dict[str, float]:
        """One iteration; returns its metrics."""
        cfg, t = self.cfg, self.cfg.train
        self.iteration += 1
        start = time.perf_counter()
        self.sync_weights()
        timings = {"time_weight_sync_s": time.perf_counter() - start}
        start = time.perf_counter()
        examples = self.sampler.next(t.prompts_per_iteration)
        params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                max_tokens=cfg.rollout.max_tokens_per_turn, seed=cfg.seed * 1_000_003 + self.iteration)
        trajs = self.rollout(examples, params)
        timings["time_rollout_s"] = time.perf_counter() - start

        scores = [self.reward_fn(traj) for traj in trajs]
        advantages = grpo_advantages(torch.tensor([s[0] for s in scores]), [traj.group_id for traj in trajs],
                                     normalize_std=t.normalize_adv_std)
        stats = self.learn(collate(trajs, advantages, self.tokenizer.pad_token_id or 0))
        self.weights_stale = True
        save_jsonl(trajs, cfg.run_dir / "trajectories" / f"iter-{self.iteration:06d}.jsonl")
        return {**rollout_metrics(trajs, scores), **stats, **timings}

    def run(self, progress: Callable[[int, dict], None] | None = None, until: int | None = None) -> list[dict[str, float]]:
        """Train to iteration `until` (default: the configured total), so a caller can pause to evaluate."""
        logger = RunLogger(self.cfg.run_dir)
        history = []
        stop = min(until or self.cfg.train.iterations, self.cfg.train.iterations)
        try:
            while self.iteration < stop:
                metrics = self.step()
                logger.log(self.iteration, metrics)
                history.append(metrics)
                if self.iteration % self.cfg.checkpoint.every == 0 or self.iteration == self.cfg.train.iterations:
                    save_checkpoint(self.state(), self.cfg.run_dir, keep=self.cfg.checkpoint.keep)
                if progress:  # after the checkpoint: what it reports is already on disk
                    progress(self.iteration, metrics)
        finally:
            logger.close()
        return history


def resume_or_start(trainer: Trainer, resume: bool, init: Path | None) -> None:
    if resume:
        path = latest_checkpoint(trainer.cfg.run_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {trainer.cfg.run_dir / 'checkpoints'}")
        trainer.restore(path)
    elif init is not None:
        trainer.init_from(init)


"""The workers a training run drives (docs/algorithm.md §6): roll out, learn, sync weights, state, load state, init
from a checkpoint. `LocalWorkers` does it in this process; `trainer.run.ray_workers.RayWorkers` on Ray actors (rollout
workers, learner ranks). Both learn with `PolicyTrainer` and roll out with an agent from agent.factory.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch

from agent.backend import RolloutBackend, SamplingParams
from agent.rollout import RolloutAgent
from agent.seeds import update_seed
from agent.trajectory import Trajectory
from data.qa import QAExample
from trainer.learner.batch import RolloutBatch
from trainer.run.metrics_log import merge_metrics
from trainer.run.checkpoint import (
    load_policy_weights,
    optimizer_state_by_index,
    optimizer_state_by_name,
    optimizer_state_for,
    portable_optimizer_state,
)
from trainer.config import TrainConfig
from trainer.learner.data_parallel import fsdp_logits
from trainer.ema import anchor_weights_in, ema_anchor, should_update_ema
from trainer.lora import (
    apply_lora,
    engine_weights,
    load_base_weights,
    load_policy_checkpoint_state,
    merged_weights,
    policy_checkpoint_state,
    uses_lora,
)
from trainer.learner.learner import Learner, enable_gradient_checkpointing
from trainer.schedule import adamw, learning_rate_schedule


class Workers(Protocol):
    def rollout(self, examples: list[QAExample], params: SamplingParams,
                samples: int) -> tuple[list[Trajectory], dict[str, float]]:
        """`samples` trajectories per example with the current policy, and the rollout's stats
        (`rollout_retrieval_wait_s`: seconds the engine waited on retrieval)."""
        ...

    def learn(self, batch: RolloutBatch, iteration: int) -> dict[str, float]:
        """The EMA-PG step on a scored batch (prepare, update, the EMA anchor on its period): stats and timings."""
        ...

    def sync_weights(self) -> None:
        """Copy the policy into the rollout engine(s), when it changed since the last copy."""
        ...

    def state(self) -> dict:
        """The learner's full state: policy, anchor, optimizer, scheduler (what a checkpoint holds)."""
        ...

    def load_state(self, state: dict) -> None: ...

    def init_from(self, path: Path) -> None:
        """Start from another run's checkpoint or run folder (e.g. SFT): its policy, the anchor set to it."""
        ...


class PolicyTrainer:
    """The learning side of a run in one process: policy, EMA anchor, optimizer and schedule, and the EMA-PG step
    on a scored batch. LocalWorkers holds one; under Ray every learner rank holds one (trainer.run.ray_workers).
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
        # After sharding: the optimizer must hold the sharded parameters.
        trained = [(name, p) for name, p in policy.named_parameters() if p.requires_grad]
        self.optimizer = adamw([p for _, p in trained], lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
        self.scheduler = learning_rate_schedule(self.optimizer, t)
        self.parameter_names = [name for name, _ in trained]  # the optimizer's parameter order
        self.learner = Learner(policy, self.anchor, self.optimizer, self.scheduler, t, cfg.kl, cfg.rollout.temperature,
                               cfg.autocast, guard=cfg.guard, **logits)

    def train_step(self, batch: RolloutBatch, iteration: int) -> dict[str, float]:
        """learner.prepare (pi_old, anchor top-k), learner.update (PPO epochs, AdamW), then the EMA anchor update on
        its period (if the update took a step); returns the update's stats and timings."""
        cfg = self.cfg
        batch = batch.to(next(self.policy.parameters()).device)
        start = time.perf_counter()
        prepared = self.learner.prepare(batch)
        timings = {"time_prepare_s": time.perf_counter() - start}
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(update_seed(cfg.seed, iteration))
        stats = self.learner.update(prepared, generator, iteration)
        timings["time_update_s"] = time.perf_counter() - start
        start = time.perf_counter()
        # The anchor averages the policies the updates made: an update whose every step the guard skipped made none.
        if should_update_ema(iteration, cfg.ema.period) and stats["optimizer_steps"]:
            self.anchor.update(self.policy, cfg.ema.tau)
        timings["time_ema_s"] = time.perf_counter() - start
        return merge_metrics(stats, {"anchor_distance": self.anchor.distance(self.policy)}, timings)

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's full weights on CPU (for the rollout engines), one independent copy per name: tied weights
        come back as separate tensors, which safetensors (vLLM's sync) requires. Sharded: a collective, as `state()`."""
        if not self.sharded:
            return {name: t.detach().to("cpu", copy=True)  # LoRA: merged, W0 + s B A under the base model's names
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
        if not self.sharded:
            return {"policy": policy_checkpoint_state(self.policy), "anchor": self.anchor.state_dict(),  # LoRA: adapters
                    "optimizer": portable_optimizer_state(self.optimizer.state_dict()),
                    "scheduler": self.scheduler.state_dict()}
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
                "optimizer": (portable_optimizer_state(optimizer_state_by_index(optimizer, self.parameter_names))
                              if optimizer else {}),
                "scheduler": self.scheduler.state_dict()}

    def load_state(self, state: dict) -> None:
        """From `state()`'s full tensors (every rank gets the same dict; sharded, each keeps its own shard)."""
        if not self.sharded:
            load_policy_checkpoint_state(self.policy, state["policy"])
            self.anchor.load_state_dict(state["anchor"])
            self.optimizer.load_state_dict(optimizer_state_for(self.optimizer, state["optimizer"]))
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
                                     optimizer_state_by_name(optimizer_state_for(self.optimizer, state["optimizer"]),
                                                             self.parameter_names), options=full)
        self.scheduler.load_state_dict(state["scheduler"])

    def init_from(self, path: Path) -> None:
        """Start RL from another run's checkpoint or run folder (e.g. SFT): its policy, and the anchor set to it."""
        weights = load_policy_weights(path)
        if uses_lora(self.policy):  # the frozen base becomes those weights; fresh adapters (B = 0) leave it as it is
            load_base_weights(self.policy, weights)
        elif self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            set_model_state_dict(self.policy, weights, options=StateDictOptions(full_state_dict=True))
        else:
            self.policy.load_state_dict(weights)
        self.anchor.reset_to(self.policy)


class LocalWorkers:
    """The workers in this process: a PolicyTrainer, and rollouts by `agent` on `backend` (the process's rollout
    engine, owned by whoever made it: a Session shares one between training and evaluation). Both come from
    agent.factory; the engine only syncs the policy's weights into the backend."""

    def __init__(self, cfg: TrainConfig, policy, backend: RolloutBackend, agent: RolloutAgent):
        self.learning = PolicyTrainer(cfg, policy)
        self.backend = backend
        self.agent = agent
        # vLLM holds its own copy of the weights: it gets the policy's before the first rollout (it loaded the base
        # model; the run may start from an SFT checkpoint or resume) and after every change.
        self.weights_stale = True

    def rollout(self, examples: list[QAExample], params: SamplingParams,
                samples: int) -> tuple[list[Trajectory], dict[str, float]]:
        trajectories = self.agent.rollout(examples, params, samples)
        return trajectories, {"rollout_retrieval_wait_s": self.agent.retrieval_wait_s}

    def learn(self, batch: RolloutBatch, iteration: int) -> dict[str, float]:
        self.weights_stale = True
        return self.learning.train_step(batch, iteration)

    def sync_weights(self) -> None:
        """In place into vLLM; the in-process transformers backend samples from the policy itself (nothing to copy)."""
        # A backend sampling from the policy object itself has nothing to copy; under LoRA the merged names (x.weight)
        # would not even exist in it (x.base_layer.weight), and merging every adapted matrix would be wasted work.
        if self.weights_stale and getattr(self.backend, "model", None) is not self.learning.policy:
            self.backend.load_weights(engine_weights(self.learning.policy))  # LoRA: merged weights
        self.weights_stale = False

    @contextmanager
    def anchor_as_policy(self) -> Iterator[torch.nn.Module]:
        """The policy holding the EMA anchor's weights for the duration (to evaluate the anchor on the policy's own
        evaluation path); afterwards the policy's own weights are back, and the rollout engine, which an evaluation
        may have loaded the anchor into, gets them again before the next rollout."""
        try:
            with anchor_weights_in(self.learning.policy, self.learning.anchor) as policy:
                yield policy
        finally:
            self.weights_stale = True

    def state(self) -> dict:
        return self.learning.state()

    def load_state(self, state: dict) -> None:
        self.learning.load_state(state)
        self.weights_stale = True

    def init_from(self, path: Path) -> None:
        self.learning.init_from(path)
        self.weights_stale = True

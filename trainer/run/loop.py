"""The EMA-PG training loop, driving its workers (trainer.run.workers: in process, or on Ray actors).

Per iteration:
    0. weight sync: an engine with its own copy of the weights (vLLM) gets the policy's, in place
    1. sample B prompts (a seeded permutation per epoch; the cursor is checkpointed)
    2. G rollouts each with the current policy (token-exact trajectories, retrieval over HTTP)
    3. rewards (`reward.name`, EM by default, + optional format bonus) -> advantages per group (group id =
       example id; `train.advantage`)
    4. learn: pi_old and anchor top-k, PPO epochs (AdamW), the EMA anchor update on every `ema.period`-th iteration
    5. the guard (trainer.run.guard): collapse signals and rules; a fired rule warns, or rolls back to the latest
       checkpoint at a lower learning rate (guard.rollback)
    6. log, under namespaced keys (docs/metrics.md), to JSONL + TensorBoard, and W&B when `logging.wandb.mode` is
       not disabled; checkpoint every `checkpoint.every` iterations (not one that was rolled back)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


from agent.backend import SamplingParams
from agent.diagnostics import repeated_search_rates
from agent.failures import failed_searches
from agent.seeds import rollout_seed
from agent.trajectory import Trajectory, save_jsonl
from data.qa import QAExample
from trainer.learner.batch import collate
from trainer.run.metrics_log import RunLogger, merge_metrics, namespaced
from trainer.run.sampler import PromptSampler
from trainer.run.checkpoint import (
    Checkpoint,
    check_compatible,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainer.config import TrainConfig
from trainer.advantages import zero_advantage_groups, zero_variance_share
from trainer.run.workers import Workers
from trainer.run.guard import Guard, GuardError, GuardEvent, scale_learning_rate
from trainer.reward import Score
from trainer.scoring import RewardFn, score_rollouts


def rollout_metrics(trajs: list[Trajectory], scores: list[Score]) -> dict[str, float]:
    n = len(trajs)
    total_turns = sum(len(t.turns) for t in trajs)
    mask_tokens = sum(len(t.loss_mask) for t in trajs)
    repeated_rate, with_repeats = repeated_search_rates(trajs)
    return {
        "rollout/reward": sum(s.reward for s in scores) / n,
        "rollout/em": sum(s.em for s in scores) / n,
        "rollout/format": sum(s.format for s in scores) / n,
        "rollout/response_tokens": sum(t.model_tokens for t in trajs) / n,
        "rollout/observation_tokens": sum(t.observation_tokens for t in trajs) / n,
        "rollout/searches": sum(t.num_searches for t in trajs) / n,
        "rollout/turns": total_turns / n,
        "rollout/invalid_action_rate": sum(t.num_invalid for t in trajs) / max(1, total_turns),
        "rollout/loss_mask_coverage": sum(t.model_tokens for t in trajs) / max(1, mask_tokens),
        "rollout/zero_variance_groups": zero_variance_share([s.reward for s in scores], [t.group_id for t in trajs]),
        "rollout/repeated_search_rate": repeated_rate,
        "rollout/trajectories_with_repeated_search": with_repeats,
        "rollout/failed_searches": failed_searches(trajs),  # a count, not a mean: each one is a retriever fault
    }


class Trainer:
    """A run: prompts, rollouts, rewards, advantages, learning, weight sync, logs and checkpoints, over its workers
    (trainer.run.workers.LocalWorkers in process, trainer.run.ray_workers.RayWorkers on Ray actors)."""

    def __init__(self, cfg: TrainConfig, workers: Workers, tokenizer, examples: list[QAExample], *,
                 reward_fn: RewardFn | None = None):
        self.cfg = cfg
        self.workers = workers
        self.tokenizer = tokenizer
        self.sampler = PromptSampler(examples, cfg.seed)
        self.reward_fn = reward_fn
        self.iteration = 0
        self.guard = Guard(cfg.guard, cfg.run_dir)

    def state(self) -> Checkpoint:
        return Checkpoint(iteration=self.iteration, **self.workers.state(), rng=rng_state(),
                          data_cursor=self.sampler.cursor(), config=self.cfg.model_dump(mode="json"),
                          guard=self.guard.state_dict())

    def restore(self, path: Path, lr_scale: float | None = None) -> None:
        """Everything a checkpoint holds; with `lr_scale`, the learning rate set to that multiple of the configured
        one (a rollback: the checkpoint's own scale is in its guard state)."""
        ckpt = load_checkpoint(path)
        check_compatible(ckpt.config, self.cfg.model_dump(mode="json"), keys=("model", "seed"))
        if lr_scale is not None:
            scale_learning_rate(ckpt.optimizer, ckpt.scheduler, lr_scale / ckpt.guard.get("lr_scale", 1.0))
        self.workers.load_state({"policy": ckpt.policy, "anchor": ckpt.anchor, "optimizer": ckpt.optimizer,
                                "scheduler": ckpt.scheduler})
        self.sampler.restore(ckpt.data_cursor)
        set_rng_state(ckpt.rng)
        self.iteration = ckpt.iteration
        self.guard.load_state_dict(ckpt.guard)

    def roll_back(self) -> None:
        """To the latest checkpoint (each passed the rules when saved), with the learning rate x guard.lr_decay; the
        count of rollbacks and the lowered rate outlive the restore."""
        rollbacks, lr_scale = self.guard.rollbacks + 1, self.guard.lr_scale * self.cfg.guard.lr_decay
        self.restore(latest_checkpoint(self.cfg.run_dir), lr_scale=lr_scale)
        self.guard.rollbacks, self.guard.lr_scale = rollbacks, lr_scale

    def after_collapse(self, iteration: int, fired: dict[str, str]) -> None:
        """A collapse rule fired at `iteration`: warn, roll back, or stop the run (GuardError)."""
        action = self.guard.action(have_checkpoint=latest_checkpoint(self.cfg.run_dir) is not None)
        if action == "rollback":
            self.roll_back()
            self.guard.record(GuardEvent(iteration, action, fired, self.iteration, self.guard.lr_scale))
            return
        self.guard.record(GuardEvent(iteration, action, fired))
        if action == "stop":
            raise GuardError(f"guard: at iteration {iteration}: {'; '.join(fired.values())}; no rollback left "
                             f"({self.guard.rollbacks} of guard.max_rollbacks={self.cfg.guard.max_rollbacks} used)")

    def step(self) -> dict[str, float]:
        """One iteration, in the order it runs: sync the rollout engine's weights, sample prompts, roll out, score
        (rewards, group advantages: trainer.scoring), learn (pi_old and the anchor's values, the PPO epochs, the EMA
        anchor's move: PolicyTrainer.train_step), keep the rollouts; returns the metrics the caller logs."""
        cfg, t = self.cfg, self.cfg.train
        self.iteration += 1
        start = time.perf_counter()
        self.workers.sync_weights()
        timings = {"time/weight_sync_s": time.perf_counter() - start}
        start = time.perf_counter()
        examples = self.sampler.next(t.prompts_per_iteration)
        params = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                max_tokens=cfg.rollout.max_tokens_per_turn, seed=rollout_seed(cfg.seed, self.iteration))
        trajs, rollout_stats = self.workers.rollout(examples, params, t.rollouts_per_prompt)
        timings["time/rollout_s"] = time.perf_counter() - start

        scored = score_rollouts(trajs, cfg, self.reward_fn)
        scores, advantages = scored.scores, scored.advantages
        stats = self.workers.learn(collate(trajs, advantages, self.tokenizer.pad_token_id or 0), self.iteration)
        stats["grad/zero_advantage_groups"] = zero_advantage_groups(advantages, [traj.group_id for traj in trajs])
        save_jsonl(trajs, cfg.run_dir / "trajectories" / f"iter-{self.iteration:06d}.jsonl")
        # The workers' stats come under flat names (trainer.run.metrics_log.FLAT_NAMES); rollout/retrieval_wait_s is
        # part of time/rollout_s (time/ are the iteration's phases).
        return merge_metrics(rollout_metrics(trajs, scores), namespaced(stats), timings, namespaced(rollout_stats))

    def run(self, progress: Callable[[int, dict], None] | None = None, until: int | None = None) -> list[dict[str, float]]:
        """Train to iteration `until` (default: the configured total), so a caller can pause to evaluate."""
        logger = RunLogger(self.cfg.run_dir, self.cfg, job_type="rl")
        history = []
        stop = min(until or self.cfg.train.iterations, self.cfg.train.iterations)
        if self.cfg.guard.rollback and latest_checkpoint(self.cfg.run_dir) is None:
            save_checkpoint(self.state(), self.cfg.run_dir, keep=self.cfg.checkpoint.keep)  # the start: a good state
        try:
            while self.iteration < stop:
                metrics = self.step()
                iteration = self.iteration
                fired = self.guard.observe(iteration, metrics)
                logger.log(iteration, metrics)
                history.append(metrics)
                if fired:
                    self.after_collapse(iteration, fired)
                rolled_back = self.iteration != iteration  # with guard.rollback, every checkpoint passed the rules
                if not rolled_back and (iteration % self.cfg.checkpoint.every == 0
                                        or iteration == self.cfg.train.iterations):
                    save_checkpoint(self.state(), self.cfg.run_dir, keep=self.cfg.checkpoint.keep)
                if progress:  # after the checkpoint: what it reports is already on disk
                    progress(iteration, metrics)
        finally:
            logger.close()
        return history


def resume_or_start(trainer: Trainer, resume: bool, init: Path | None) -> None:
    """Resume from the run's latest checkpoint, or start from `init`'s policy; both when given both: a LoRA run's
    checkpoints hold its adapters, and its frozen base is `init`'s again (otherwise the checkpoint overwrites it)."""
    if init is not None:
        trainer.workers.init_from(init)
    if resume:
        path = latest_checkpoint(trainer.cfg.run_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {trainer.cfg.run_dir / 'checkpoints'}")
        trainer.restore(path)


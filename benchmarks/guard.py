"""The training-health guard's overhead per iteration, guard on vs off in one run, on configs/cpu_compare.yaml's
model (SmolLM2-135M, packaged) and learner settings (micro-batches of 4, Top-k KL with k = 32, autocast auto).

Two measurements, as shares of one learner update (an iteration is rollout + prepare + update, so a share of the
update alone bounds the share of an iteration from above):
  in place: the same Learner's update of the same synthetic compare-shaped batch, alternately with the step guard on
      and off (best of --repeats each, after one untimed warm-up update). The guard adds a few float checks per
      micro-batch and optimizer step, so this difference is timing noise on a shared machine; hence also
  direct: the guard's own work timed alone: its per-step check inside those same updates (StepGuard.skip, wrapped in a
      timer) x the optimizer steps of a compare iteration, plus the per-iteration signals and rules (Guard.observe
      on a compare iteration's metrics, zero_variance_share over its 24 rewards), averaged over many calls.

    python benchmarks/guard.py [--trajectories 4] [--repeats 2] [--prompt-tokens 150] [--turn-tokens 64]
        [--obs-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from train_step import synthetic_batch

from agent.policy import load_policy
from trainer.config import load_config
from trainer.advantages import zero_variance_share
from trainer.run.workers import PolicyTrainer
from trainer.run.guard import Guard

COMPARE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cpu_compare.yaml"


def timed_step_guard(step_guard) -> list[float]:
    """Wrap the learner's StepGuard.skip with a timer; returns the list the seconds of each call go to."""
    seconds: list[float] = []
    skip = step_guard.skip

    def timed(*args):
        start = time.perf_counter()
        out = skip(*args)
        seconds.append(time.perf_counter() - start)
        return out

    step_guard.skip = timed
    return seconds


def observe_seconds(cfg, calls: int) -> float:
    """Mean seconds of one iteration's guard work in the loop: the zero-variance share over the iteration's rewards
    (rollout_metrics) and Guard.observe (trend signals and every rule)."""
    n = cfg.train.prompts_per_iteration * cfg.train.rollouts_per_prompt
    rewards = [float(i % 3 == 0) for i in range(n)]
    groups = [f"g{i // cfg.train.rollouts_per_prompt}" for i in range(n)]
    guard = Guard(cfg.guard, Path("unused"))  # healthy metrics: no event is written
    learned = {"rollout/reward": 0.2, "rollout/em": 0.1, "loss/entropy": 0.25, "kl/anchor": 0.001,
               "loss/clip_fraction": 0.002, "loss/policy": 0.01, "loss/grad_norm": 0.8, "kl/anchor_distance": 0.3,
               "rollout/response_tokens": 90.0, "guard/skipped_steps": 0}
    start = time.perf_counter()
    for iteration in range(1, calls + 1):  # each iteration's metrics a new dict, as the loop's are
        metrics = {**learned, "rollout/zero_variance_groups": zero_variance_share(rewards, groups)}
        guard.observe(iteration, metrics)
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trajectories", type=int, default=4, help="rows in the timed update (a compare iteration: 24)")
    ap.add_argument("--repeats", type=int, default=2, help="timed updates per variant, alternating")
    ap.add_argument("--prompt-tokens", type=int, default=150)
    ap.add_argument("--turns", type=int, default=2)  # rollout.max_turns of cpu_compare
    ap.add_argument("--turn-tokens", type=int, default=64)  # up to rollout.max_tokens_per_turn (128)
    ap.add_argument("--obs-tokens", type=int, default=256)  # rollout.max_obs_tokens
    args = ap.parse_args()

    compare = load_config(COMPARE_CONFIG).train
    compare_steps = compare.ppo_epochs * compare.prompts_per_iteration * compare.rollouts_per_prompt \
        // compare.mini_batch_size  # optimizer steps per compare iteration
    cfg = load_config(COMPARE_CONFIG, [f"train.mini_batch_size={args.trajectories}"])  # one step per timed update
    torch.manual_seed(0)
    policy = load_policy(cfg.model, cfg.dtype)
    learning = PolicyTrainer(cfg, policy)
    learner = learning.learner
    args.vocab = policy.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    batch = synthetic_batch(args, generator)
    learner.prepare(batch)
    step_guard = learner.step_guard
    check_seconds = timed_step_guard(step_guard)

    times: dict[str, list[float]] = {"on": [], "off": []}
    for run in range(1 + 2 * args.repeats):  # run 0 warms up, untimed; then off, on, off, on, ...
        variant = "on" if run % 2 == 0 else "off"
        learner.step_guard = step_guard if variant == "on" else None
        start = time.perf_counter()
        stats = learner.update(batch, torch.Generator().manual_seed(run), iteration=run)
        if run:
            times[variant].append(time.perf_counter() - start)
    on, off = min(times["on"]), min(times["off"])
    per_check = sum(check_seconds) / len(check_seconds)
    per_iteration = per_check * compare_steps + observe_seconds(cfg, 2000)
    print(json.dumps({
        "benchmark": "guard", "config": "configs/cpu_compare.yaml", "model": cfg.model, "autocast": cfg.autocast,
        "trajectories": args.trajectories, "tokens": int(batch.attention_mask.sum()),
        "model_tokens": int(batch.loss_mask.sum()), "optimizer_steps": stats["optimizer_steps"],
        "skipped_steps": stats["guard_skipped_steps"], "repeats": args.repeats,
        "update_s_off": round(off, 3), "update_s_on": round(on, 3),
        "update_on_over_off": round(on / off, 4),
        "step_check_us": round(per_check * 1e6, 2), "compare_steps_per_iteration": compare_steps,
        "guard_us_per_iteration": round(per_iteration * 1e6, 2),
        # The guard's own work per compare iteration over this (smaller) update: an upper bound of its share of an
        # iteration, which also rolls out, prepares, and updates 24 / trajectories times as many rows.
        "guard_share_of_update": float(f"{per_iteration / off:.3g}"),
    }))


if __name__ == "__main__":
    main()

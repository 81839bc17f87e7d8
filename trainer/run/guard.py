"""The training-health guard: a non-finite loss or gradient never reaches the weights, collapse signals are logged
every iteration, and (optionally) a collapse rolls the run back to its last good checkpoint at a lower learning rate.

    per optimizer step (trainer.learner.step_guard, `StepGuard`, in the learner): a micro-batch loss or the gradient norm that is not finite
        skips the whole step (gradients dropped, no AdamW step, no scheduler step); `max_consecutive_skips` skipped
        steps in a row stop the run. Under DDP/FSDP the ranks agree: the gradient norm is taken after the all-reduce
        (the same on every rank) and the first bad micro-batch is all-reduced too.
    per iteration (trainer.run.loop, `Guard`): signals beside the metrics, under `guard/` (the reward's trailing mean and
        its running peak, the entropy's trailing mean and its value at the run's first iteration; entropy, KL to the
        anchor, clip fraction, response length and the share of zero-variance groups are logged already) and the
        collapse rules, pure functions of them. A fired rule is an event in
        <run>/guard_events.jsonl: a warning, a rollback (the latest checkpoint, which passed the rules when it was
        saved, with the learning rate x guard.lr_decay) or, once guard.max_rollbacks are used, the end of the run.

Search-R1 issues #88/#89 are the failure this watches for: the reward falls to zero, the loss turns NaN, the
entropy blows up, and the run goes on checkpointing garbage.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.collapse import reward_fell
from trainer.learner.step_guard import GuardError
from trainer.run.metrics_log import merge_metrics
from trainer.config import GuardSection

log = logging.getLogger("emapg.guard")

EVENTS_FILE = "guard_events.jsonl"
# Metrics that must be finite every iteration (the learning ones exist when at least one optimizer step was taken).
FINITE_METRICS = ("rollout/reward", "loss/policy", "kl/anchor", "loss/entropy", "loss/grad_norm", "kl/anchor_distance")


# ---- pure functions: signals and rules -------------------------------------------------------------------------------

def reward_trend(recent: Sequence[float], peak: float | None) -> tuple[float, float]:
    """(smoothed, peak): the mean of the `recent` rewards (the trailing window) and the running peak of that mean."""
    smoothed = sum(recent) / len(recent)
    return smoothed, smoothed if peak is None else max(peak, smoothed)


def nonfinite_rule(metrics: dict[str, float], keys: Sequence[str] = FINITE_METRICS) -> str | None:
    bad = [k for k in keys if k in metrics and not math.isfinite(metrics[k])]
    return f"non-finite {', '.join(f'{k}={metrics[k]}' for k in bad)}" if bad else None


def reward_collapse_rule(smoothed: float, peak: float, iteration: int, cfg: GuardSection) -> str | None:
    if cfg.reward_drop is None or iteration <= cfg.warmup_iterations or peak < cfg.min_reward_peak:
        return None
    if reward_fell(smoothed, peak, cfg.reward_drop):
        return (f"reward (mean of the last {cfg.reward_window} iterations) {smoothed:.4g} < {cfg.reward_drop} x "
                f"its peak {peak:.4g}")
    return None


def entropy_rise_rule(smoothed: float, start: float, iteration: int, cfg: GuardSection) -> str | None:
    """The policy spreading out: the entropy's trailing mean above `entropy_rise` x its value at the run's first
    iteration. RL on a warm-started policy lowers its entropy; a multiple of the start is the drift the reward rule
    misses when the reward never rose (the lr 8e-5 pilot of configs/cpu_evidence.yaml: 0.21 -> ~1.2 nats, held-out EM
    0.22 -> 0.015, reward flat)."""
    if cfg.entropy_rise is None or iteration <= cfg.warmup_iterations or start <= 0:
        return None
    if smoothed > cfg.entropy_rise * start:
        return (f"entropy (mean of the last {cfg.reward_window} iterations) {smoothed:.4g} > {cfg.entropy_rise} x its "
                f"first iteration's {start:.4g}")
    return None


def bounds_rule(name: str, value: float | None, low: float | None = None, high: float | None = None) -> str | None:
    """`value` outside [low, high] (either bound None: open); a missing or non-finite value is the non-finite
    rule's business."""
    if value is None or not math.isfinite(value):
        return None
    if low is not None and value < low:
        return f"{name} {value:.4g} < {low}"
    if high is not None and value > high:
        return f"{name} {value:.4g} > {high}"
    return None


def collapse_rules(metrics: dict[str, float], iteration: int, cfg: GuardSection) -> dict[str, str]:
    """The rules that fire on one iteration's metrics (and the guard's reward_smoothed, reward_peak): rule -> why."""

    def bounds(key: str, low: float | None = None, high: float | None = None) -> str | None:
        return bounds_rule(key, metrics.get(key), low, high)

    fired = {
        "nonfinite": nonfinite_rule(metrics),
        "reward_collapse": reward_collapse_rule(metrics["guard/reward_smoothed"], metrics["guard/reward_peak"],
                                                iteration, cfg) if "guard/reward_smoothed" in metrics else None,
        "entropy": bounds("loss/entropy", cfg.entropy_min, cfg.entropy_max),
        "entropy_rise": entropy_rise_rule(metrics["guard/entropy_smoothed"], metrics["guard/entropy_start"],
                                          iteration, cfg) if "guard/entropy_smoothed" in metrics else None,
        "kl": bounds("kl/anchor", high=cfg.kl_max),
        "clip_fraction": bounds("loss/clip_fraction", high=cfg.clip_fraction_max),
        "zero_variance_groups": bounds("rollout/zero_variance_groups", high=cfg.zero_variance_max),
    }
    return {rule: why for rule, why in fired.items() if why is not None}


def scale_learning_rate(optimizer: dict[str, Any], scheduler: dict[str, Any], factor: float) -> None:
    """Multiply the learning rate of an optimizer's and its LambdaLR scheduler's state dicts by `factor`, in place:
    the base rate the schedule multiplies and the rate in force now (so the warm-up position is kept)."""
    for group in optimizer["param_groups"]:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    scheduler["base_lrs"] = [lr * factor for lr in scheduler["base_lrs"]]
    scheduler["_last_lr"] = [lr * factor for lr in scheduler["_last_lr"]]


# ---- orchestration ---------------------------------------------------------------------------------------------------

@dataclass
class GuardEvent:
    iteration: int
    action: str  # "skipped_steps" | "warn" | "rollback" | "stop"
    rules: dict[str, str]  # rule -> why
    restored_iteration: int | None = None
    lr_scale: float | None = None


class Guard:
    """A run's collapse watch: the reward and entropy windows, the reward's peak and the first entropy (part of every
    checkpoint, rolled back with it), the rollbacks made and the learning-rate scale they left (kept across
    rollbacks), and the events file."""

    def __init__(self, cfg: GuardSection, run_dir: Path):
        self.cfg = cfg
        self.events_path = Path(run_dir) / EVENTS_FILE
        self.recent_rewards: list[float] = []
        self.reward_peak: float | None = None
        self.recent_entropies: list[float] = []
        self.entropy_start: float | None = None
        self.rollbacks = 0
        self.lr_scale = 1.0

    def observe(self, iteration: int, metrics: dict[str, float]) -> dict[str, str]:
        """Add the guard's signals to `metrics` (in place, under `guard/`) and return the collapse rules that fire
        (name -> why). Skipped steps are recorded as an event of their own (the learner already kept them off the
        weights)."""
        if not self.cfg.enabled:
            return {}
        signals: dict[str, float] = {}
        reward = metrics["rollout/reward"]
        if math.isfinite(reward):
            self.recent_rewards = [*self.recent_rewards, reward][-self.cfg.reward_window :]
        if self.recent_rewards:
            signals["guard/reward_smoothed"], self.reward_peak = reward_trend(self.recent_rewards, self.reward_peak)
            signals["guard/reward_peak"] = self.reward_peak
        entropy = metrics.get("loss/entropy")  # absent when no optimizer step was taken
        if entropy is not None and math.isfinite(entropy):
            self.entropy_start = entropy if self.entropy_start is None else self.entropy_start
            self.recent_entropies = [*self.recent_entropies, entropy][-self.cfg.reward_window :]
            signals["guard/entropy_smoothed"] = sum(self.recent_entropies) / len(self.recent_entropies)
            signals["guard/entropy_start"] = self.entropy_start
        signals["guard/rollbacks"] = self.rollbacks
        metrics.update(merge_metrics(metrics, signals))  # the guard's keys are its own: a clash is an error
        if skipped := metrics.get("guard/skipped_steps"):
            self.record(GuardEvent(iteration, "skipped_steps", {
                "nonfinite_step": f"{skipped:.0f} optimizer step(s) skipped"}))
        return collapse_rules(metrics, iteration, self.cfg)

    def action(self, have_checkpoint: bool) -> str:
        """What a fired rule leads to: "warn" (rollback off), "rollback", or "stop" (none left, or nowhere to go)."""
        if not self.cfg.rollback:
            return "warn"
        return "rollback" if self.rollbacks < self.cfg.max_rollbacks and have_checkpoint else "stop"

    def record(self, event: GuardEvent) -> None:
        self.events_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.events_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(event)) + "\n")
        if event.action != "skipped_steps":
            log.warning("guard at iteration %d: %s -> %s", event.iteration, "; ".join(event.rules.values()),
                        event.action)

    def state_dict(self) -> dict[str, Any]:
        return {"recent_rewards": self.recent_rewards, "reward_peak": self.reward_peak,
                "recent_entropies": self.recent_entropies, "entropy_start": self.entropy_start,
                "rollbacks": self.rollbacks, "lr_scale": self.lr_scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's guard state (an empty one, from before the guard, is a fresh start; one from before the
        entropy signals starts them at the next iteration)."""
        self.recent_rewards = list(state.get("recent_rewards", []))
        self.reward_peak = state.get("reward_peak")
        self.recent_entropies = list(state.get("recent_entropies", []))
        self.entropy_start = state.get("entropy_start")
        self.rollbacks = state.get("rollbacks", 0)
        self.lr_scale = state.get("lr_scale", 1.0)


def read_events(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / EVENTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def events_markdown(run_dir: Path, title: str = "Guard") -> list[str]:
    """The run's guard events as report lines: a table, or one line saying there were none."""
    events = read_events(run_dir)
    if not events:
        return [f"{title}: no events (no step skipped, no collapse rule fired)."]
    lines = [f"{title} events:", "", "| iteration | action | rules | restored to | lr scale |", "|---|---|---|---|---|"]
    for e in events:
        rules = "; ".join(f"{rule}: {why}" for rule, why in e["rules"].items())
        restored = "" if e["restored_iteration"] is None else e["restored_iteration"]
        scale = "" if e["lr_scale"] is None else f"{e['lr_scale']:.4g}"
        lines.append(f"| {e['iteration']} | {e['action']} | {rules} | {restored} | {scale} |")
    return lines

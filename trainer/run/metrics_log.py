"""A run's per-iteration log (JSONL + TensorBoard, and W&B when configured), whose keys are namespaced (`rollout/`,
`loss/`, `kl/`, `grad/`, `time/`, `guard/`; docs/metrics.md). Used by the RL and the SFT trainers alike.
Seeding and the learning-rate schedule are transformers' (`set_seed`, `get_constant_schedule_with_warmup`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig

NAMESPACES = ("rollout", "loss", "kl", "grad", "time", "guard")

# The flat names -> the logged ones. Flat are what trainer.learner.learner and trainer.run.workers return (trainer.run.loop places
# them; a name they return as "<namespace>/<name>" is kept) and what runs logged before the namespaces (the records
# in docs/evidence/*_logs.tar.gz, and any run resumed from one): `read_metrics` reads those under the new names.
FLAT_NAMES = {
    # rollouts (trainer.run.loop, trainer.run.workers)
    "reward": "rollout/reward",
    "em": "rollout/em",
    "format": "rollout/format",
    "response_tokens": "rollout/response_tokens",
    "observation_tokens": "rollout/observation_tokens",
    "searches": "rollout/searches",
    "turns": "rollout/turns",
    "invalid_action_rate": "rollout/invalid_action_rate",
    "loss_mask_coverage": "rollout/loss_mask_coverage",
    "zero_variance_groups": "rollout/zero_variance_groups",
    "rollout_retrieval_wait_s": "rollout/retrieval_wait_s",
    # the update (trainer.learner.learner; trainer.run.sft)
    "loss": "loss/total",
    "policy_loss": "loss/policy",
    "clip_fraction": "loss/clip_fraction",
    "approx_kl_old": "loss/approx_kl_old",
    "ratio_mean": "loss/ratio_mean",
    "entropy": "loss/entropy",
    "grad_norm": "loss/grad_norm",
    "lr": "loss/lr",
    "optimizer_steps": "loss/optimizer_steps",
    "sampler_trainer_logprob_gap_mean": "loss/sampler_trainer_logprob_gap_mean",
    "sampler_trainer_logprob_gap_max": "loss/sampler_trainer_logprob_gap_max",
    "sft_loss": "loss/sft",
    "model_tokens": "loss/model_tokens",
    # the anchor (trainer.learner.learner, trainer.run.workers)
    "kl": "kl/anchor",
    "anchor_distance": "kl/anchor_distance",
    # phases (trainer.run.loop, trainer.run.workers; trainer.run.sft)
    "time_weight_sync_s": "time/weight_sync_s",
    "time_rollout_s": "time/rollout_s",
    "time_prepare_s": "time/prepare_s",
    "time_update_s": "time/update_s",
    "time_ema_s": "time/ema_s",
    "time_step_s": "time/step_s",
    # the guard (trainer.run.guard, trainer.learner.learner)
    "reward_smoothed": "guard/reward_smoothed",
    "reward_peak": "guard/reward_peak",
    "entropy_smoothed": "guard/entropy_smoothed",
    "entropy_start": "guard/entropy_start",
    "guard_rollbacks": "guard/rollbacks",
    "guard_skipped_steps": "guard/skipped_steps",
}


def merge_metrics(*parts: dict[str, Any]) -> dict[str, Any]:
    """One dict from several, in order; a key in two of them is an error (a plain merge would keep the last one's
    value without a word)."""
    merged: dict[str, Any] = {}
    for part in parts:
        if clash := merged.keys() & part.keys():
            raise ValueError(f"metrics {sorted(clash)} come from two sources: one would overwrite the other")
        merged.update(part)
    return merged


def logged_name(key: str) -> str:
    """A flat name's namespaced one (FLAT_NAMES); a "<namespace>/<name>" one as it is."""
    name = FLAT_NAMES.get(key, key)
    namespace, slash, _ = name.partition("/")
    if not slash or namespace not in NAMESPACES:
        raise KeyError(f"metric {key!r} has no namespace: name it '<namespace>/{key}' with a namespace of "
                       f"{NAMESPACES} (and document it in docs/metrics.md)")
    return name


def namespaced(stats: dict[str, Any]) -> dict[str, Any]:
    """`stats` under their logged names; two keys for one name (a flat one and its namespaced one) are an error."""
    return merge_metrics(*({logged_name(key): value} for key, value in stats.items()))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl, one dict per line (none for a missing file), every row under the namespaced names:
    a flat name from before the namespaces is read as its FLAT_NAMES name."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{FLAT_NAMES.get(key, key): value for key, value in row.items()} for row in rows]


def current_history(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A run's rows as its history now, one per iteration, in order. A run resumed from a checkpoint, or rolled back
    to one by the guard, logs the iterations after that checkpoint again, so a row for an iteration at or before the
    last one read starts the history over from it (rows of an abandoned attempt past the resumed run's latest
    iteration go too, which keeping each iteration's last row would not do). metrics.jsonl itself keeps every row:
    the work of abandoned attempts is counted from them."""
    history: list[dict[str, Any]] = []
    for row in rows:
        while history and history[-1]["iteration"] >= row["iteration"]:
            history.pop()
        history.append(row)
    return history


class RunLogger:
    """Per-iteration metrics to `metrics.jsonl`, TensorBoard (`tb/`) and, given a `cfg` whose logging.wandb.mode is
    not disabled, Weights & Biases (`wandb/`, with the run's config; trainer/run/wandb_logger.py)."""

    def __init__(self, run_dir: Path, cfg: TrainConfig | None = None, job_type: str = "train"):
        from torch.utils.tensorboard import SummaryWriter

        from trainer.run.wandb_logger import run_name, start_run

        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self.tb = SummaryWriter(str(run_dir / "tb"))
        self.wandb = None if cfg is None else start_run(run_dir, cfg.logging.wandb, run_name(cfg, run_dir),
                                                        cfg.model_dump(mode="json"), job_type)

    def log(self, iteration: int, metrics: dict[str, float]) -> None:
        self.jsonl.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        self.jsonl.flush()
        for key, value in metrics.items():
            self.tb.add_scalar(key, value, iteration)
        self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({"iteration": iteration, **metrics})

    def close(self) -> None:
        self.jsonl.close()
        self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()

"""What a run keeps besides the model: the order its prompts come in (a seeded permutation per epoch, with a cursor
that checkpoints save) and its per-iteration log (JSONL + TensorBoard). Used by the RL and the SFT trainers alike.
Seeding and the learning-rate schedule are transformers' (`set_seed`, `get_constant_schedule_with_warmup`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.qa import QAExample
from trainer.config import TrainConfig


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
    """Per-iteration metrics to `metrics.jsonl`, TensorBoard (`tb/`) and, given a `cfg` whose logging.wandb.mode is
    not disabled, Weights & Biases (`wandb/`, with the run's config; trainer/wandb_logger.py)."""

    def __init__(self, run_dir: Path, cfg: TrainConfig | None = None, job_type: str = "train"):
        from torch.utils.tensorboard import SummaryWriter

        from trainer.wandb_logger import run_name, start_run

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

"""The order a run's prompts come in: epochs over a fixed example list, each a seeded permutation, with a cursor
(epoch, position) that checkpoints save, so a resumed run draws exactly the prompts it would have."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.qa import QAExample


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

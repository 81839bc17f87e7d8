"""The learner's per-optimizer-step guard: a micro-batch loss or a gradient norm that is not finite skips the whole
step (gradients dropped, no AdamW step, no scheduler step); `max_consecutive_skips` skipped steps in a row stop the
run. The per-iteration collapse watch that acts on a run is trainer.run.guard, which imports this (never the other
way: the learner does not depend on the run).
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger("emapg.guard")


class GuardError(RuntimeError):
    """The guard stopped the run: too many non-finite steps in a row, or a collapse with no rollback left."""


class StepGuard:
    """The learner's per-optimizer-step check, with the count of skipped steps in a row (across iterations)."""

    def __init__(self, max_consecutive_skips: int):
        self.max_consecutive_skips = max_consecutive_skips
        self.in_a_row = 0

    def skip(self, bad_micro_batch: int | None, grad_norm: float, where: str) -> bool:
        """True when the step must be skipped: micro-batch `bad_micro_batch` (its index in the mini-batch) had a
        non-finite loss, or the gradient norm is not finite. Raises GuardError at the limit of skips in a row."""
        if bad_micro_batch is None and math.isfinite(grad_norm):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        what = (f"micro-batch {bad_micro_batch} had a non-finite loss" if bad_micro_batch is not None
                else f"the gradient norm is {grad_norm} (every micro-batch's loss was finite)")
        if self.in_a_row >= self.max_consecutive_skips:
            raise GuardError(f"guard: {self.in_a_row} optimizer steps in a row skipped (guard.max_consecutive_skips="
                             f"{self.max_consecutive_skips}); the last at {where}: {what}")
        log.warning("guard: skipped the optimizer step at %s: %s", where, what)
        return True

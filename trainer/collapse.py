"""What "collapse" means, in one place: the training reward's trailing mean has fallen below a share of its peak.

Two shares, for two uses, one test (`reward_fell`):

- STUDY_SHARE = 0.5, the studies' outcome (experiments/mechanism/cell.py; Studies A-C and the two-hop study): judged
  once, after training, on the whole curve (the smoothed final against the smoothed peak). Fixed by those plans before
  their runs, so it stays 0.5 whatever the guard's default becomes.
- guard.reward_drop (default 0.2), the guard's alarm during training (trainer/run/guard.py): it acts (a warning, a
  rollback, the end of the run), so it waits for a deeper fall, and only after guard.warmup_iterations and once the
  peak reached guard.min_reward_peak: a noisy dip of a run that is still learning must not stop it.

Both smooth the reward with a trailing mean (the studies over 5 iterations, the guard over guard.reward_window).
"""

from __future__ import annotations

STUDY_SHARE = 0.5


def reward_fell(smoothed: float, peak: float, share: float) -> bool:
    """True when the smoothed reward is below `share` x its running peak."""
    return smoothed < share * peak

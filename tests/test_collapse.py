"""trainer/collapse.py: the one test of collapse, at its boundary, and the two shares that use it."""

from __future__ import annotations

from experiments.mechanism.cell import curve_summary
from trainer.collapse import STUDY_SHARE, reward_fell
from trainer.config import GuardSection
from trainer.run.guard import reward_collapse_rule


def test_a_reward_below_the_share_of_its_peak_fell_and_one_at_it_did_not():
    assert reward_fell(0.39, 0.8, 0.5) and not reward_fell(0.4, 0.8, 0.5)


def test_the_studies_and_the_guard_use_it_with_their_own_shares():
    assert STUDY_SHARE == 0.5  # fixed by the study plans before their runs
    # smoothed over 5 iterations: peak 0.8, final (0.3 + 0.3 + 0.4 + 0.4 + 0.4) / 5 = 0.36 < 0.4
    summary = curve_summary([0.8] * 5 + [0.3, 0.3, 0.4, 0.4, 0.4], finite=True)
    assert summary["collapsed"] and abs(summary["peak_train_reward"] - 0.8) < 1e-12
    guard = GuardSection()  # reward_drop 0.2: the same fall does not fire the guard's alarm
    assert reward_collapse_rule(0.36, 0.8, iteration=20, cfg=guard) is None
    assert reward_collapse_rule(0.15, 0.8, iteration=20, cfg=guard) is not None

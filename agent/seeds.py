"""Every random stream a run draws from is seeded from its one `seed` by the pure functions here, named for what they
seed, so that the arithmetic is written once and can be read in one place.

    rollout_seed(seed, iteration)  the sampling seed of an iteration's rollout (SamplingParams.seed)
    turn_seed(seed, turn)          that rollout's seed for turn `turn` (a trajectory's samples differ across turns)
    row_seed(seed, row)            one trajectory's seed within a turn (engines that seed each request: vLLM)
    worker_seed(seed, worker)      a rollout worker's rollout seed (Ray workers split one rollout)
    update_seed(seed, iteration)   the learner's generator for an iteration's update (mini-batch order)

They compose in that order: row_seed(turn_seed(worker_seed(rollout_seed(seed, i), w), t), row). The values are
those the code derived before it was gathered here (tests/test_seeds.py pins them): a new formula would change
every run's draws, and a resumed run would no longer replay the one it continues. Known overlaps of these
formulas, kept for that reason: turn t of iteration i has the seed of turn 0 of iteration i + t (their prompts
differ: each iteration samples new ones), and worker w of a run with seed s draws what worker 0 of a run with
seed s + 7w draws.

It lives in agent/ because that is the lowest layer its users share: agent/ (turn and row seeds) and trainer/
(iteration, worker and update seeds), and trainer imports agent, never the reverse.
"""

from __future__ import annotations

STRIDE = 1_000_003  # prime, above any iteration count or rollout size: (seed, i) -> seed * STRIDE + i is one-to-one
WORKER_STRIDE = 7 * STRIDE  # a rollout worker's offset: workers of one run never share a stream
UPDATE_STRIDE = 7919  # prime; it seeds the learner's own torch.Generator, not a sampler


def rollout_seed(seed: int, iteration: int) -> int:
    return seed * STRIDE + iteration


def turn_seed(seed: int | None, turn: int) -> int | None:
    """None (unseeded sampling) stays None."""
    return None if seed is None else seed + turn


def row_seed(seed: int | None, row: int) -> int | None:
    """One seed per row (a trajectory's index in its rollout): one seed for all rows would give a group's samples
    identical draws, and a row's seed does not depend on which other rows share its batch. None stays None."""
    return None if seed is None else seed * STRIDE + row


def worker_seed(seed: int | None, worker: int) -> int | None:
    """None stays None."""
    return None if seed is None else seed + worker * WORKER_STRIDE


def update_seed(seed: int, iteration: int) -> int:
    return seed * UPDATE_STRIDE + iteration

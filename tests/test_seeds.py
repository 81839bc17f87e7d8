"""agent.seeds: every derived seed keeps the value the code derived before the formulas moved there (pinned), so runs
keep their draws and resumed runs replay; a row's seed never collides within a rollout."""

from __future__ import annotations

from agent.backend import SamplingParams
from agent.seeds import rollout_seed, row_seed, turn_seed, update_seed, worker_seed


def test_derived_seeds_are_the_pinned_values():
    # Run seed 3, iteration 17: loop.py derived 3 * 1_000_003 + 17; a turn added its index; vLLM's row seed was
    # seed * 1_000_003 + row; a Ray worker added worker * 7 * 1_000_003; the update's generator was 3 * 7919 + 17.
    assert rollout_seed(3, 17) == 3_000_026
    assert turn_seed(3_000_026, 2) == 3_000_028
    assert row_seed(3_000_028, 5) == 3_000_037_000_089
    assert worker_seed(3_000_026, 2) == 17_000_068
    assert update_seed(3, 17) == 23_774
    assert rollout_seed(0, 1) == 1 and update_seed(0, 1) == 1


def test_unseeded_sampling_stays_unseeded():
    assert turn_seed(None, 3) is None and row_seed(None, 3) is None and worker_seed(None, 3) is None


def test_rows_of_a_rollout_never_share_a_seed():
    seeds = [row_seed(turn_seed(rollout_seed(0, 5), turn), row) for turn in range(5) for row in range(512)]
    assert len(set(seeds)) == len(seeds)


def test_rollout_workers_use_the_worker_seed():
    from trainer.run.ray_workers import worker_params

    params = SamplingParams(temperature=1.0, seed=rollout_seed(3, 17))
    assert worker_params(params, 2).seed == 17_000_068 and worker_params(params, 0) == params
    assert worker_params(SamplingParams(seed=None), 1).seed is None

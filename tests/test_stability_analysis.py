"""Study A's analysis (experiments/mechanism/stability.py) on fabricated result.json files (fakes: no run made them),
checked against values worked out by hand: the primary's sign-flip p, the family's size and Holm, the collapse test,
the grad/ medians with NaN skipped, the refusal of a seed in two blocks, and the plot it writes."""

from __future__ import annotations

import json
import math

import pytest

from experiments.mechanism.stability import analyse, effect_cell, family


def fake_result(block, arm: str, lr: float, seed: int, em: float, collapsed: bool = False, ratios=(0.5, math.nan)):
    folder = block / "cells" / f"{arm}_lr{lr:g}_beta0.1_seed{seed}"
    folder.mkdir(parents=True)
    result = {"method": arm, "lr": lr, "beta": 0.001 if arm == "GRPO-floor" else 0.1, "seed": seed,
              "final": {"em": em}, "collapsed": collapsed, "train_seconds": 60.0, "measure_seconds": 30.0,
              "grad": {"grad/kl_pg_ratio": list(ratios), "grad/kl_pg_cosine": [-0.5, math.nan],
                       "grad/pg_norm": [1.0, 0.0]}}
    (folder / "result.json").write_text(json.dumps(result))


def test_the_declared_family_has_14_comparisons_and_the_primary_is_not_in_it():
    rows = family()
    assert len(rows) == 14 and len(set(rows)) == 14
    assert ("em", "EMA-PG", "GRPO-k3c", 3e-3) not in rows


def test_primary_secondary_and_collapse_tests_on_two_blocks(tmp_path):
    blocks = [tmp_path / "block-1", tmp_path / "block-2"]
    # 6 seeds, 3 per block: EMA-PG ahead by 0.5 in 5 seeds and behind by 0.1 in one, at lr 3e-3.
    for i, seed in enumerate(range(100, 106)):
        block = blocks[i // 3]
        grpo_em = 0.9 if seed == 105 else 0.2
        fake_result(block, "GRPO-k3c", 3e-3, seed, grpo_em, collapsed=seed != 105)
        fake_result(block, "EMA-PG", 3e-3, seed, 0.8 if seed == 105 else 0.7)
    summary = analyse(blocks, tmp_path / "report")
    primary = summary["primary"]
    assert primary["n"] == 6 and (primary["wins"], primary["losses"]) == (5, 1)
    assert primary["mean"] == pytest.approx((5 * 0.5 - 0.1) / 6)
    # |sum| = 2.4; as extreme: the five 0.5 all + with the last -0.1 (2.4) or +0.1 (2.6), and their mirrors: 4 of 64.
    assert primary["p"] == pytest.approx(4 / 64)
    assert primary["per_block"] == pytest.approx({"block-1": 0.5, "block-2": (0.5 + 0.5 - 0.1) / 3})
    collapse = next(c for c in summary["secondary"] if c["outcome"] == "collapse" and c["lr"] == 3e-3)
    assert (collapse["wins"], collapse["ties"]) == (5, 1) and collapse["p"] == pytest.approx(2 / 32)  # exact McNemar
    assert len(summary["secondary"]) == 1  # only that rate and pair has both arms: the rest are not yet computable
    assert collapse["holm_p"] == collapse["p"]
    assert effect_cell(collapse).startswith("collapse rate +0.833 [")
    assert effect_cell(collapse).endswith("(only GRPO-k3c collapsed in 5 seeds, only EMA-PG in 0, of 6)")
    cell = next(c for c in summary["cells"] if c["arm"] == "EMA-PG")
    assert cell["kl_pg_ratio"] == 0.5 and cell["kl_pg_cosine"] == -0.5 and cell["zero_pg_share"] == 0.5  # NaN skipped
    assert cell["hours"] == pytest.approx(6 * 90 / 3600)
    assert (tmp_path / "report" / "frontier.png").stat().st_size > 10_000
    md = (tmp_path / "report" / "stability.md").read_text()
    assert "exact sign-flip p = 0.0625" in md and "| EMA-PG | 0.1 | 0.003 | 6 | 0.717 | 0/6 |" in md


def test_a_seed_in_two_blocks_is_refused(tmp_path):
    fake_result(tmp_path / "a", "EMA-PG", 1e-3, 100, 0.5)
    fake_result(tmp_path / "b", "EMA-PG", 1e-3, 100, 0.5)
    with pytest.raises(ValueError, match="seed 100 .* is in two blocks"):
        analyse([tmp_path / "a", tmp_path / "b"], tmp_path / "report")


def test_the_start_rule_refuses_a_start_that_did_not_learn_or_already_solves_two_hop():
    from experiments.mechanism.run import usable_start

    assert usable_start({"em": 0.0, "em_birth_country": 0.0}, 0.4) == "held-out EM 0.000 < 0.4"  # init_seed 99's
    assert usable_start({"em": 0.5, "em_birth_country": 0.1}, 0.4) == "two-hop EM 0.100 > 0"
    assert usable_start({"em": 0.5, "em_birth_country": 0.0}, 0.4) is None
    assert usable_start({"em": 0.0}, None) is None  # no rule: the mechanism study's runs

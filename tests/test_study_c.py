"""Study C (docs/study_c_plan.md): its grid and arms' configs, the pull ratio of its manipulation check, and its
analysis on fabricated result.json files (fakes: no run made them), checked against values worked out by hand."""

from __future__ import annotations

import json
import math

import pytest

from experiments.mechanism.stability import load_cells, pull_ratio
from experiments.mechanism.study_c import FAMILY, PRIMARIES, analyse, extra_rate_due, readme_effect, recompute_em
from experiments.mechanism.sweep import grid, study_config, train_overrides
from trainer.config import load_config


def test_each_seed_runs_part_1_then_part_2_and_each_arm_gets_its_one_change():
    study = study_config("study-c", 4, seeds=[300, 301])
    cells = grid(study.sweep)
    assert len(cells) == 20 and [c.seed for c in cells] == [300] * 10 + [301] * 10
    configs = {(c.method, c.lr): load_config(overrides=train_overrides(study, c)) for c in cells[:10]}
    pg, k3c = configs[("EMA-PG", 3e-3)], configs[("EMA-k3c", 3e-3)]
    assert (pg.kl.estimator, pg.kl.topk, pg.kl.beta, pg.ema.tau) == ("topk", 32, 0.1, 0.9)
    assert (k3c.kl.estimator, k3c.kl.importance_weight, k3c.kl.beta) == ("k3_clamped", False, 0.1)
    assert configs[("EMA-PG-weak", 3e-3)].kl.beta == 0.036 and configs[("EMA-k3c-strong", 3e-3)].kl.beta == 0.28
    assert configs[("EMA-PG-tail", 3e-3)].kl.topk == 0  # the method's key wins over the study's kl.topk
    for (method, lr), cfg in configs.items():
        warm = method.endswith("-warmup")
        assert (cfg.train.warmup_fraction, cfg.train.warmup_steps, cfg.train.lr) == (0.285 if warm else None, 0, lr)
        assert cfg.ema.tau == (1.0 if method.startswith("GRPO") else 0.9)
    assert {(c.method, c.lr) for c in grid(study_config("study-c-extra", 4, seeds=[300]).sweep)} == {
        ("GRPO-k3c-warmup", 1e-2), ("EMA-PG-warmup", 1e-2)}


def fake_cell(block, arm, lr, seed, em, *, kl_norm=(0.0, 1.0, 1.0, 1.0), collapsed=False, answers=None):
    beta = {"EMA-PG-weak": 0.036, "EMA-k3c-strong": 0.28}.get(arm, 0.1)
    folder = block / "cells" / f"{arm}_lr{lr:g}_beta{beta:g}_seed{seed}"
    folder.mkdir(parents=True)
    answers = answers if answers is not None else [{"id": "q0", "answer": "1234" if em else None, "em": em}]
    final = {"em": em, "answered": sum(a["answer"] is not None for a in answers) / len(answers), "predictions": answers}
    result = {"cell": folder.name, "method": arm, "lr": lr, "beta": beta, "seed": seed, "final": final,
              "collapsed": collapsed, "train_seconds": 1.0, "measure_seconds": 1.0,
              "grad": {"grad/kl_norm": list(kl_norm), "grad/kl_pg_ratio": [math.nan], "grad/kl_pg_cosine": [math.nan],
                       "grad/pg_norm": [1.0]}}
    (folder / "result.json").write_text(json.dumps(result))


def write_questions(block):
    (block / "kb").mkdir(parents=True, exist_ok=True)
    row = {"example": {"id": "q0", "dataset": "kb-birthplace", "split": "test", "question": "where?",
                       "golden_answers": ["1234"], "source": "synthetic-kb"}, "kind": "birthplace",
           "queries": ["x"], "bridge": None}
    (block / "kb" / "questions-test.jsonl").write_text(json.dumps(row) + "\n")


def test_pull_ratio_is_the_median_over_seeds_of_each_seeds_median_over_iterations_2_to_4(tmp_path):
    block = tmp_path / "block-4"
    # seed 1: ratios 2, 4, 3 -> 3; seed 2: iteration 3 missing (None) and 4 zero in B -> only iteration 2: 0.5
    fake_cell(block, "EMA-PG", 3e-3, 1, 1.0, kl_norm=(0.0, 2.0, 4.0, 6.0, 99.0))
    fake_cell(block, "EMA-k3c", 3e-3, 1, 1.0, kl_norm=(0.0, 1.0, 1.0, 2.0, 1.0))
    fake_cell(block, "EMA-PG", 3e-3, 2, 1.0, kl_norm=(5.0, 1.0, None, 1.0))
    fake_cell(block, "EMA-k3c", 3e-3, 2, 1.0, kl_norm=(1.0, 2.0, 1.0, 0.0))
    r = pull_ratio(load_cells([block]), "EMA-PG", "EMA-k3c", 3e-3)
    assert r["per_seed"] == {1: 3.0, 2: 0.5} and (r["median"], r["low"], r["high"], r["n"]) == (1.75, 0.5, 3.0, 2)
    assert pull_ratio(load_cells([block]), "EMA-PG", "GRPO-k3c", 3e-3) is None


def test_primaries_family_check_and_the_conditional_rate(tmp_path):
    blocks = [tmp_path / "block-4", tmp_path / "block-2"]
    for b in blocks:
        write_questions(b)
    for i, seed in enumerate(range(300, 306)):
        block = blocks[i % 2]
        fake_cell(block, "EMA-PG", 3e-3, seed, 1.0, kl_norm=(0, 3.0, 3.0, 3.0))
        fake_cell(block, "EMA-k3c-strong", 3e-3, seed, 0.0, kl_norm=(0, 3.3, 3.3, 3.3))  # 1.1x: within the band
        fake_cell(block, "EMA-k3c", 3e-3, seed, 0.0, kl_norm=(0, 1.0, 1.0, 1.0))
        fake_cell(block, "EMA-PG-weak", 3e-3, seed, 0.0, kl_norm=(0, 2.0, 2.0, 2.0))  # 2x: outside it
        fake_cell(block, "GRPO-k3c-warmup", 3e-3, seed, 0.0, collapsed=True)
        fake_cell(block, "EMA-PG-warmup", 3e-3, seed, 1.0)
    summary = analyse(blocks, tmp_path / "report")
    p1, p2 = summary["primaries"]
    assert (p1["a"], p1["b"], p1["n"], p1["wins"], p1["mean"]) == ("EMA-PG", "EMA-k3c-strong", 6, 6, 1.0)
    assert p1["p"] == pytest.approx(2 / 64) and p1["holm_p"] == pytest.approx(2 * 2 / 64)  # Holm over the two
    assert (p2["a"], p2["b"]) == ("EMA-PG-warmup", "GRPO-k3c-warmup")
    checks = {r["a"]: r for r in summary["checks"]}
    assert checks["EMA-k3c-strong"]["median"] == pytest.approx(1.1) and checks["EMA-k3c-strong"]["passed"]
    assert checks["EMA-PG-weak"]["median"] == pytest.approx(2.0) and not checks["EMA-PG-weak"]["passed"]
    assert summary["answered"][0]["mean"] == 1.0  # EMA-PG answered every question, EMA-k3c-strong none
    assert len(FAMILY) == 11 == summary["family_size"] and not set(PRIMARIES) & set(FAMILY)
    assert summary["extra_rate_due"] is None and summary["em_recomputed_from_answers"] == 36
    assert readme_effect(summary, 0) == "running (36 of 160 runs)"
    assert (tmp_path / "report" / "study_c.png").stat().st_size > 10_000
    assert "| EMA-k3c-strong / EMA-PG | 6 | 1.10 | 1.10-1.10 | yes |" in (tmp_path / "report" / "study_c.md").read_text()


def test_the_conditional_rate_is_due_only_when_both_warmup_arms_held_at_5e_3():
    def cells(grpo, ema, n=16):
        return {"cells": [{"arm": "GRPO-k3c-warmup", "lr": 5e-3, "warmup": True, "n": n, "collapsed": grpo},
                          {"arm": "EMA-PG-warmup", "lr": 5e-3, "warmup": True, "n": n, "collapsed": ema}]}
    assert extra_rate_due(cells(4, 0)) is True
    assert extra_rate_due(cells(5, 0)) is False
    assert extra_rate_due(cells(0, 0, n=15)) is None  # not every seed finished yet


def test_a_recorded_em_that_its_answers_do_not_give_is_refused(tmp_path):
    block = tmp_path / "block-4"
    write_questions(block)
    fake_cell(block, "EMA-PG", 3e-3, 300, 1.0, answers=[{"id": "q0", "answer": "9999", "em": 1.0}])
    with pytest.raises(ValueError, match="EM 1.0 recorded, 0.0 from its answers"):
        recompute_em(block, load_cells([block]))

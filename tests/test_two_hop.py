"""The two-hop study's inputs (experiments/two_hop/prepare.py): its FlashRAG-format sets load through the loader every
run uses, the primary set holds the two-hop questions only, and the config reads them where prepare writes them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data.qa import load_flashrag
from experiments.mechanism.kb import KBSpec, generate_kb
from experiments.two_hop.prepare import CONFIG, TWO_HOP, write_sets
from trainer.config import load_config


def test_the_sets_split_two_hop_from_one_hop_and_load_as_flashrag_sets(tmp_path):
    kb = generate_kb(KBSpec(train_people=30, test_people=10, train_cities=6, test_cities=3, countries=3))
    rng = np.random.default_rng(0)
    train, test = kb.questions("train", 40, rng), kb.questions("test", 20, rng)
    reworded = kb.questions("test", 12, rng, reworded=True)
    counts = write_sets(tmp_path, train, test, reworded)
    two_hop = [q for q in test if q.kind == TWO_HOP]
    assert counts == {"kb/train": 40, "kb-2hop/test": len(two_hop), "kb-1hop/test": 20 - len(two_hop),
                      "kb-reworded/test": 12}
    assert [e.question for e in load_flashrag("kb-reworded", "test", root=tmp_path)] == [q.example.question
                                                                                       for q in reworded]
    loaded = load_flashrag("kb-2hop", "test", root=tmp_path)
    assert [(e.question, e.golden_answers) for e in loaded] == [(q.example.question, q.example.golden_answers)
                                                                for q in two_hop]
    assert all(e.question.startswith("In which country was person") for e in loaded)
    assert len({e.id for e in load_flashrag("kb", "train", root=tmp_path)}) == 40  # ids unique: GRPO groups


def test_the_config_reads_the_sets_and_index_where_prepare_writes_them():
    cfg = load_config(CONFIG)
    assert cfg.data.train == ["kb:train"] and cfg.data.eval == ["kb-2hop:test"] and cfg.data.subset == "full"
    assert cfg.data.flashrag_root == cfg.out_dir / "flashrag" and cfg.retriever.index == cfg.out_dir / "index"
    assert cfg.retriever.topk == 1  # the answer ends its one document (kb.py)


def test_beta_rule_takes_the_smallest_candidate_in_the_band_else_the_closest_to_0_2_in_log():
    from experiments.two_hop.calibrate import choose_beta

    assert choose_beta({0.01: 0.02, 0.03: 0.12, 0.1: 0.25, 0.3: 0.9})[0] == 0.03
    assert choose_beta({0.01: 0.30, 0.03: 0.10})[0] == 0.01  # the band's ends are inside it
    # None inside: 0.05 is 1.39 from 0.2 in log, 0.9 is 1.50, so 0.03 (share 0.05) wins over 0.3 (share 0.9).
    assert choose_beta({0.01: 0.02, 0.03: 0.05, 0.3: 0.9})[0] == 0.03


def test_calibration_reads_iterations_2_to_5_and_their_last_line_and_leaves_out_those_without_policy_gradient():
    import math

    from experiments.two_hop.calibrate import choose_beta, iteration_shares, mean_share

    rows = [{"iteration": i, "kl/grad_share": 0.0 if i == 1 else 0.1 * i} for i in range(1, 6)]
    rows.append({"iteration": 5, "kl/grad_share": 0.9})  # a resumed run logs iteration 5 again: the last line counts
    assert iteration_shares(rows) == [0.2, 0.30000000000000004, 0.4, 0.9]
    assert iteration_shares(rows[:4]) is None  # iteration 5 missing
    # Every advantage 0 on the first micro-batch: no policy gradient, an infinite share, left out of the mean.
    assert mean_share([0.2, math.inf, 0.4, math.inf]) == 0.30000000000000004
    assert math.isnan(mean_share([math.inf] * 4))
    assert choose_beta({0.01: math.nan, 0.1: 0.5, 0.3: 2.0})[0] == 0.1  # a candidate with no finite share is out



def write_evaluation(folder, em_2hop: float, em_reworded: float = 0.5, answered: float = 1.0) -> None:
    from eval.report import DatasetResult, EvalReport

    def result(dataset: str, em: float) -> DatasetResult:
        return DatasetResult(dataset=dataset, mode="agent", n=100, em=em, em_ci95=(em, em), cover_em=em, f1=em,
                             answered=answered, well_formed=1.0, text_cover_em=em, mean_searches=2.0, mean_turns=3.0,
                             invalid_action_rate=0.0, mean_response_tokens=30.0, seconds=1.0)

    results = [result("kb-2hop", em_2hop), result("kb-reworded", em_reworded)]
    EvalReport(model="m", subset="held-out", results=results).save(folder)


HELD = [0.6, 0.9, 1.0, 1.0, 1.0, 1.0, 0.95, 1.0]
FELL = [0.6, 0.9, 1.0, 0.1, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("rewards, last_em, abandoned, broke", [
    (HELD, 1.0, [], False),
    (HELD, 0.4, [], True),  # did not learn: below the start's 0 + 0.5
    (FELL, 1.0, [], True),  # collapsed: smoothed reward ends below half its peak
    ([0.2] * 8, 0.9, [1.0, 1.0, 1.0], False),  # the abandoned attempt's peak would have made it a collapse
])
def test_the_pilot_verdict_applies_the_plans_rule(tmp_path, rewards, last_em, abandoned, broke):
    """A pilot run's folder as compare writes it: metrics (an abandoned attempt's rows first), evaluations at
    iterations 4 and 8, an EMA arm's anchor evaluation beside them (not read), the SFT start's (kb-2hop 0)."""
    from experiments.two_hop.verdict import pilot_verdict

    run = tmp_path / "two-hop" / "grpo-k3c"
    run.mkdir(parents=True)
    rows = [{"iteration": i, "rollout/reward": r, "loss/total": 0.1} for i, r in enumerate(abandoned, 1)]
    rows += [{"iteration": i, "rollout/reward": r, "loss/total": 0.1} for i, r in enumerate(rewards, 1)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    write_evaluation(tmp_path / "two-hop" / "eval-sft", 0.0)
    write_evaluation(run / "eval-0004", 1.0)
    write_evaluation(run / "eval-0008", last_em)
    write_evaluation(run / "eval-anchor-8", 1.0)

    verdict = pilot_verdict(run)
    assert verdict["broke"] is broke
    assert verdict["iterations"] == 8 and verdict["last_evaluation"] == "eval-0008" and verdict["kb_2hop_em"] == last_em


def write_stage2_block(run, a: str = "EMA-PG", b: str = "GRPO-k3c") -> None:
    """A block as `compare --seeds` writes it: the plan, the SFT start, seeds 201 and 202 finished by both arms, 203
    by b only (left out); a's runs at 201 answered every question, b's at 201 none."""
    from eval.seed_report import write_plan

    write_plan(run, ["SFT", b, a, f"{a} anchor"], [(a, b)], [201, 202, 203])
    write_evaluation(run / "eval-sft", 0.0, 0.58)
    finished = {(b, 201): (FELL, 0.0, 0.0, 0.0), (a, 201): (HELD, 1.0, 0.9, 1.0),
                (b, 202): (HELD, 0.5, 0.6, 1.0), (a, 202): (HELD, 1.0, 0.6, 1.0),
                (b, 203): (HELD, 1.0, 0.6, 1.0)}
    for (arm, seed), (rewards, em, reworded, answered) in finished.items():
        folder = run / f"seed-{seed}" / arm.lower()
        folder.mkdir(parents=True)
        rows = [{"iteration": i, "rollout/reward": r, "grad/pg_norm": float(i), "grad/kl_norm": 0.5}
                for i, r in enumerate(rewards, 1)]
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
        write_evaluation(folder / "eval-0016", em, reworded, answered)  # configs/two_hop.yaml's last iteration
    (run / "seed-203" / a.lower()).mkdir()  # started, not finished


def test_study_b_stage_2_tests_the_declared_outcomes_on_the_seeds_every_arm_finished(tmp_path):
    """Study B's block (EMA-PG - GRPO-k3c, the defaults). The primary is the kb-2hop difference, the reworded set a
    secondary, collapses counted by the rule on each run's history, the share answered reported beside."""
    from experiments.two_hop.study_b import analyse, markdown, readme_effect

    run = tmp_path / "two-hop"
    write_stage2_block(run)

    result = analyse(run, iterations=16)
    assert result["seeds"] == [201, 202] and result["unfinished_seeds"] == [203]
    primary = result["primary"]
    assert primary["differences"] == [1.0, 0.5] and primary["mean"] == 0.75
    assert primary["p"] == 0.5  # of the 4 sign assignments, the observed and its mirror are as extreme
    collapses, reworded = result["secondary"]
    assert collapses["collapsed"] == {"EMA-PG": 0, "GRPO-k3c": 1} and collapses["p"] == 1.0
    assert reworded["differences"] == pytest.approx([0.9, 0.0]) and reworded["p"] == 1.0
    assert [row["holm_p"] for row in result["secondary"]] == [1.0, 1.0]
    # grad/ means leave iteration 1 out: pg_norm over iterations 2-8 is 5 in every run
    assert result["per_arm"]["EMA-PG"]["grad"]["grad/pg_norm"] == 5.0
    assert result["per_arm"]["GRPO-k3c"]["grad"]["grad/zero_advantage_groups"] is None
    assert result["answered"]["differences"] == [1.0, 0.0]
    assert result["per_arm"]["GRPO-k3c"]["zero_em_runs_never_answered"] == 1
    assert "p = 0.5" in markdown(result) and "answered at all, EMA-PG - GRPO-k3c: +0.500" in markdown(result)
    pilot = [("GRPO-k3c", "2e-5", False), ("GRPO-k3c", "1e-4", True), ("EMA-PG", "1e-4", False)]
    assert readme_effect(pilot, result) == ("pilot: GRPO-k3c held at 2e-5, broke at 1e-4 (EMA-PG held there, 1 seed); "
                                            "Stage 2 running (2 of 3 seeds)")
    finished = {**result, "declared_seeds": [201, 202]}
    assert readme_effect(pilot, finished).startswith("kb-2hop EM +0.750 [") and "ahead in 2, behind in 0 of 2" in (
        readme_effect(pilot, finished))

    from typer.testing import CliRunner

    from experiments.two_hop.study_b import app

    written = CliRunner().invoke(app, ["--run", str(run)])
    assert written.exit_code == 0, written.output
    assert json.loads((run / "study_b.json").read_text())["primary"]["mean"] == 0.75
    assert (run / "em_per_seed.png").stat().st_size > 0 and (run / "train_reward.png").stat().st_size > 0


def test_stage_2_analyses_the_arms_it_is_given(tmp_path):
    """Study D's block (docs/study_d_plan.md): the same analysis on the warm-up arms, named on the command line; a
    plan without them is refused by name."""
    from typer.testing import CliRunner

    from experiments.two_hop.study_b import analyse, app

    run = tmp_path / "two-hop"
    write_stage2_block(run, "EMA-PG-warmup", "GRPO-k3c-warmup")
    with pytest.raises(ValueError, match="Stage 2 needs EMA-PG and GRPO-k3c"):
        analyse(run, iterations=16)
    written = CliRunner().invoke(app, ["--run", str(run), "--a", "EMA-PG-warmup", "--b", "GRPO-k3c-warmup",
                                       "--name", "study_d"])
    assert written.exit_code == 0, written.output
    result = json.loads((run / "study_d.json").read_text())
    assert result["pair"] == ["EMA-PG-warmup", "GRPO-k3c-warmup"] and result["primary"]["differences"] == [1.0, 0.5]
    assert result["secondary"][0]["collapsed"] == {"EMA-PG-warmup": 0, "GRPO-k3c-warmup": 1}
    assert (run / "study_d.md").read_text().startswith("# Stage 2: EMA-PG-warmup - GRPO-k3c-warmup")

"""The demo's pooled table; the comparison's saved reports and log bookkeeping (its methods: test_compare_report.py)."""

from __future__ import annotations

import math

from emapg.compare import work_minutes
from eval.report import DatasetResult, EvalReport, pooled, stages_markdown, wilson_interval


def result(dataset: str, n: int, em: float) -> DatasetResult:
    return DatasetResult(dataset=dataset, mode="agent", n=n, em=em, em_ci95=wilson_interval(em * n, n), cover_em=em,
                         f1=em, answered=1.0, well_formed=0.5, text_cover_em=em, mean_searches=1.0, mean_turns=2.0,
                         invalid_action_rate=0.0, mean_response_tokens=50.0, seconds=1.0)


def test_pooled_row_weights_datasets_by_their_questions():
    report = EvalReport(model="m", subset="s", results=[result("nq", 10, 0.5), result("triviaqa", 30, 0.1)])
    row = pooled(report)
    assert row["n"] == 40 and abs(row["em"] - 8 / 40) < 1e-12
    assert (row["em_low"], row["em_high"]) == wilson_interval(8, 40)
    table = stages_markdown({"SFT": report}, {"total": 60.0}, "s")
    assert "| SFT | 40 | 0.200 |" in table and "| SFT | nq | 10 | 0.500 |" in table


def test_saved_report_loads_back_equal(tmp_path):
    report = EvalReport(model="m", subset="s", results=[result("nq", 10, 0.5), result("triviaqa", 30, 0.1)],
                        seconds=12.5)
    report.finish()
    report.save(tmp_path)
    assert EvalReport.load(tmp_path / "report.json") == report  # what a resumed `make compare` reuses




def test_work_minutes_sum_every_timed_phase_and_count_the_shared_start_once():
    curves = {"GRPO": [{"iteration": 1, "rollout/reward": 0.5, "time/rollout_s": 60.0, "time/update_s": 30.0,
                        "rollout/retrieval_wait_s": 50.0}],  # part of time/rollout_s: not counted again
              "EMA-PG": [{"iteration": 1, "time/rollout_s": 90.0, "time/ema_s": 0.0}]}
    sft = {"em": 0.2, "seconds": 120.0}
    held_out = {"GRPO": [(0, sft), (1, {"em": 0.3, "seconds": 60.0})],
                "EMA-PG": [(0, sft), (1, {"em": 0.3, "seconds": 60.0})]}
    assert work_minutes(curves, held_out) == (60 + 30 + 90 + 120 + 60 + 60) / 60


def test_the_wilson_interval_contains_its_proportion_at_every_count():
    """At every count of 1-400 questions, from none right to all right: low <= p <= high within [0, 1], and the
    interval is Wilson's (checked against the closed form at one point). Before the clamp, 303 of 303 gave a high of
    0.9999999999999999 < 1, and the comparison's report plot then refused a negative error bar."""
    for n in range(1, 401):
        for k in range(n + 1):
            low, high = wilson_interval(k, n)
            assert 0.0 <= low <= k / n <= high <= 1.0, (k, n)
    z, p, n = 1.96, 0.25, 40
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert wilson_interval(10, 40) == ((p + z * z / (2 * n)) / (1 + z * z / n) - half,
                                       (p + z * z / (2 * n)) / (1 + z * z / n) + half)


def test_the_comparison_plot_takes_a_perfect_and_a_zero_evaluation(tmp_path):
    """The case that ended Study B's Stage 2 report after seed 201: one method at EM 1.0 on 303 questions, the other
    at 0.0, each with its pooled Wilson interval."""
    from eval.report import plot_methods

    curves, held_out = {}, {}
    for name, em in (("EMA-PG", 1.0), ("GRPO-k3c", 0.0)):
        report = EvalReport(model="m", subset="s", results=[result("kb-2hop", 103, em), result("kb-reworded", 200, em)])
        curves[name] = [{"iteration": 1, "rollout/reward": em}, {"iteration": 2, "rollout/reward": em}]
        held_out[name] = [(0, pooled(report)), (2, pooled(report))]
    plot_methods(curves, held_out, tmp_path / "compare.png")
    assert (tmp_path / "compare.png").stat().st_size > 10_000

"""The two-hop study's analysis (experiments/two_hop/analyse.py) on a fake study folder built with the real writers:
the second-search outcome on constructed trajectories, kl/grad_share and machine time from fake metrics, and the
report of a study half done (which runs count, which are missing, the table's numbers, the plots)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent.trajectory import Trajectory, Turn, save_jsonl
from data.qa import QAExample
from eval.harness import score
from eval.report import EvalReport
from eval.seed_report import write_plan
from experiments.mechanism.kb import KBQuestion, save_questions
from experiments.two_hop.analyse import (
    analyse,
    app,
    contains_number,
    finite_grad_share_count,
    learning_speed,
    load_bridges,
    mean_grad_share,
    names_bridge,
    search_outcomes,
    second_search_query,
    training_seconds,
)

# The fake KB's two-hop questions, in the evaluation set's order: (person, bridge city, country).
FAKE_QUESTIONS = [("1111", "2222", "3333"), ("1234", "3456", "4567"), ("4321", "6543", "7654"),
                  ("5678", "8765", "9876")]


def question_text(person: str) -> str:
    return f"In which country was person {person} born?"


def fake_kb(path: Path) -> None:
    """The KB's test questions as kb.py writes them: ids of its own (kb-birth_country/test/<index>), a one-hop
    question first, and a person asked twice (the same question, the same bridge)."""
    rows = [KBQuestion(QAExample("kb-birthplace/test/0", "kb-birthplace", "test", "Where was person 1111 born?",
                                 ("2222",), "synthetic-kb"), "birthplace", ("1111",))]
    for person, city, country in [*FAKE_QUESTIONS, FAKE_QUESTIONS[0]]:
        index = len(rows)
        rows.append(KBQuestion(QAExample(f"kb-birth_country/test/{index}", "kb-birth_country", "test",
                                         question_text(person), (country,), "synthetic-kb"),
                               "birth_country", (person, city), city))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_questions(rows, path)


def fake_trajectory(index: int, queries: list[str], answer: str | None, extra_turns: tuple[Turn, ...] = ()) -> Trajectory:
    """A fake two-hop trajectory of the evaluation set's question `index` (group id as data.qa names it): one search
    turn per query (its one document named after the query), then an answer turn."""
    person, _, country = FAKE_QUESTIONS[index]
    turns = [Turn("search", 0, 0, "stop", query=q, doc_ids=[f"doc-{q}"]) for q in queries]
    turns += [*extra_turns, Turn("answer", 0, 0, "stop")]
    return Trajectory(uid=f"kb-2hop/test/{index}#0", group_id=f"kb-2hop/test/{index}", question=question_text(person),
                      golden_answers=[country], prompt_ids=[1, 2], turns=turns, answer=answer, done=True)


def behaved(index: int, behaviour: str, right: bool) -> Trajectory:
    """The fake behaviours: the second search names the bridge, names another number, names the bridge only inside a
    longer number, repeats the first search; or a single search."""
    person, bridge, country = FAKE_QUESTIONS[index]
    queries = {"bridge": [person, f"city {bridge}"], "other": [person, "9999"], "longer": [person, f"1{bridge}"],
               "repeat": [person, person], "once": [person]}[behaviour]
    return fake_trajectory(index, queries, country if right else "0000")


def fake_eval(folder: Path, behaviours: list[tuple[str, bool]], seconds: float = 60.0) -> None:
    """A fake evaluation folder as eval/harness.py writes it: trajectories/kb-2hop.agent.jsonl and report.json
    (scored by the harness's own `score`)."""
    trajectories = [behaved(i, b, right) for i, (b, right) in enumerate(behaviours)]
    save_jsonl(trajectories, folder / "trajectories" / "kb-2hop.agent.jsonl")
    report = EvalReport(model="fake", subset="held-out",
                        results=[score(trajectories, "kb-2hop", "agent", seconds, [t.answer or "" for t in trajectories])],
                        seconds=seconds)
    report.finish()
    (folder / "report.json").write_text(json.dumps(asdict(report), indent=2))


def fake_metrics(path: Path, share_scale: float, iterations: int = 4, resumed_at: int | None = 3,
                 reward_step: float = 0.0) -> None:
    """Fake metrics.jsonl: 15 s of logged phases per line; kl/grad_share 0 at iteration 1, then 0.1, 0.2 (replaced
    by 0.3 when the run resumed there), 0.5, times share_scale; train reward 0.5 rising by reward_step an
    iteration, up to 1."""
    shares = {1: 0.0, 2: 0.1, 3: 0.2, 4: 0.5}
    lines = []
    for i in range(1, iterations + 1):
        lines.append({"iteration": i, "rollout/reward": min(1.0, 0.5 + reward_step * (i - 1)),
                      "kl/grad_share": shares[i] * share_scale,
                      "time/rollout_s": 10.0, "time/update_s": 5.0})
        if i == resumed_at:  # a resumed run logs the iteration again: the last line is the one that counts
            lines.append({**lines[-1], "kl/grad_share": 0.3 * share_scale})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(m) + "\n" for m in lines))


SFT_BEHAVIOUR = [("once", False), ("once", False), ("bridge", True), ("other", False)]
FINISHED = {  # (arm folder, seed) -> the final evaluation's behaviours
    ("grpo-k3c", 0): [("bridge", True), ("once", False), ("longer", False), ("other", False)],
    ("grpo-k3c", 1): [("bridge", True), ("bridge", True), ("repeat", False), ("once", False)],
    ("ema-pg", 0): [("bridge", True), ("bridge", True), ("bridge", True), ("bridge", False)],
    ("ema-pg", 1): [("bridge", True)] * 4,
}


@pytest.fixture
def fake_study(tmp_path) -> Path:
    """A fake study, final iteration 4, seeds 0-2 declared: GRPO-k3c and EMA-PG finished at seeds 0 and 1;
    GRPO-k3c seed 2 stopped after iteration 2 (its eval-0002 exists, not its final one); EMA-PG seed 2 not started.
    Every evaluation took 60 s."""
    out = tmp_path / "study"
    fake_kb(out / "kb" / "questions-test.jsonl")
    run = out / "two-hop"
    write_plan(run, ["SFT", "GRPO-k3c", "EMA-PG", "EMA-PG anchor"], [("EMA-PG", "GRPO-k3c")], [0, 1, 2])
    fake_eval(run / "eval-sft", SFT_BEHAVIOUR)
    (run / "sft").mkdir()
    (run / "sft" / "metrics.jsonl").write_text('{"iteration": 1, "loss/sft": 1.0, "time/step_s": 10.0}\n'
                                               '{"iteration": 2, "loss/sft": 0.5, "time/step_s": 20.0}\n')
    for (arm, seed), behaviours in FINISHED.items():
        folder = run / f"seed-{seed}" / arm
        fake_metrics(folder / "metrics.jsonl", share_scale=1.0 if arm == "grpo-k3c" else 2.0,
                     reward_step=0.0 if arm == "grpo-k3c" else 0.25)
        fake_eval(folder / "eval-0002", SFT_BEHAVIOUR)
        fake_eval(folder / "eval-0004", behaviours)
        if arm == "ema-pg":
            fake_eval(folder / "eval-anchor-0004", behaviours)
    unfinished = run / "seed-2" / "grpo-k3c"
    fake_metrics(unfinished / "metrics.jsonl", share_scale=1.0, iterations=2, resumed_at=None)
    fake_eval(unfinished / "eval-0002", FINISHED[("grpo-k3c", 0)])
    return out


# --- pure functions ------------------------------------------------------------------------------------------

def test_the_second_search_names_the_bridge_only_as_a_whole_number():
    assert second_search_query(behaved(0, "bridge", True)) == "city 2222"
    assert names_bridge(behaved(0, "bridge", True), "2222")
    assert not names_bridge(behaved(0, "other", True), "2222")
    assert not names_bridge(behaved(0, "once", True), "2222") and second_search_query(behaved(0, "once", True)) is None
    assert not names_bridge(behaved(0, "longer", True), "2222")  # "12222": another number, not city 2222
    assert contains_number("city2222?", "2222") and contains_number("2222", "2222")
    assert not contains_number("22223", "2222") and not contains_number("city 222", "2222")
    # The bridge in the first search only does not count; turns that are not searches are skipped.
    assert not names_bridge(fake_trajectory(0, ["2222", "1111"], None), "2222")
    between = fake_trajectory(0, ["1111"], None, extra_turns=(Turn("invalid", 0, 0, "stop"),
                                                               Turn("search", 0, 0, "stop", query="2222")))
    assert names_bridge(between, "2222")
    final_only = fake_trajectory(0, ["1111"], None, extra_turns=(Turn("final", 0, 0, "length", query="2222"),))
    assert not names_bridge(final_only, "2222")


def test_search_outcomes_count_shares_of_every_two_hop_trajectory(tmp_path):
    fake_kb(tmp_path / "questions-test.jsonl")
    bridges = load_bridges(tmp_path / "questions-test.jsonl")
    # Matched by question text: the KB's ids (kb-birth_country/test/1) are not the evaluation set's (kb-2hop/test/0).
    assert bridges == {question_text(p): city for p, city, _ in FAKE_QUESTIONS}
    trajectories = [behaved(0, "bridge", True), behaved(1, "other", False), behaved(2, "longer", False),
                    behaved(3, "once", False), behaved(0, "repeat", False)]
    outcomes = search_outcomes(trajectories, bridges)
    assert outcomes["n"] == 5
    assert outcomes["bridge_second_search"] == pytest.approx(1 / 5)
    assert outcomes["two_searches"] == pytest.approx(4 / 5)
    assert outcomes["bridge_given_two_searches"] == pytest.approx(1 / 4)
    assert outcomes["repeated_search_rate"] == pytest.approx(1 / 9)  # one repeat among 2 + 2 + 2 + 1 + 2 searches
    assert outcomes["repeated_trajectory_rate"] == pytest.approx(1 / 5)
    stranger = fake_trajectory(0, ["1"], None)
    stranger.question = "In which country was person 9999 born?"
    with pytest.raises(KeyError, match="not a two-hop question"):
        search_outcomes([stranger], bridges)


def test_grad_share_skips_iteration_1_and_keeps_a_resumed_iterations_last_line_time_counts_every_line(tmp_path):
    fake_metrics(tmp_path / "metrics.jsonl", share_scale=1.0)
    from trainer.run.metrics_log import read_metrics

    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert mean_grad_share(metrics) == pytest.approx((0.1 + 0.3 + 0.5) / 3)
    assert training_seconds(metrics) == pytest.approx(5 * 15.0)  # 4 iterations + the replayed one
    assert mean_grad_share([{"iteration": 1, "kl/grad_share": 0.0}, {"iteration": 2}]) is None


# --- the report of a fake study ------------------------------------------------------------------------------

def test_learning_speed_reads_each_iterations_last_line():
    metrics = [{"iteration": 1, "rollout/reward": 0.2}, {"iteration": 2, "rollout/reward": 1.0},
               {"iteration": 2, "rollout/reward": 0.6},  # resumed: the last line of iteration 2 counts
               {"iteration": 3, "rollout/reward": 1.0}]
    assert learning_speed(metrics, early=2) == {"early_reward": pytest.approx(0.4), "first_full_reward": 3}
    assert learning_speed(metrics, early=4)["early_reward"] is None  # iteration 4 was never logged
    assert learning_speed(metrics[:1], early=1) == {"early_reward": pytest.approx(0.2), "first_full_reward": None}


def test_a_half_done_fake_study_counts_only_final_evaluations_and_lists_the_missing(fake_study):
    result = analyse(fake_study, iterations=4)
    run = fake_study / "two-hop"
    assert result["arms"] == ["GRPO-k3c", "EMA-PG"] and result["seeds"] == [0, 1, 2]
    grpo, emapg = result["per_arm"]["GRPO-k3c"], result["per_arm"]["EMA-PG"]
    assert (grpo["seeds"], grpo["missing_seeds"]) == ([0, 1], [2])
    assert (emapg["seeds"], emapg["missing_seeds"]) == ([0, 1], [2])
    assert grpo["em"]["mean"] == pytest.approx(0.375) and emapg["em"]["mean"] == pytest.approx(0.875)
    # Exact bootstrap over the 2^2 resamples of two seeds: means 0.25, 0.375, 0.375, 0.5; numpy's linear quantiles.
    assert grpo["em"]["ci"] == pytest.approx([0.259375, 0.490625])
    assert grpo["bridge_second_search"]["mean"] == pytest.approx(0.375)  # seed 0: 1 of 4 ("longer" does not count)
    assert grpo["two_searches"]["mean"] == pytest.approx(0.75)
    assert grpo["repeated_search_rate"]["mean"] == pytest.approx((0 + 1 / 7) / 2)
    assert emapg["bridge_second_search"]["mean"] == pytest.approx(1.0)
    assert grpo["kl_grad_share"]["mean"] == pytest.approx(0.3) and emapg["kl_grad_share"]["mean"] == pytest.approx(0.6)
    assert result["sft"]["em"] == pytest.approx(0.25) and result["sft"]["two_searches"] == pytest.approx(0.5)
    # Machine time: finished runs 75 s logged + 2 evaluations (GRPO-k3c) or 3 with the anchor (EMA-PG) of 60 s; the
    # unfinished run 30 + 60; the SFT start 30 + 60.
    assert result["machine_hours"] * 3600 == pytest.approx(2 * 195 + 2 * 255 + 90 + 90)

    md = (run / "study.md").read_text()
    assert "- GRPO-k3c: seed 2" in md and "- EMA-PG: seed 2" in md
    assert "| SFT (start) | - | 0.250 | (one model) |" in md
    assert "| GRPO-k3c | 2 | 0.375 [0.259, 0.491] | 0: 0.250, 1: 0.500 |" in md
    assert "| EMA-PG | 2 | 0.875 [0.759, 0.991] | 0: 0.750, 1: 1.000 |" in md
    assert "| SFT (start) | - | 0.250 | 0.500 | 0.000 |" in md  # bridge, two searches, repeated
    assert "| GRPO-k3c | 2 | 0.375 [0.259, 0.491] | 0.750 [0.750, 0.750] | 0.071 [" in md
    assert "| GRPO-k3c | 1 | 4 | 0.500 | 0.500 | 0.750 | 0.667 | 0.143 | 0.3000 (3) | 0.05 |" in md
    assert "| GRPO-k3c | 2 | 2 | unfinished |" in md
    assert "| EMA-PG | 2 |" not in md.split("## Per run")[1].split("## kl/grad_share")[0]  # never started
    assert "| EMA-PG | 2 | 0.6000 [0.6000, 0.6000] |" in md
    assert "4 of 6 runs finished" in md and "0.30 h" in md
    # Exploratory: the early train reward (iterations 1-2 of 4); EMA-PG rises 0.5, 0.75, 1.0; GRPO-k3c stays at 0.5.
    assert grpo["early_reward"]["mean"] == pytest.approx(0.5) and emapg["early_reward"]["mean"] == pytest.approx(0.625)
    assert "| EMA-PG | 2 | 0.625 [0.625, 0.625] | 0: 3, 1: 3 |" in md and "| GRPO-k3c | 2 | 0.500 [0.500, 0.500] | 0: -, 1: - |" in md
    assert "| EMA-PG - GRPO-k3c | 2 | +0.125 [+0.125, +0.125] | 2 / 0 / 0 | 0.5 |" in md  # 2 seeds: p >= 2/4

    saved = json.loads((run / "study.json").read_text())
    assert saved["per_arm"]["GRPO-k3c"]["missing_seeds"] == [2]
    assert saved["kl_grad_share_curves"]["EMA-PG"]["0"] == [[1, 0.0], [2, 0.2], [3, 0.6], [4, 1.0]]
    assert saved["train_reward_curves"]["EMA-PG"]["0"] == [[1, 0.5], [2, 0.75], [3, 1.0], [4, 1.0]]
    assert sorted(saved["train_reward_curves"]["GRPO-k3c"]) == ["0", "1"]  # the finished runs only (not seed 2)
    for plot in ("em_per_seed.png", "kl_grad_share.png", "train_reward.png"):
        assert (run / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_line_takes_the_final_iteration_from_the_config_unless_given(fake_study):
    runner = CliRunner()
    given = runner.invoke(app, ["--out", str(fake_study), "--iterations", "4"])
    assert given.exit_code == 0, given.output
    assert "- EMA-PG: seed 2" in given.output and "4 of 6 runs finished" in given.output
    # configs/two_hop.yaml trains more than 4 iterations: the fake study has no such evaluation, so nothing finished.
    default = runner.invoke(app, ["--out", str(fake_study)])
    assert default.exit_code == 0, default.output
    assert "0 of 6 runs finished" in default.output and "- GRPO-k3c: seeds 0, 1, 2" in default.output


def test_the_mean_share_leaves_out_iterations_without_a_policy_gradient_as_the_calibration_does():
    import math

    rows = [{"iteration": 1, "kl/grad_share": 0.0}, {"iteration": 2, "kl/grad_share": 0.2},
            {"iteration": 3, "kl/grad_share": math.inf}, {"iteration": 4, "kl/grad_share": 0.4}]
    assert mean_grad_share(rows) == pytest.approx(0.3)
    assert mean_grad_share(rows[:1] + rows[2:3]) is None  # only an infinite share after iteration 1
    assert finite_grad_share_count(rows) == 2 and finite_grad_share_count(rows[:1] + rows[2:3]) == 0

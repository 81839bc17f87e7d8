"""The report across seeds, on evaluation folders written by the real writers (agent.trajectory.save_jsonl and
eval.harness.EvalReport.save) from FABRICATED trajectories: every number in it checked against the per-seed EM we
fabricated, the sign-flip test, Holm and McNemar computed directly."""

from __future__ import annotations

import json
import multiprocessing

import pytest

from agent.trajectory import Trajectory, save_jsonl
from eval.harness import EvalReport, score
from eval.paired import paired_em, per_question_em
from eval.seed_report import read_plan, seed_markdown, seed_report, write_plan, write_seed_report
from eval.seed_stats import holm, sign_flip_p

DATASETS = {"nq": 12, "triviaqa": 8}  # 20 fabricated held-out questions


def fabricated_eval(folder, right: set[str]):
    """An evaluation folder as eval.harness.evaluate leaves it: one agent-mode trajectory per question (answered
    right iff its id is in `right`), and report.json."""
    report = EvalReport(model="fake", subset="fabricated")
    for dataset, n in DATASETS.items():
        trajectories = []
        for i in range(n):
            qid = f"{dataset}/test/{i}"
            trajectories.append(Trajectory(uid=f"{qid}#0", group_id=qid, question=f"question {qid}",
                                           golden_answers=[f"gold {i}"], prompt_ids=[1],
                                           answer=f"gold {i}" if qid in right else "wrong"))
        save_jsonl(trajectories, folder / "trajectories" / f"{dataset}.agent.jsonl")
        report.results.append(score(trajectories, dataset, "agent", 1.0, [""] * n))
    report.finish()
    report.save(folder)
    return folder


ALL = [f"{d}/test/{i}" for d, n in DATASETS.items() for i in range(n)]
# Questions right per (model, seed): SFT is shared by every seed; B gains 2-6 questions over SFT, A more.
RIGHT = {
    "SFT": {s: 8 for s in range(5)},
    "B": {0: 10, 1: 12, 2: 9, 3: 14, 4: 11},
    "A": {0: 15, 1: 12, 2: 16, 3: 13, 4: 17},
}


@pytest.fixture
def folders(tmp_path):
    sft = fabricated_eval(tmp_path / "eval-sft", set(ALL[:8]))
    evals = {"SFT": {s: sft for s in range(5)}, "A": {}, "B": {}}
    for method in ("A", "B"):
        for seed, k in RIGHT[method].items():
            # Different questions per seed and method (a rotation), so that McNemar's discordant counts vary.
            shift = seed + (3 if method == "A" else 0)
            evals[method][seed] = fabricated_eval(tmp_path / f"{method}-seed{seed}",
                                                  {ALL[(shift + j) % len(ALL)] for j in range(k)})
    return evals


def test_report_numbers_against_direct_computation(folders):
    comparisons = [("A", "SFT"), ("B", "SFT"), ("A", "B")]
    report = seed_report(folders, comparisons, seeds=range(5))
    assert report["seeds"] == [0, 1, 2, 3, 4] and report["unfinished_seeds"] == [] and report["questions"] == 20
    for method in ("A", "B", "SFT"):
        expected = [RIGHT[method][s] / 20 for s in range(5)]
        m = report["methods"][method]
        assert m["per_seed"] == pytest.approx(expected)
        assert m["mean"] == pytest.approx(sum(expected) / 5) and m["ci"][0] <= m["mean"] <= m["ci"][1]
    rows = {(c["a"], c["b"]): c for c in report["comparisons"]}
    diffs = [(RIGHT["A"][s] - RIGHT["B"][s]) / 20 for s in range(5)]  # +5 0 +7 -1 +6 questions
    ab = rows[("A", "B")]
    assert ab["differences"] == pytest.approx(diffs)
    assert (ab["wins"], ab["losses"], ab["ties"]) == (3, 1, 1)
    # The -1 is the smallest non-zero difference: all-plus and the observed signs (and their mirrors) of the 2^4
    # assignments of the non-zero ones.
    assert ab["p"] == sign_flip_p(diffs) == 4 / 16
    assert ab["smallest_possible_p"] == 2 / 16  # one seed tied: 4 non-zero differences
    assert rows[("A", "SFT")]["p"] == rows[("B", "SFT")]["p"] == 2 / 32  # every seed above SFT
    assert [c["holm_p"] for c in report["comparisons"]] == pytest.approx(holm([c["p"] for c in report["comparisons"]]))
    assert rows[("A", "SFT")]["holm_p"] == pytest.approx(3 * 2 / 32)
    for q in ab["mcnemar"]:
        direct = paired_em(per_question_em(folders["A"][q["seed"]]), per_question_em(folders["B"][q["seed"]]))
        assert (q["a_only"], q["b_only"], q["p"], q["n"]) == (direct.a_only, direct.b_only, direct.p_value, 20)
    text = seed_markdown(report)
    assert "| A | B | 5 | +0.170 |" in text and "3 / 1 / 1" in text and "0.0625" in text
    assert "for these two checkpoints" in text


def test_unfinished_seeds_are_left_out_and_named(folders):
    del folders["B"][4]
    report = seed_report(folders, [("A", "B")], seeds=[0, 1, 2, 3, 4, 5])
    assert report["seeds"] == [0, 1, 2, 3] and report["unfinished_seeds"] == [4, 5]
    assert "left out): 4, 5" in seed_markdown(report)
    with pytest.raises(ValueError, match="seeds: none of"):
        seed_report(folders, [("A", "B")], seeds=[7])


def test_plan_fixes_the_family_and_collects_seeds(tmp_path, folders):
    write_plan(tmp_path, ["SFT", "A", "B"], [("A", "B"), ("A", "SFT")], seeds=[0, 1, 2])
    # A second process running other seeds into the same folder: seeds added, family unchanged.
    plan = write_plan(tmp_path, ["SFT", "A", "B"], [("A", "B"), ("A", "SFT")], seeds=[3, 4])
    assert plan["seeds"] == [0, 1, 2, 3, 4] and read_plan(tmp_path) == plan
    with pytest.raises(ValueError, match="comparisons"):
        write_plan(tmp_path, ["SFT", "A", "B"], [("A", "B")], seeds=[0])
    path = write_seed_report(tmp_path, folders)
    saved = json.loads((tmp_path / "seeds.json").read_text())
    assert [(c["a"], c["b"]) for c in saved["comparisons"]] == [("A", "B"), ("A", "SFT")]
    assert path.read_text().startswith("## Across training seeds: 5 seeds")


def test_plans_written_side_by_side_keep_every_seed(tmp_path):
    # Processes started together, each declaring its own seeds into one folder.
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.starmap(write_plan, [(tmp_path, ["A", "B"], [("A", "B")], [seed]) for seed in range(8)])
    assert read_plan(tmp_path)["seeds"] == list(range(8))


def test_bad_comparisons_are_refused(tmp_path, folders):
    with pytest.raises(ValueError, match=r"missing: \{'C': \[0, 1, 2, 3, 4\]\}"):
        seed_report(folders, [("A", "C")], seeds=range(5))  # C: a typo, or a model with no evaluation yet
    with pytest.raises(ValueError, match="two different methods"):
        write_plan(tmp_path, ["A", "B"], [("A", "A")], seeds=[0])
    with pytest.raises(ValueError, match="listed twice"):
        write_plan(tmp_path, ["A", "B"], [("A", "B"), ("A", "B")], seeds=[0])
    with pytest.raises(FileNotFoundError, match="no plan"):
        read_plan(tmp_path / "elsewhere")

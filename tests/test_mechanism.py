"""The mechanism study's parts: the synthetic KB, its strategies through the real server, the sweep, the metrics."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from data.corpus import read_jsonl
from data.qa import normalize_answer
from eval.seed_stats import bootstrap_interval, holm, sign_flip_p
from experiments.mechanism.analysis import mean_ci, paired, summarise
from experiments.mechanism.cell import curve_summary, smoothed
from experiments.mechanism.kb import (HOPS, REWORDED, WORDINGS, KBSpec, generate_kb, load_questions, read_kb,
                                     write_kb)
from experiments.mechanism.sweep import Cell, SweepSection, grid, study_config, train_overrides
from trainer.config import load_config

SPEC = KBSpec(seed=3, train_people=60, test_people=20, train_cities=10, test_cities=5, countries=6,
              train_questions=120, test_questions=30)


@pytest.fixture(scope="module")
def kb_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("kb")
    write_kb(generate_kb(SPEC), out)
    return out


def test_kb_relations_and_splits():
    kb = generate_kb(SPEC)
    train_world = set(kb.train_people) | set(kb.train_cities)
    test_world = set(kb.test_people) | set(kb.test_cities)
    assert not train_world & test_world
    assert len(set(kb.born_in) | set(kb.country_of) | set(kb.country_of.values())) == len(kb.born_in) + len(
        kb.country_of) + len(set(kb.country_of.values()))  # every entity its own number
    assert all(len(n) == 4 and n.isdigit() for n in [*kb.born_in, *kb.country_of])
    assert all(kb.born_in[p] in kb.train_cities for p in kb.train_people)
    assert all(kb.born_in[p] in kb.test_cities for p in kb.test_people)  # test bridges are never trained on
    assert generate_kb(SPEC) == kb  # the seed fixes it
    assert generate_kb(KBSpec(**{**SPEC.__dict__, "seed": 4})) != kb
    with pytest.raises(ValueError, match="4-digit numbers"):
        generate_kb(KBSpec(train_people=9000))


def test_numbers_are_digit_tokens(tokenizer):
    """What makes the task copyable by a tiny model: a number is its digits, one token each."""
    ids = tokenizer.encode(" 4821", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in ids][-4:] == ["4", "8", "2", "1"]


def test_corpus_is_search_r1_jsonl_and_questions_follow_the_kb(kb_dir):
    kb = json.loads((kb_dir / "kb.json").read_text())
    passages = list(read_jsonl(kb_dir / "corpus.jsonl"))
    assert len(passages) == len(kb["born_in"]) + len(kb["country_of"])
    first = json.loads((kb_dir / "corpus.jsonl").read_text().splitlines()[0])
    assert set(first) == {"id", "contents"} and first["contents"].startswith('"')
    by_title = {p.title.split()[-1]: p.text for p in passages}  # "Person 4821" -> 4821
    for split, n in (("train", SPEC.train_questions), ("test", SPEC.test_questions)):
        questions = load_questions(kb_dir / f"questions-{split}.jsonl")
        assert len(questions) == n and {q.kind for q in questions} == set(HOPS)
        for q in questions:
            gold = q.example.golden_answers[0]
            assert len(q.queries) == HOPS[q.kind] and q.example.split == split
            assert q.example.id.startswith(f"kb-{q.kind}/{split}/")
            # Following the ideal queries through the documents reaches the gold answer.
            last_doc = by_title[q.queries[-1]]
            assert gold in last_doc
            if q.bridge is not None:
                assert q.bridge in by_title[q.queries[0]] and q.queries[1] == q.bridge
    ids = [q.example.id for q in load_questions(kb_dir / "questions-train.jsonl")]
    assert len(set(ids)) == len(ids)


def test_read_kb_remakes_the_written_kb_and_refuses_other_relations(kb_dir, tmp_path):
    assert read_kb(kb_dir) == generate_kb(SPEC)
    saved = json.loads((kb_dir / "kb.json").read_text())
    person = next(iter(saved["born_in"]))
    saved["born_in"][person] = "0000"
    (tmp_path / "kb.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="relations are not those its spec generates"):
        read_kb(tmp_path)


def wording(question) -> str:
    """A question's text with its entity's number taken out: the wording it uses."""
    return question.example.question.replace(question.queries[0], "{entity}")


def test_reworded_questions_ask_the_test_split_in_wordings_no_training_question_uses(kb_dir):
    """Study B's generalisation set: the answer a trained wording of the same question has, about test entities
    only, and none of its wordings among those of the train or test questions (or of the SFT demonstrations, which
    are built from the train questions' text)."""
    kb = generate_kb(SPEC)
    reworded = load_questions(kb_dir / "questions-reworded.jsonl")
    seen = {wording(q) for split in ("train", "test") for q in load_questions(kb_dir / f"questions-{split}.jsonl")}
    assert seen == set(WORDINGS.values())  # the check below can fail: these are the wordings trained on
    assert len(reworded) == SPEC.test_questions and {q.kind for q in reworded} == set(HOPS)
    assert {wording(q) for q in reworded} == set(REWORDED.values()) and not seen & set(REWORDED.values())
    for i, q in enumerate(reworded):
        assert q.queries[0] in (kb.test_cities if q.kind == "city_country" else kb.test_people)
        same = kb.question(q.kind, q.queries[0], "test", i)  # the trained wording of this question
        assert q.example.golden_answers == same.example.golden_answers
        assert (q.queries, q.bridge) == (same.queries, same.bridge)
        assert q.example.id == f"kb-{q.kind}/test-reworded/{i}" and q.example.split == "test-reworded"
    # Adding the set to a KB leaves its train and test questions as they were (it draws from a generator of its own).
    again = kb_dir.parent / "kb-again"
    write_kb(generate_kb(SPEC), again)
    for name in ("questions-train.jsonl", "questions-test.jsonl", "questions-reworded.jsonl"):
        assert (again / name).read_text() == (kb_dir / name).read_text()


@pytest.fixture(scope="module")
def kb_server(kb_dir, tmp_path_factory):
    from retriever.bm25 import build_bm25_index
    from retriever.client import RetrieverClient
    from retriever.process import running_server

    index = tmp_path_factory.mktemp("kb-index") / "bm25"
    build_bm25_index(kb_dir / "corpus.jsonl", index)
    with running_server(index) as url, RetrieverClient(url, topk=3) as client:
        yield client


def test_the_ideal_strategy_answers_every_question_through_the_real_server(kb_dir, kb_server, tokenizer):
    from experiments.mechanism.demos import answerable

    questions = load_questions(kb_dir / "questions-train.jsonl")
    assert len(answerable(questions, kb_server, tokenizer, topk=1, max_obs_tokens=100)) == len(questions)
    # A query for something the KB does not hold finds no document, so nothing can be answered without searching.
    assert kb_server.search(["0042"], 3) == [[]]


@pytest.mark.parametrize("full_rate", [0.0, 0.5, 1.0])
def test_demonstrations_show_the_weak_strategy_on_two_hop_questions(kb_dir, kb_server, tokenizer, full_rate):
    from experiments.mechanism.demos import build_demonstrations

    questions = load_questions(kb_dir / "questions-train.jsonl")
    by_id = {q.example.id: q for q in questions}
    demos, counts = build_demonstrations(questions, kb_server, tokenizer, topk=1, max_obs_tokens=100,
                                         full_rate=full_rate, seed=0)
    two_hop = sum(q.kind == "birth_country" for q in questions)
    assert len(demos) == len(questions) and counts["two_hop_full"] + counts["two_hop_weak"] == two_hop
    if full_rate == 0.0:
        assert counts["two_hop_full"] == 0
    elif full_rate == 1.0:
        assert counts["two_hop_weak"] == 0
    else:
        assert 0 < counts["two_hop_full"] < two_hop
    for demo in demos:
        q = by_id[demo.group_id]
        model_text = tokenizer.decode([t for t, m in zip(demo.response_ids, demo.loss_mask, strict=True) if m])
        observed = tokenizer.decode([t for t, m in zip(demo.response_ids, demo.loss_mask, strict=True) if not m])
        assert "<information>" not in model_text and "<search>" not in observed
        assert [t.query for t in demo.turns if t.kind == "search"] == list(q.queries[: demo.num_searches])
        assert demo.well_formed and normalize_answer(demo.answer) in normalize_answer(observed)
        weak = q.kind == "birth_country" and demo.num_searches == 1
        assert demo.answer == (q.bridge if weak else q.example.golden_answers[0])
        assert model_text.endswith(f"<answer> {demo.answer} </answer>")


def test_collapse_and_area_under_the_curve():
    rising = [0.2, 0.3, 0.5, 0.6, 0.7, 0.8]
    s = curve_summary(rising, finite=True)
    assert s["auc"] == pytest.approx(np.mean(rising)) and not s["collapsed"]
    assert smoothed([1.0, 0.0, 0.0])[-1] == pytest.approx(1 / 3)
    collapsed = curve_summary([0.6] * 6 + [0.0] * 10, finite=True)  # smoothed 0.6 -> 0.0: below half the peak
    assert collapsed["collapsed"] and "fell" in collapsed["collapse_reason"]
    dip = curve_summary([0.6] * 6 + [0.0] * 3 + [0.6] * 6, finite=True)  # recovered by the end: not a collapse
    assert not dip["collapsed"]
    assert curve_summary(rising, finite=False)["collapse_reason"].startswith("non-finite")
    assert curve_summary([], finite=True)["collapsed"]


def test_confidence_intervals_and_paired_comparison():
    mean, low, high = mean_ci([1.0, 2.0, 3.0])
    # The exact bootstrap over all 27 resamples (eval/seed_stats.py, tested there against a slow loop).
    assert mean == 2.0 and (low, high) == bootstrap_interval([1.0, 2.0, 3.0])
    assert math.isnan(mean_ci([1.0])[1])
    d = paired({0: 0.5, 1: 0.7, 2: 0.6, 3: 0.9}, {0: 0.4, 1: 0.5, 2: 0.6, 3: 0.5, 4: 0.1})
    assert d["n"] == 4 and d["mean"] == pytest.approx(0.175)
    assert (d["wins"], d["losses"], d["ties"]) == (3, 0, 1)
    # Three non-zero differences, all positive: the exact sign-flip test's floor on them, 2 / 2^3.
    assert d["p"] == d["smallest_p"] == 0.25


@pytest.mark.parametrize("fifth", [0.0, -0.005])
def test_the_headline_comparison_recomputed_across_seeds(fifth):
    # docs/mechanism_summary.md: lr 3e-3, EMA-PG - GRPO held-out EM. The committed numbers fix the fifth seed's
    # difference at 0 or -0.005 and the other four at >= +0.36 (their values were not committed: any such four).
    # The exact sign-flip p is then 0.125 either way (the t-test said 0.027), and Holm over the study's 60
    # comparisons, none of which can go below 2 / 2^5 on 5 seeds, takes every one to 1.
    for four in ([0.36, 0.5, 0.9, 0.945], [0.7, 0.7, 0.7, 0.604]):
        assert sign_flip_p([*four, fifth]) == 0.125
    assert holm([0.125] + [2 / 2**5] * 59) == [1.0] * 60


def result(method: str, seed: int, em: float, collapsed: bool = False) -> dict:
    return {"method": method, "lr": 1e-3, "beta": 0.1, "seed": seed, "final": {"em": em, "em_birth_country": em / 2},
            "auc": em, "final_train_reward": em, "collapsed": collapsed,
            "kl_gradient": {"variance_k3": 10.0, "variance_topk": 0.1, "variance_median_k3": 1.0, "variance_median_topk": 0.1}}


def test_summary_groups_cells_and_pairs_by_seed():
    results = [result("GRPO", s, 0.5) for s in range(3)] + [result("EMA-PG", s, 0.6 + 0.01 * s) for s in range(3)]
    results.append(result("GRPO", 3, 0.0, collapsed=True))
    summary = summarise(results, ["GRPO", "EMA-k3", "EMA-PG"])
    cells = {c["method"]: c for c in summary["cells"]}
    assert cells["GRPO"]["n"] == 4 and cells["GRPO"]["collapsed"][0] == 1
    assert cells["EMA-PG"]["variance_ratio"][0] == pytest.approx(100.0)
    assert cells["EMA-PG"]["median_variance_ratio"][0] == pytest.approx(10.0)
    em = next(c for c in summary["comparisons"] if c["metric"] == "em")
    assert (em["a"], em["b"], em["n"], em["wins"]) == ("EMA-PG", "GRPO", 3, 3)  # seed 3 has no pair
    # Holm over every comparison reported (4 metrics here): 2 / 2^3 x 4 = 1 at most.
    assert [c["holm_p"] for c in summary["comparisons"]] == holm([c["p"] for c in summary["comparisons"]])
    assert em["p"] == 0.25 and em["holm_p"] == 1.0


def test_grid_is_two_slices_seed_major():
    sweep = SweepSection(methods=["GRPO", "EMA-PG"], lrs=[1e-4, 1e-3], betas=[0.01, 0.1], lr_at=1e-3, beta_at=0.1,
                         seeds=[0, 1])
    cells = grid(sweep)
    points = {(c.lr, c.beta) for c in cells}
    assert points == {(1e-4, 0.1), (1e-3, 0.1), (1e-3, 0.01)}  # (1e-3, 0.1) shared by both slices, once
    assert len(cells) == 3 * 2 * 2 and [c.seed for c in cells[:6]] == [0] * 6
    assert all(Cell.parse(c.name) == c for c in cells)


def test_a_method_with_its_own_beta_runs_once_per_learning_rate_at_that_beta():
    sweep = SweepSection(methods=["GRPO-k3c", "GRPO-floor"], lrs=[1e-3, 3e-3], betas=[0.1, 1.0], lr_at=1e-3,
                         beta_at=0.1, seeds=[7])
    floor = [c for c in grid(sweep) if c.method == "GRPO-floor"]
    assert [(c.lr, c.beta) for c in floor] == [(1e-3, 0.001), (3e-3, 0.001)]
    cfg = load_config(overrides=train_overrides(study_config("study"), floor[0]))
    assert cfg.kl.beta == 0.001 and cfg.kl.estimator == "k3_clamped" and cfg.train.grad_probe_every == 1
    with pytest.raises(ValueError, match="GRPO-floor runs at beta 0.001"):
        train_overrides(study_config("study"), Cell("GRPO-floor", 1e-3, 0.1, 7))


@pytest.mark.parametrize("method", ["GRPO", "EMA-k3", "EMA-PG", "GRPO-k3c", "EMA-k3c"])
def test_cell_overrides_make_a_valid_train_config_that_differs_only_by_method(method):
    study = study_config("study")
    cell = Cell(method, 3e-3, 0.5, 2)
    cfg = load_config(overrides=train_overrides(study, cell))
    assert (cfg.train.lr, cfg.kl.beta, cfg.seed, cfg.rollout.backend) == (3e-3, 0.5, 2, "transformers")
    assert cfg.ema.tau == (1.0 if method.startswith("GRPO") else study.rl.ema_tau)
    assert cfg.kl.estimator == {"EMA-PG": "topk", "GRPO-k3c": "k3_clamped", "EMA-k3c": "k3_clamped"}.get(method, "k3")
    assert cfg.kl.importance_weight is not method.endswith("k3c")  # the authors' baseline weighs nothing
    assert cfg.train.iterations == study.rl.iterations == cfg.checkpoint.every


def test_bad_study_settings_are_refused():
    with pytest.raises(ValueError, match="preset"):
        study_config("huge")
    with pytest.raises(ValueError, match="methods"):
        study_config("toy", methods=["PPO"])
    with pytest.raises(ValueError, match="not a cell name"):
        Cell.parse("grpo-lr1")

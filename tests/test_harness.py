"""The eval harness: scoring of trajectories, confidence intervals, the report files, and `emapg eval` end to end."""

from __future__ import annotations

import json
import math

import pytest

from agent.trajectory import Trajectory, Turn
from eval.harness import score
from eval.report import EvalReport, wilson_interval


def traj(answer, golds, kinds, model_tokens=10, obs_tokens=5):
    t = Trajectory(uid="x#0", group_id="x", question="q?", golden_answers=golds, prompt_ids=[1])
    t.append(list(range(model_tokens)), model=True, logprobs=[-0.1] * model_tokens)
    t.append(list(range(obs_tokens)), model=False)
    t.turns = [Turn(kind=k, start=0, end=1, finish_reason="stop") for k in kinds]
    t.answer = answer
    return t


def test_score_counts_what_it_says():
    trajectories = [
        traj("Jane Austen", ["jane austen"], ["search", "answer"]),
        traj("It was Jane Austen", ["Jane Austen"], ["invalid", "answer"], model_tokens=30),
        traj(None, ["Paris"], ["invalid", "invalid", "final"]),
        traj("London", ["Paris"], ["answer"]),
    ]
    texts = ["Jane Austen", "It was Jane Austen", "I think Paris", "London"]
    r = score(trajectories, "nq", "agent", seconds=1.0, model_texts=texts)
    assert r.n == 4
    assert r.em == 0.25 and r.cover_em == 0.5
    assert r.f1 == pytest.approx((1 + 2 * (2 / 4) * 1 / (2 / 4 + 1) + 0 + 0) / 4)
    assert r.answered == 0.75
    assert r.text_cover_em == 0.75  # "I think Paris" knows the answer without the tags
    assert r.mean_searches == 0.25 and r.mean_turns == 2.0
    assert r.invalid_action_rate == 3 / 8
    assert r.mean_response_tokens == 15.0
    assert r.em_ci95 == wilson_interval(1, 4)
    assert r.repeated_search_rate == 0.0  # one search: nothing earlier to repeat
    trajectories[0].turns[:1] = [Turn("search", 0, 1, "stop", query=q, doc_ids=["7"]) for q in ("a", "b", "A")]
    again = score(trajectories, "nq", "agent", seconds=1.0, model_texts=texts)
    assert again.repeated_search_rate == 2 / 3  # "b" the same documents as "a", "A" the same query


def test_wilson_interval():
    lo, hi = wilson_interval(0, 100)
    assert lo == 0.0 and 0.03 < hi < 0.04  # zero successes still leaves an upper bound
    lo, hi = wilson_interval(50, 100)
    assert lo == pytest.approx(0.5 - 0.0963, abs=1e-3) and hi == pytest.approx(0.5 + 0.0963, abs=1e-3)
    assert wilson_interval(0, 0) == (0.0, 0.0)
    for k in range(0, 21):
        lo, hi = wilson_interval(k, 20)
        assert 0 <= lo <= k / 20 <= hi <= 1 and not math.isnan(lo)


def test_report_files(tmp_path):
    report = EvalReport(model="m", subset="s")
    report.results = [
        score([traj("a" if (d, m) != ("nq", "agent") else "b", ["a"], ["answer"])], d, m, 1.0, ["x"])
        for d in ("nq", "hotpotqa") for m in ("direct", "agent")
    ]
    report.finish()
    assert report.averages == {"direct": 1.0, "agent": 0.5}
    report.save(tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["averages"]["agent"] == 0.5
    md = (tmp_path / "report.md").read_text()
    assert "| nq | agent | 1 | 0.000 |" in md and "| agent | 0.500 |" in md and "gold in text" in md
    assert (tmp_path / "em.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_emapg_eval_end_to_end_with_a_tiny_model(tmp_path, server_url, tiny_model_dir, monkeypatch):
    """The CLI against the real server: FlashRAG files on disk, full subset, two modes, a report (the transformers
    engine: vLLM's CPU attention refuses the tiny model's head size; test_vllm_backend.py runs the CLI on vLLM)."""
    from typer.testing import CliRunner

    from emapg.cli import app

    root = tmp_path / "flashrag"
    for name, rows in {"bamboogle": [("Who wrote Pride and Prejudice?", ["Jane Austen"])] * 2,
                       "hotpotqa": [("Which planet is largest?", ["Jupiter"])]}.items():
        (root / name).mkdir(parents=True)
        (root / name / "test.jsonl").write_text(
            "".join(json.dumps({"id": str(i), "question": q, "golden_answers": a}) + "\n" for i, (q, a) in enumerate(rows))
        )
    out = tmp_path / "report"
    result = CliRunner().invoke(app, [
        "eval", "--model", str(tiny_model_dir), "--datasets", "bamboogle,hotpotqa", "--flashrag-root", str(root),
        "--split", "test", "--subset", "full", "--modes", "direct,agent", "--retriever-url", server_url,
        "--max-turns", "1", "--max-tokens-per-turn", "8", "--backend", "transformers", "--out", str(out),
        "--wandb-mode", "offline", "--wandb-project", "emapg-test",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [(r["dataset"], r["mode"], r["n"]) for r in report["results"]] == [
        ("bamboogle", "direct", 2), ("hotpotqa", "direct", 1), ("bamboogle", "agent", 2), ("hotpotqa", "agent", 1)]
    lines = (out / "trajectories" / "bamboogle.agent.jsonl").read_text().splitlines()
    assert [json.loads(line)["group_id"] for line in lines] == ["bamboogle/test/0", "bamboogle/test/1"]
    assert (out / "em.png").exists() and "| bamboogle | agent | 2 |" in result.output

    from test_wandb import item_key, records_of  # W&B offline: the report, its chart and EM, read back from the run

    (artifact,) = records_of(out, "artifact")
    assert sorted(entry.path for entry in artifact.manifest.contents) == ["em.png", "report.json", "report.md"]
    (run,) = records_of(out, "run")
    assert run.project == "emapg-test" and run.job_type == "eval"
    assert {item_key(item): json.loads(item.value_json) for item in run.config.update}["datasets"] == "bamboogle,hotpotqa"
    summary = {item_key(item): json.loads(item.value_json) for s in records_of(out, "summary") for item in s.update}
    assert summary["em/bamboogle/agent"] == report["results"][2]["em"]


def test_eval_cli_names_bad_options(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from emapg.cli import app

    monkeypatch.chdir(tmp_path)  # the default index (artifacts/indexes/...) is relative: it must not be built here

    result = CliRunner().invoke(app, ["eval", "--modes", "direct,oracle"])
    assert result.exit_code == 2 and "--modes: unknown mode 'oracle'" in " ".join(result.output.split())
    result = CliRunner().invoke(app, ["eval", "--wandb-mode", "cloud"])
    assert result.exit_code == 2 and "--wandb-mode: Input should be 'disabled', 'offline' or 'online'" in " ".join(
        result.output.split())
    result = CliRunner().invoke(app, ["eval", "--backend", "tpu"])  # refused by RolloutSettings, named by option
    assert result.exit_code == 2 and "--backend: Input should be 'transformers' or 'vllm'" in " ".join(
        result.output.split())
    result = CliRunner().invoke(app, ["eval", "--max-turns", "-1"])
    assert result.exit_code == 2 and "--max-turns: Input should be greater than or equal to 0" in " ".join(
        result.output.split())
    result = CliRunner().invoke(app, ["eval", "--topk", "0"])  # RetrieverConfig's check
    assert result.exit_code == 2 and "--topk: Input should be greater than or equal to 1" in " ".join(
        result.output.split())
    result = CliRunner().invoke(app, ["eval", "--datasets", "squad", "--flashrag-root", "/nonexistent"])
    assert result.exit_code == 2 and "unknown QA dataset 'squad'" in " ".join(result.output.split())
    assert not (tmp_path / "artifacts").exists()  # refused before any index was built (it took minutes)

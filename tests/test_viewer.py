"""`emapg view` in a real browser (headless Chromium) over a run folder our code made through the CLI: the SFT warm
start's demonstrations (real searches, the real retriever server's documents), a tiny Llama's training run and its
evaluation.

The page keeps its whole state in the URL's query, so each interaction (a filter, a selected trajectory, two
files side by side) is a URL that `chromium --dump-dom` loads and renders. No browser is a failure, not a skip:
`make test` installs Debian's chromium.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import urlencode

import httpx
import pytest

from agent.trajectory import Trajectory, Turn
from emapg.view import OutsideRuns, Filters, create_app, flags, metric_series, paired, paired_outcome, resolve_inside

QUESTIONS = [("Who wrote Pride and Prejudice?", ["Jane Austen"]), ("Which planet is largest?", ["Jupiter"])]


def run_cli(*args: str) -> None:
    from typer.testing import CliRunner

    from emapg.cli import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def run_folder(server_url, tiny_model_dir, tmp_path_factory) -> Path:
    """<out>/tiny: sft/ (demonstrations.jsonl, metrics.jsonl), 2 training iterations of the tiny random Llama
    (metrics.jsonl, trajectories/iter-*.jsonl, checkpoints holding the config) and its evaluation, eval-random."""
    tmp = tmp_path_factory.mktemp("viewer")
    flashrag = tmp / "flashrag"
    (flashrag / "bamboogle").mkdir(parents=True)
    (flashrag / "bamboogle" / "test.jsonl").write_text("".join(
        json.dumps({"id": str(i), "question": q, "golden_answers": a}) + "\n" for i, (q, a) in enumerate(QUESTIONS)))
    run = [f"model={tiny_model_dir}", f"out_dir={tmp / 'runs'}", "name=tiny", f"retriever.url={server_url}",
           "rollout.backend=transformers", "data.train=[bamboogle:test]", f"data.flashrag_root={flashrag}",
           "data.subset=full", "rollout.max_turns=2", "rollout.max_tokens_per_turn=8", "rollout.max_obs_tokens=64"]
    run_cli("sft", *run, "sft.eval_questions=0", "sft.examples=2", "sft.batch_size=2", "sft.micro_batch_size=2", "sft.warmup_steps=0")
    train = ("train.iterations=2", "train.prompts_per_iteration=2", "train.rollouts_per_prompt=2",
             "train.mini_batch_size=4", "train.micro_batch_size=4", "train.warmup_steps=0", "kl.topk=4",
             "checkpoint.every=1")
    run_cli("train", *run, *train)
    # The same run rewarded by F1 with a format bonus (its own folder, beside the EM run): what the viewer rescores.
    run_cli("train", *(a.replace("name=tiny", "name=tiny-f1") for a in run), *train, "reward.name=f1",
            "reward.format=0.1")
    folder = tmp / "runs" / "tiny"
    run_cli("eval", "--model", str(tiny_model_dir), "--datasets", "bamboogle", "--flashrag-root", str(flashrag),
            "--subset", "full", "--modes", "agent", "--retriever-url", server_url, "--max-turns", "2",
            "--max-tokens-per-turn", "8", "--max-obs-tokens", "64", "--backend", "transformers",
            "--out", str(folder / "eval-random"))
    return folder


@pytest.fixture(scope="module")
def viewer_url(run_folder):
    import uvicorn

    from retriever.process import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app([run_folder]), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def page(url: str, tmp_path: Path, **state: str) -> str:
    """The page's DOM after its scripts ran (virtual time lets its fetches finish), at `state` (query params)."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not installed (make test installs Debian's chromium)")
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    result = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--virtual-time-budget=15000", "--dump-dom", f"{url}/?{urlencode(state)}"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    assert 'data-ready="1"' in dom, dom[-3000:]  # the page drew its state without an error
    return dom


def rows(dom: str, kind: str = "row") -> int:
    return len(re.findall(rf'<tr class="{kind}( selected)?"', dom))


DEMOS = "0:sft/demonstrations.jsonl"
RANDOM = "0:eval-random/trajectories/bamboogle.agent.jsonl"
FIRST_DEMO = "bamboogle/test/0#demo"  # Pride and Prejudice: its documents hold the gold answer


def test_plots_and_a_trajectory_with_its_query_documents_and_answer(viewer_url, run_folder, tmp_path):
    dom = page(viewer_url, tmp_path, src=DEMOS, uid=FIRST_DEMO)
    preferred = metric_series(run_folder / "metrics.jsonl")["preferred"]  # reward, EM, KL, entropy, searches
    assert len(preferred) == 5
    for series in preferred:  # the training curves, drawn
        assert re.search(rf'<svg class="plot"[^>]*data-series="{series}"[^>]*>.*?<polyline points="[\d., -]+"',
                         dom, re.S), series
    detail = dom[dom.index('id="detail"'):]
    demo = json.loads((run_folder / "sft" / "demonstrations.jsonl").read_text().splitlines()[0])
    assert demo["uid"] == FIRST_DEMO
    assert f'<div class="query">search: {demo["turns"][0]["query"]}</div>' in detail
    masked = re.search(r'<pre class="observation masked">(.*?)</pre>', detail, re.S).group(1)
    assert "&lt;information&gt;Doc 1(Title: " in masked and "Jane Austen" in masked  # the documents, marked masked
    assert re.search(r'class="answer right">Jane Austen<', detail)
    assert '<span class="gold">Jane Austen</span>' in detail


def test_a_filter_narrows_the_list(viewer_url, tmp_path):
    everything = page(viewer_url, tmp_path, src=DEMOS)
    none = page(viewer_url, tmp_path, src=DEMOS, searches="0")  # every demonstration searches
    total = rows(everything)
    assert total >= 1 and rows(none) == 0 and f"0 of {total} trajectories" in none


def test_training_rollouts_show_reward_and_advantage(viewer_url, run_folder, tmp_path):
    rollout = json.loads((run_folder / "trajectories" / "iter-000001.jsonl").read_text().splitlines()[0])
    dom = page(viewer_url, tmp_path, src="0:trajectories/iter-000001.jsonl", uid=rollout["uid"])
    assert rows(dom) == 4  # 2 prompts x 2 rollouts
    meta = re.search(r"EM (\S+)\s+reward (\S+)\s+advantage (\S+)\s", dom)
    assert meta and meta.group(3) != "–", dom[dom.index('id="detail"'):][:2000]  # from the run's checkpointed config


@pytest.mark.parametrize("name", ["tiny", "tiny-f1"])
def test_a_fresh_view_process_scores_a_training_rollout_as_the_trainer_did(run_folder, name, tmp_path):
    """`emapg view` in its own process (which never imported the trainer's algorithms: the bug of issue 44 answered
    500 there) opens each rollout of iteration 1 of an EM run and of an F1 run with a format bonus; their rewards
    average to the trainer's own logged rollout/reward of that iteration, every advantage is given, and headless
    Chromium shows a rollout with its reward and advantage."""
    import os
    import sys

    from retriever.process import free_port

    folder = run_folder.parent / name
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "emapg.cli", "view", str(folder), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/api/runs", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and process.poll() is None, process.stdout.read().decode()[-2000:]
                time.sleep(0.2)
        source = "0:trajectories/iter-000001.jsonl"
        uids = [json.loads(line)["uid"] for line in (folder / "trajectories" / "iter-000001.jsonl").read_text().splitlines()]
        shown = []
        for uid in uids:
            response = httpx.get(f"{url}/api/trajectory", params={"source": source, "uid": uid}, timeout=30)
            assert response.status_code == 200, response.text
            shown.append(response.json())
        dom = page(url, tmp_path, src=source, uid=uids[0])
        meta = re.search(r"EM (\S+)\s+reward (\S+)\s+advantage (\S+)\s", dom)
        assert meta and float(meta.group(2)) == pytest.approx(shown[0]["reward"], abs=1e-3), dom[-2000:]
        assert meta.group(3) != "–"
    finally:
        process.terminate()
        process.wait(10)
    logged = json.loads((folder / "metrics.jsonl").read_text().splitlines()[0])
    assert logged["iteration"] == 1
    assert sum(d["reward"] for d in shown) / len(shown) == pytest.approx(logged["rollout/reward"])
    assert all(d["advantage"] is not None for d in shown)


def test_the_viewer_rescores_with_the_runs_reward_name():
    """On constructed trajectories (partly right answers): an F1 run's rewards are F1 (+ the format bonus), an EM
    run's are EM, and GRPO's advantages follow each."""
    from emapg.view import scores
    from trainer.config import load_config

    def answered(answer: str, uid: str) -> Trajectory:
        return Trajectory(uid=uid, group_id="g", question="q", golden_answers=["Jane Austen"], prompt_ids=[1],
                          response_ids=[2], loss_mask=[1], turns=[Turn("answer", 0, 1, "stop")], answer=answer,
                          done=True)

    trajs = [answered("Austen", "g#0"), answered("Jane Austen", "g#1")]
    assert all(t.well_formed for t in trajs)
    f1 = load_config(overrides=["reward.name=f1", "reward.format=0.1"]).model_dump(mode="json")
    em = load_config(overrides=[]).model_dump(mode="json")
    f1_rewards, f1_advantages = scores(trajs, f1, training=True)
    assert f1_rewards == pytest.approx([2 / 3 + 0.1, 1.0 + 0.1])
    em_rewards, em_advantages = scores(trajs, em, training=True)
    assert em_rewards == [0.0, 1.0] and em_advantages[1] > 0 > em_advantages[0]
    assert f1_advantages[1] > 0 > f1_advantages[0]


def test_side_by_side_shows_the_paired_outcome(viewer_url, tmp_path):
    """The demonstrations (right by construction) against the random model (wrong) on the same questions."""
    dom = page(viewer_url, tmp_path, a=DEMOS, b=RANDOM, q=FIRST_DEMO)
    pairs = rows(dom, "pair")
    assert pairs >= 1
    assert f'<span data-outcome="only_a">only A {pairs}</span>' in dom
    side = dom[dom.index('id="side"'):]
    assert 'class="flag paired-outcome only_a"' in side
    assert side.count('class="traj"') == 2 and 'class="answer right">Jane Austen<' in side


def test_paths_outside_the_run_folders_are_refused(viewer_url, run_folder, tmp_path):
    outside = tmp_path / "secret.jsonl"
    outside.write_text((run_folder / "sft" / "demonstrations.jsonl").read_text())
    link = run_folder / "link.jsonl"  # a link inside the run folder that points out of it
    link.symlink_to(outside)
    try:
        for source in ("0:../../../etc/passwd", f"0:{outside}", "0:link.jsonl", "1:metrics.jsonl", "x:metrics.jsonl"):
            assert httpx.get(f"{viewer_url}/api/trajectories", params={"source": source}).status_code == 404, source
        assert httpx.get(f"{viewer_url}/api/metrics", params={"source": "0:../../../etc/passwd"}).status_code == 404
        assert httpx.get(f"{viewer_url}/static/../view.py").status_code == 404
        assert httpx.get(f"{viewer_url}/static/%2e%2e/view.py").status_code == 404
        assert httpx.get(f"{viewer_url}/api/trajectories", params={"source": DEMOS}).status_code == 200
    finally:
        link.unlink()


def test_view_binds_the_loopback_address_by_default():
    import inspect

    from emapg.cli_outputs import view
    from emapg.view import serve

    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(view).parameters["host"].default == "127.0.0.1"


# ---- the pure parts, on hand-made trajectories ----

def trajectory(answer, queries, finish="stop", invalid=False) -> Trajectory:
    t = Trajectory(uid="q#0", group_id="q", question="q?", golden_answers=["Paris"], prompt_ids=[1])
    t.turns = [Turn("search", 0, 1, finish, query=q) for q in queries]
    t.turns += [Turn("invalid", 0, 1, "stop")] if invalid else []
    t.turns += [Turn("answer", 0, 1, "stop")]
    t.answer = answer
    return t


def test_flags_and_filters():
    f = flags(trajectory("paris", ["capital of France", "Capital  of france"]))
    assert f == {"wrong": False, "invalid": False, "searches": 2, "repeated": True, "truncated": False}
    f = flags(trajectory("Lyon", ["a", "b"], finish="length", invalid=True))
    assert f == {"wrong": True, "invalid": True, "searches": 2, "repeated": False, "truncated": True}
    assert Filters(wrong=True, searches=2).keep(f) and not Filters(repeated=True).keep(f)
    assert not Filters(searches=1).keep(f) and Filters().keep(f)


def test_paired_outcomes_count_each_question_once():
    assert [paired_outcome(a, b) for a, b in [(1, 1), (1, 0), (0, 1), (0, 0)]] == ["both", "only_a", "only_b",
                                                                                 "neither"]
    a = [trajectory("Paris", []), trajectory("Lyon", [])]
    a[1].uid, a[1].question = "r#0", "r?"
    b = [trajectory("Lyon", []), trajectory("Paris", [])]
    b[1].uid, b[1].question = "r#0", "r?"
    result = paired(a, b)
    assert result["counts"] == {"both": 0, "only_a": 1, "only_b": 1, "neither": 0}
    assert result["n"] == 2 and paired(a, b, "only_a")["matched"] == 1


def test_metric_series_match_preferred_keys_by_suffix(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in [
        {"iteration": 1, "rollout/reward": 0.5, "rollout/em": 0.25, "kl/anchor": 0.01, "note": "x",
         "loss/entropy": 1.0, "kl/anchor_distance": 0.3, "reward_smoothed": 0.5},
        {"iteration": 2, "rollout/reward": float("nan"), "rollout/em": 0.5, "kl/anchor": 0.02, "loss/entropy": 0.9},
    ]))
    data = metric_series(path)
    assert data["iteration"] == [1, 2]
    assert data["preferred"] == ["rollout/reward", "rollout/em", "kl/anchor", "loss/entropy"]
    assert metric_series_keys_of({"reward": 1, "em": 0, "kl": 0.1, "entropy": 2, "searches": 1}, tmp_path) == [
        "reward", "em", "kl", "entropy", "searches"]  # the flat names of older runs
    assert data["series"]["rollout/reward"] == [0.5, None] and "note" not in data["series"]


def test_a_resumed_runs_plot_is_its_history_not_every_attempt(tmp_path):
    """Killed after iteration 3, resumed from the checkpoint at 1: the plot runs 1, 2, 3 once, the resumed values."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps({"iteration": i, "rollout/reward": r})
                              for i, r in [(1, 0.1), (2, 0.2), (3, 0.3), (2, 0.25), (3, 0.35)]))
    data = metric_series(path)
    assert data["iteration"] == [1, 2, 3] and data["series"]["rollout/reward"] == [0.1, 0.25, 0.35]


def metric_series_keys_of(row: dict, tmp_path: Path) -> list[str]:
    path = tmp_path / "flat.jsonl"
    path.write_text(json.dumps({"iteration": 1, **row}))
    return metric_series(path)["preferred"]


def test_resolve_inside_refuses_what_is_not_a_file_of_a_run(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    (tmp_path / "other.jsonl").write_text("")
    roots = [(tmp_path / "run").resolve()]
    assert resolve_inside(roots, "0:metrics.jsonl") == roots[0] / "metrics.jsonl"
    for bad in ("0:../other.jsonl", "0:", "0:missing.jsonl", "1:metrics.jsonl", "metrics.jsonl"):
        with pytest.raises(OutsideRuns):
            resolve_inside(roots, bad)

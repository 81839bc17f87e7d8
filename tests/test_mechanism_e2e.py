"""The mechanism study end to end at a toy size: the one command generates the KB, indexes it, serves it with the real
retrieval server, runs a few SFT steps and one RL iteration of the real trainer through that server, writes a cell's
result, analyses it; run again, it skips the finished cell; with another setup in the same folder, it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from data.corpus import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def study(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "experiments.mechanism.run", "--out", str(out), "--preset", "toy", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # a hang guard only


def servers_on(index: Path) -> list[int]:
    """Processes still serving `index` (the run must stop the server it started)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"serve" in cmdline and str(index).encode() in cmdline:
            pids.append(int(proc.name))
    return pids


def test_the_study_runs_resumes_and_refuses_another_setup(tmp_path):
    out = tmp_path / "mechanism"
    first = study(out)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "1 cells, 0 done, 1 to run" in first.stdout

    passages = list(read_jsonl(out / "kb" / "corpus.jsonl"))  # Search-R1 JSONL, parsed by the project's reader
    assert passages and all(p.contents.startswith('"') for p in passages)
    assert (out / "index" / "manifest.json").exists()
    assert json.loads((out / "policy" / "sft" / "demonstrations.json").read_text())["questions"] > 0
    assert list((out / "policy" / "sft" / "checkpoints").iterdir())
    assert 0 <= json.loads((out / "sft_eval.json").read_text())["em"] <= 1

    result_path = out / "cells" / "GRPO_lr0.001_beta0.1_seed0" / "result.json"
    result = json.loads(result_path.read_text())
    assert (result["method"], result["iterations"], result["error"]) == ("GRPO", 1, None)
    assert len(result["curve"]["reward"]) == 1 and 0 <= result["auc"] <= 1
    assert set(result["final"]) >= {"em", "searches", "n", "answered", "predictions"}
    answers = result["final"]["predictions"]  # every held-out question's answer: the EM recomputes from them
    assert len(answers) == result["final"]["n"] and result["final"]["em"] == sum(a["em"] for a in answers) / len(answers)
    from experiments.mechanism.study_c import recompute_em  # scored again against the block's test questions
    assert recompute_em(out, {("GRPO", 1e-3): {0: {**result, "block": out.name}}}) == 1
    assert result["grad"]["grad/pg_norm"][0] >= 0 and result["grad"]["grad/zero_advantage_groups"][0] >= 0
    diagnostic = result["kl_gradient"]
    assert diagnostic["states"] > 0 and diagnostic["variance_k3"] >= 0 and diagnostic["variance_topk"] >= 0
    assert not (result_path.parent / "checkpoints").exists()  # measured, then deleted
    assert (out / "summary.md").read_text().count("| GRPO |") == 1
    assert (out / "curves.png").exists() and (out / "final.png").exists()
    assert servers_on(out / "index") == []

    before = result_path.stat().st_mtime_ns
    again = study(out)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "1 cells, 1 done, 0 to run" in again.stdout
    assert result_path.stat().st_mtime_ns == before

    other = study(out, "--preset", "study")  # the last --preset wins: the full-size setup
    assert other.returncode != 0 and "another setup" in other.stdout + other.stderr
    assert servers_on(out / "index") == []

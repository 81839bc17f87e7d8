"""benchmarks/vs_trl.py's pieces that decide its numbers, without TRL: the reward TRL's side scores with is ours, and
importable with the standard library alone (TRL's environment has none of our dependencies); the phases are set
against the bounds the docstring names."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from agent.protocol import extract_answer
from eval.metrics import exact_match

ROOT = Path(__file__).resolve().parents[1]
# The script loaded by path: putting benchmarks/ on sys.path would let its file names shadow modules for other tests.
_spec = importlib.util.spec_from_file_location("vs_trl", ROOT / "benchmarks" / "vs_trl.py")
vs_trl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs_trl)


def test_the_reward_imports_with_the_standard_library_alone():
    code = ("import sys; sys.modules.update(dict.fromkeys(['httpx', 'torch', 'numpy', 'pydantic', 'transformers']));"
            "from agent.protocol import extract_answer; from eval.metrics import exact_match")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr  # None in sys.modules makes any import of those packages fail


def test_trl_sides_reward_is_our_exact_match_of_the_last_answer():
    completions = ["<answer> Paris </answer>", "<think>x</think><answer>the Paris.</answer>", "Paris",
                   "<answer> Lyon </answer> then <answer> paris </answer>", "<answer>Paris", "<answer></answer>",
                   "<answer> Rome </answer><answer> Paris</answer> <answer> Rome </answer>"]
    golden = [["Paris"]] * len(completions)
    ours = [exact_match(extract_answer([text]), gold) for text, gold in zip(completions, golden, strict=True)]
    assert vs_trl.exact_match_reward(completions, golden) == ours
    assert ours == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # the check can fail: both kinds of answer are here


def test_phase_bounds_read_the_timed_iterations_against_the_machine():
    machine = {"weight_bytes": 400_000_000, "read_gb_s": 20.0, "copy_s": 0.05, "matmul_fp32_gflop_s": 200.0}
    first = {"prepare_s": 9.0, "update_s": 9.0, "weight_sync_s": 9.0, "rollout_s": 9.0, "ema_s": 0.0}
    timed = {"prepare_s": 1.0, "update_s": 3.0, "weight_sync_s": 0.5, "rollout_s": 4.0, "ema_s": 0.0}
    run = {"phases_s": [first, timed, timed], "completion_tokens": [99.0, 50.0, 50.0], "parameters": 100_000_000,
           "mean_prompt_tokens": 50.0}
    bounds = vs_trl.phase_bounds([run], machine, prompts_per_step=2, rollouts=4)
    forward = 2 * 100_000_000 * 8 * (50 + 50) / 200e9  # 0.8 s
    assert bounds["prepare_s"] == {"measured_s": 1.0, "bound_s": pytest.approx(forward, abs=0.005),
                                   "over_bound": round(1.0 / forward, 1)}
    assert bounds["update_s"]["bound_s"] == pytest.approx(3 * forward, abs=0.005)
    assert bounds["rollout_s"]["bound_s"] == pytest.approx(50 * 0.4 / 20, abs=0.005)  # 50 reads of 0.4 GB
    assert bounds["weight_sync_s"] == {"measured_s": 0.5, "bound_s": 0.05, "over_bound": 10.0}

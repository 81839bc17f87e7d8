"""The GPU check's pieces on CPU: benchmarks/train_step.py (the learner's bf16 step on a random Qwen2 model) runs
without and with activation checkpointing and prints its JSON line; benchmarks/gpu_check.sh refuses to pass without
CUDA, and so does benchmarks/gpu_train_check.sh (the short real run)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_train_step_benchmark_runs_on_cpu_with_and_without_checkpointing_and_prints_one_json_line():
    tiny = ["--device", "cpu", "--vocab", "4096", "--hidden", "64", "--heads", "4", "--layers", "2",
            "--trajectories", "4", "--micro", "2", "--prompt-tokens", "16", "--turns", "2", "--turn-tokens", "16",
            "--obs-tokens", "16", "--steps", "1", "--gradient-checkpointing", "both"]
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step.py"), *tiny], cwd=ROOT,
                         capture_output=True, text=True, timeout=1800, check=False)  # a hang guard
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1
    both = json.loads(lines[0])
    assert both["benchmark"] == "train_step_gradient_checkpointing" and both["loss_equal"] is True
    for checkpointing, result in ((False, both["off"]), (True, both["on"])):
        assert (result["benchmark"], result["device"], result["autocast"]) == ("train_step", "cpu", "bfloat16")
        assert result["gradient_checkpointing"] is checkpointing
        assert result["model"]["vocab"] == 4096
        assert result["optimizer_steps"] == 1  # one mini-batch: the whole batch
        assert 0 < result["model_tokens"] < result["tokens"]  # observations and prompts are masked out
        assert result["step_s"] > 0 and result["tokens_per_s"] > 0 and result["peak_memory_gb"] > 0
        assert all(math.isfinite(result[k]) for k in ("loss", "kl", "grad_norm"))
    assert both["update_s_on_over_off"] > 0 and both["peak_memory_on_over_off"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_train_check.sh"])
def test_gpu_checks_fail_without_cuda(script, tmp_path):
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / script), str(tmp_path / "run")], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable}, check=False)
    assert out.returncode != 0
    assert json.loads(out.stdout.strip().splitlines()[0])["error"] == "torch sees no CUDA device"
    assert not (tmp_path / "run").exists()  # refused before any work


def test_train_step_compares_row_and_token_budget_micro_batches_with_the_same_loss():
    tiny = ["--device", "cpu", "--vocab", "4096", "--hidden", "64", "--heads", "4", "--layers", "2",
            "--trajectories", "6", "--micro", "1", "--prompt-tokens", "16", "--turns", "3", "--turn-tokens", "24",
            "--obs-tokens", "16", "--steps", "1", "--autocast", "none", "--micro-batch-tokens", "both",
            "--token-budget", "256"]
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_step.py"), *tiny], cwd=ROOT,
                         capture_output=True, text=True, timeout=1800, check=False)  # a hang guard
    assert out.returncode == 0, out.stderr
    both = json.loads(out.stdout.strip())
    rows, tokens = both["rows"], both["tokens"]
    assert both["benchmark"] == "train_step_token_budget"
    assert (rows["micro_batch_tokens"], tokens["micro_batch_tokens"]) == (0, 256)
    assert rows["tokens"] == tokens["tokens"] and rows["model_tokens"] == tokens["model_tokens"]
    assert abs(rows["loss"] - tokens["loss"]) <= 1e-5  # the same objective, cut differently
    assert rows["model_tflops_per_s"] > 0 and tokens["model_tflops_per_s"] > 0
    assert both["tokens_per_s_tokens_over_rows"] > 0

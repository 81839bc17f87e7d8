"""Faults during a real run (issue 34): a checkpoint write killed (SIGTERM, SIGKILL) or refused (a full disk), the
retriever killed and restarted mid-iteration, the vLLM engine process killed. Each test measures what the fault costs
(seconds to recover, searches failed or retried) and prints it; docs/benchmarks.md records the numbers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from test_training import make_trainer, tiny_config

from trainer.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.loop import resume_or_start

TESTS = Path(__file__).resolve().parent
ITERATIONS = 4


def same_runs(want_history, want_policy, got_history, got_policy) -> None:
    """The metrics and final policy weights of two runs of the same iterations, bit for bit."""
    assert len(want_history) == len(got_history)
    for want, got in zip(want_history, got_history, strict=True):
        for key in ("rollout/reward", "loss/policy", "kl/anchor", "loss/grad_norm", "kl/anchor_distance"):
            assert got[key] == want[key], key
    for (name, a), b in zip(want_policy.state_dict().items(), got_policy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, tiny_model, tokenizer):
    """The tiny transformers-backend run of test_training, uninterrupted: its metrics and final policy."""
    trainer = make_trainer(tiny_config(tmp_path_factory.mktemp("straight"), f"train.iterations={ITERATIONS}"),
                           tiny_model, tokenizer)
    return trainer.run(), trainer.engine.learning.policy


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_run_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(
        sig, tmp_path, tiny_model_dir, tiny_model, tokenizer, straight_run):
    """The run in a child process, killed as soon as iteration 3's checkpoint folder appears (mid-write: ~25 MB of
    weights and optimizer state still to write, hash and flush). The half-written folder stays hidden, iteration 2's
    checkpoint loads, and the resumed run equals the uninterrupted one."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from pathlib import Path
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from test_training import make_trainer, tiny_config
        model = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r}).eval()
        tok = AutoTokenizer.from_pretrained({str(tiny_model_dir)!r})
        make_trainer(tiny_config(Path({str(tmp_path)!r}), "train.iterations={ITERATIONS}"), model, tok).run()
    """)
    checkpoints = tmp_path / "run" / "checkpoints"
    writing = checkpoints / ".iter-000003.tmp"
    child = subprocess.Popen([sys.executable, "-c", script], cwd=TESTS.parent, stderr=subprocess.PIPE, text=True)
    try:
        while not writing.exists() and child.poll() is None:
            time.sleep(0.001)
        child.send_signal(sig)
    finally:
        _, stderr = child.communicate(timeout=300)
    assert child.returncode == -sig, stderr[-2000:]
    assert not (checkpoints / "iter-000003").exists()  # killed mid-write: no iteration 3 under a checkpoint's name
    assert latest_checkpoint(tmp_path / "run").name == "iter-000002"

    start = time.perf_counter()
    resumed = make_trainer(tiny_config(tmp_path, f"train.iterations={ITERATIONS}"), tiny_model, tokenizer)
    resume_or_start(resumed, resume=True, init=None)
    assert resumed.iteration == 2
    tail = resumed.run()
    print(f"\nFAULT checkpoint-write-{sig.name}: resumed from iteration 2, 1 iteration redone, "
          f"{time.perf_counter() - start:.1f} s to resume and finish")
    assert not writing.exists()  # the next save cleared what the killed one left
    history, policy = straight_run
    same_runs(history[2:], policy, tail, resumed.engine.learning.policy)


def small_checkpoint(iteration: int, floats: int):
    from test_config_checkpoint import make_ckpt

    ckpt = make_ckpt(iteration)
    ckpt.policy["padding"] = torch.zeros(floats)
    return ckpt


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs (root only; elsewhere the test is skipped): a disk that really fills up (ENOSPC)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True,
                             text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_checkpoint_that_does_not_fit_on_the_disk_is_refused_cleanly(tiny_disk):
    save_checkpoint(small_checkpoint(1, 1_000), tiny_disk)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*iter-000002: .*No space left on device"):
        save_checkpoint(small_checkpoint(2, 100_000), tiny_disk)  # 400 KB of weights on a 256 KiB disk
    assert sorted(p.name for p in (tiny_disk / "checkpoints").iterdir()) == ["iter-000001"]  # nothing half-written
    assert load_checkpoint(latest_checkpoint(tiny_disk)).iteration == 1
    save_checkpoint(small_checkpoint(2, 1_000), tiny_disk)  # the disk's room came back with the failed save's removal
    assert latest_checkpoint(tiny_disk).name == "iter-000002"

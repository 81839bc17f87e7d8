"""The study's policy: a small random Llama over SmolLM2's tokenizer, and its greedy evaluation on KB questions."""

from __future__ import annotations

from collections import defaultdict

import torch

from agent.backend import SamplingParams
from agent.hf_backend import TransformersBackend
from agent.rollout import RolloutConfig, SearchAgent
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


def rollout_engine(policy, tokenizer, max_batch_size: int) -> TransformersBackend:
    return TransformersBackend(policy, tokenizer, max_batch_size=max_batch_size)


def greedy_eval(policy, tokenizer, retriever, questions: list[KBQuestion], rollout: RolloutConfig,
                batch_size: int = 64) -> dict[str, float]:
    """EM of greedy rollouts through the server: overall, per question kind, and the mean number of searches."""
    agent = SearchAgent(rollout_engine(policy, tokenizer, batch_size), tokenizer, retriever, rollout)
    trajectories = agent.rollout([q.example for q in questions],
                                 SamplingParams(temperature=0.0, max_tokens=rollout.max_tokens_per_turn))
    by_kind: dict[str, list[float]] = defaultdict(list)
    for q, traj in zip(questions, trajectories, strict=True):
        by_kind[q.kind].append(reward(traj).em)
    ems = [em for values in by_kind.values() for em in values]
    out = {"em": sum(ems) / len(ems), "searches": sum(t.num_searches for t in trajectories) / len(trajectories),
           "n": float(len(ems))}
    out |= {f"em_{kind}": sum(values) / len(values) for kind, values in sorted(by_kind.items())}
    return out

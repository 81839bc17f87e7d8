"""Where rollout engines and agents are made, from `RolloutSettings` alone (the trainer, the evaluation and the
experiments ask here; nothing else constructs them).

    open_backend(settings, model, tokenizer, policy)   the engine: vLLM (its own copy of the weights, synced in
                                                        place) or transformers (samples from `policy` itself)
    make_agent(backend, tokenizer, retriever, settings) the scheduler: continuous on an engine with an event loop of
                                                        its own (vLLM), the per-turn loop on any other

Whoever opens a backend closes it (`backend.close()`); one backend serves a whole process, training and evaluation.
"""

from __future__ import annotations

from functools import partial

from agent.backend import RolloutBackend
from agent.continuous import AsyncEngine, ContinuousSearchAgent
from agent.rollout import RolloutAgent, SearchAgent
from agent.settings import RolloutSettings
from retriever.client import AsyncRetrieverClient, RetrieverClient


def open_backend(settings: RolloutSettings, model: str, tokenizer, policy=None, *, dtype: str = "float32",
                 seed: int = 0) -> RolloutBackend:
    """The configured rollout engine. transformers samples from `policy` (required); vLLM starts from `model` on disk
    in `settings.dtype or dtype` and holds its own copy of the weights, synced before it samples (`load_weights`)."""
    if settings.backend == "transformers":
        if policy is None:
            raise ValueError("rollout.backend=transformers samples from a policy in memory: pass one")
        from agent.hf_backend import TransformersBackend

        return TransformersBackend(policy, tokenizer, max_batch_size=settings.max_in_flight)
    from agent.policy import resolve_policy
    from agent.vllm_backend import VLLMBackend

    return VLLMBackend(resolve_policy(model), dtype=settings.dtype or dtype, seed=seed,
                       gpu_memory_utilization=settings.gpu_memory_utilization, kv_cache_gib=settings.kv_cache_gib,
                       max_model_len=settings.max_model_len,
                       enforce_eager=None if settings.compile is None else not settings.compile)


def make_agent(backend: RolloutBackend, tokenizer, retriever: RetrieverClient | None, settings: RolloutSettings, *,
               retriever_timeout_s: float = 30.0) -> RolloutAgent:
    """The rollouts of `settings.mode` over `backend`, searching with `retriever` (its top-k; None only in direct
    mode): at most `settings.max_in_flight` trajectories in flight on vLLM, one batched search per turn on the
    per-turn loop. The continuous scheduler opens an async client on the same URLs for each rollout."""
    if not isinstance(backend, AsyncEngine):
        return SearchAgent(backend, tokenizer, retriever, settings)
    open_retriever = None if retriever is None else partial(AsyncRetrieverClient, retriever.urls, topk=retriever.topk,
                                                            timeout_s=retriever_timeout_s)
    return ContinuousSearchAgent(backend, tokenizer, open_retriever, settings)

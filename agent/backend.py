"""The rollout backend interface: token ids in, sampled token ids and their log-probs out.

A backend never sees text it must re-tokenize: the rollout hands it the exact ids of the conversation so far
and appends exactly the ids it returns (token-in, token-out). The transformers backend (the reference, and the
fallback where vLLM is not installed) and the vLLM backend implement `generate`; vLLM's also continues one prompt
at a time on its event loop (`agenerate`), which the continuous rollout needs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "eos", "length"]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_tokens: int = 500
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_tokens < 1:
            raise ValueError(f"bad sampling parameters: {self}")


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]  # exactly the sampled ids, stop string and EOS token included
    logprobs: list[float]  # the sampler's log-prob of each id (under temperature / top-p), same length
    finish_reason: FinishReason
    stop: str | None = None  # the stop string that ended it, for finish_reason == "stop"


class RolloutBackend(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams, stop: list[str],
                 rows: list[int] | None = None) -> list[Generation]:
        """Continue every prompt until a stop string appears in its new text, EOS, or params.max_tokens. `rows`: the
        prompts' trajectory indices in their rollout (default 0..n-1), for engines that seed each row on its own
        (vLLM: then a row's samples do not depend on which rows share its call)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Sample from these weights (HF names) from now on."""
        ...

    def close(self) -> None:
        """Release the engine (its processes and memory)."""
        ...

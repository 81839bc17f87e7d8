"""A trajectory: the exact token ids of one multi-turn rollout, with its loss mask and the sampler's log-probs.

`response_ids` interleaves model turns (loss_mask 1) and observations / invalid-action messages (loss_mask 0).
`sampler_logprobs[i]` is the log-prob the sampler gave `response_ids[i]` (0.0 where loss_mask is 0).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

TurnKind = Literal["search", "answer", "invalid", "final"]
MASK_OPEN, MASK_CLOSE = "⟦", "⟧"  # marks masked (observation) spans in render()


@dataclass
class Turn:
    kind: TurnKind  # "final": the last turn, search disabled, that gave no answer
    start: int  # the model's tokens of this turn: response_ids[start:end]
    end: int
    finish_reason: str  # the backend's: stop, eos, length
    query: str | None = None
    doc_ids: list[str] = field(default_factory=list)
    retrieval_error: str | None = None
    observation_end: int | None = None  # masked tokens after the turn: response_ids[end:observation_end]


@dataclass
class Trajectory:
    uid: str  # f"{group_id}#{sample index}"
    group_id: str  # the example id, unique across datasets ("nq/test/7")
    question: str
    golden_answers: list[str]
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    answer: str | None = None
    done: bool = False

    def append(self, ids: list[int], *, model: bool, logprobs: list[float] | None = None) -> tuple[int, int]:
        """Append token ids; model tokens carry their sampler log-probs. Returns the span they occupy."""
        if model and (logprobs is None or len(logprobs) != len(ids)):
            raise ValueError("model tokens need one sampler log-prob each")
        start = len(self.response_ids)
        self.response_ids += ids
        self.loss_mask += [int(model)] * len(ids)
        self.sampler_logprobs += list(logprobs) if model else [0.0] * len(ids)
        return start, len(self.response_ids)

    @property
    def num_searches(self) -> int:
        return sum(t.kind == "search" for t in self.turns)

    @property
    def num_invalid(self) -> int:
        return sum(t.kind == "invalid" for t in self.turns)

    @property
    def well_formed(self) -> bool:
        """Ended in an <answer> with no invalid action on the way (the protocol followed throughout)."""
        return bool(self.turns) and self.turns[-1].kind == "answer" and self.num_invalid == 0

    @property
    def model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def observation_tokens(self) -> int:
        return len(self.loss_mask) - sum(self.loss_mask)

    def render(self, tokenizer) -> str:
        """The whole conversation as the model saw it, masked spans between ⟦ and ⟧."""
        parts = [tokenizer.decode(self.prompt_ids)]
        start = 0
        for i in range(1, len(self.response_ids) + 1):
            if i == len(self.response_ids) or self.loss_mask[i] != self.loss_mask[start]:
                text = tokenizer.decode(self.response_ids[start:i])
                parts.append(text if self.loss_mask[start] else f"{MASK_OPEN}{text}{MASK_CLOSE}")
                start = i
        return "".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict) -> Trajectory:
        return cls(**{**row, "turns": [Turn(**t) for t in row["turns"]]})


def save_jsonl(trajectories: Iterable[Trajectory], path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_dict(), ensure_ascii=False) + "\n")


def load_jsonl(path: Path) -> Iterator[Trajectory]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield Trajectory.from_dict(json.loads(line))

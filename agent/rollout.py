"""The multi-turn rollout: generate, parse, search (one batched request per turn), append, repeat.

Per trajectory, at most `max_turns` turns may search; then one final turn with search disabled. Model tokens
are appended exactly as sampled (loss_mask 1); observations and invalid-action messages are tokenized once and
appended as ids (loss_mask 0). Text is never re-tokenized.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Protocol

from agent.backend import RolloutBackend, SamplingParams
from agent.protocol import (
    ANSWER_STOP,
    INVALID_ACTION,
    SEARCH_STOP,
    encode,
    extract_answer,
    observation_ids,
    parse_action,
    prompt_ids,
    prompt_text,
)
from agent.trajectory import Trajectory, Turn
from data.qa import QAExample
from retriever.client import Hit, RetrieverError, format_hits

Mode = Literal["agent", "direct", "rag"]
SEARCH_FAILED = "The search engine did not answer; no documents were retrieved."


class Searcher(Protocol):
    def search(self, queries: list[str], topk: int | None = None) -> list[list[Hit]]: ...


@dataclass(frozen=True)
class RolloutConfig:
    max_turns: int = 4  # turns that may search; one final turn without search follows
    max_tokens_per_turn: int = 500
    max_obs_tokens: int = 500
    topk: int = 3
    mode: Mode = "agent"


class SearchAgent:
    def __init__(self, backend: RolloutBackend, tokenizer, retriever: Searcher | None, config: RolloutConfig):
        if retriever is None and config.mode != "direct":
            raise ValueError(f"mode {config.mode!r} needs a retriever")
        self.backend = backend
        self.tokenizer = tokenizer
        self.retriever = retriever
        self.config = config

    def _search(self, queries: list[str]) -> tuple[list[list[Hit]] | None, str | None]:
        assert self.retriever is not None
        try:
            return self.retriever.search(queries, self.config.topk), None
        except RetrieverError as e:  # the rollout goes on; the failure is shown to the model and recorded
            return None, str(e)

    def _prompts(self, examples: list[QAExample]) -> list[list[int]]:
        mode = self.config.mode
        if mode != "rag":
            return [prompt_ids(self.tokenizer, prompt_text(ex.question, mode)) for ex in examples]
        results, error = self._search([ex.question for ex in examples])
        if results is None:
            raise RetrieverError(f"rag mode could not retrieve passages: {error}")
        return [
            prompt_ids(self.tokenizer, prompt_text(ex.question, "rag", format_hits(hits)))
            for ex, hits in zip(examples, results, strict=True)
        ]

    def rollout(self, examples: list[QAExample], params: SamplingParams, samples_per_example: int = 1) -> list[Trajectory]:
        prompts = self._prompts(examples)
        trajectories = [
            Trajectory(
                uid=f"{ex.id}#{s}", group_id=ex.id, question=ex.question, golden_answers=list(ex.golden_answers),
                prompt_ids=list(ids),
            )
            for ex, ids in zip(examples, prompts, strict=True)
            for s in range(samples_per_example)
        ]
        turn_params = replace(params, max_tokens=self.config.max_tokens_per_turn)
        search_turns = self.config.max_turns if self.config.mode == "agent" else 0
        for step in range(search_turns + 1):
            active = [t for t in trajectories if not t.done]
            if not active:
                break
            final = step == search_turns
            stop = [ANSWER_STOP] if final else [SEARCH_STOP, ANSWER_STOP]
            # Each call gets its own seed so a batch's samples differ across turns but the run is reproducible.
            step_params = turn_params if params.seed is None else replace(turn_params, seed=params.seed + step)
            generations = self.backend.generate([t.prompt_ids + t.response_ids for t in active], step_params, stop)
            searching: list[tuple[Trajectory, Turn]] = []
            for traj, gen in zip(active, generations, strict=True):
                start, end = traj.append(gen.token_ids, model=True, logprobs=gen.logprobs)
                action = parse_action(self.tokenizer.decode(gen.token_ids))
                turn = Turn(kind=action.kind, start=start, end=end, finish_reason=gen.finish_reason)
                traj.turns.append(turn)
                if action.kind == "answer":
                    traj.done = True
                elif final:
                    turn.kind, traj.done = "final", True
                elif action.kind == "search":
                    turn.query = action.content
                    searching.append((traj, turn))
                else:
                    _, turn.observation_end = traj.append(encode(self.tokenizer, INVALID_ACTION), model=False)
            if searching:
                results, error = self._search([turn.query for _, turn in searching])  # type: ignore[misc]
                for i, (traj, turn) in enumerate(searching):
                    if results is None:
                        turn.retrieval_error = error
                        body = SEARCH_FAILED
                    else:
                        turn.doc_ids = [h.id for h in results[i]]
                        body = format_hits(results[i])
                    _, turn.observation_end = traj.append(
                        observation_ids(self.tokenizer, body, self.config.max_obs_tokens), model=False
                    )
        for traj in trajectories:
            traj.answer = extract_answer([self.tokenizer.decode(traj.response_ids[t.start : t.end]) for t in traj.turns])
        return trajectories

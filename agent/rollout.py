"""The multi-turn rollout: generate, parse, search, append, repeat; the protocol's steps and the per-turn loop.

Per trajectory, at most `max_turns` turns may search; then one final turn with search disabled. Model tokens
are appended exactly as sampled (loss_mask 1); observations and invalid-action messages are tokenized once and
appended as ids (loss_mask 0). Text is never re-tokenized.

`RolloutSteps` holds the steps of one trajectory's turn; two schedulers drive them:
  - `SearchAgent` (here): turn by turn over the whole batch, one batched `/retrieve` per turn. Any backend
    (the transformers one is the reference); every trajectory waits for the slowest one's turn.
  - `ContinuousSearchAgent` (agent/continuous.py): one coroutine per trajectory over vLLM's async engine and the
    async retriever client; nothing waits for a batch-wide turn. Greedy, both give the same trajectories.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from agent.backend import Generation, RolloutBackend, SamplingParams
from agent.protocol import (
    ANSWER_STOP,
    INVALID_ACTION,
    SEARCH_FAILED,
    SEARCH_STOP,
    encode,
    extract_answer,
    format_hits,
    observation_ids,
    parse_action,
    prompt_ids,
    prompt_text,
)
from agent.seeds import turn_seed
from agent.settings import Mode, RolloutSettings
from agent.trajectory import Trajectory, Turn
from data.qa import QAExample
from retriever.client import Hit, RetrieverError


__all__ = ["Mode", "RolloutAgent", "RolloutSteps", "SearchAgent", "Searcher"]


class Searcher(Protocol):
    """What the agent searches with (retriever.client.RetrieverClient): `topk=None` means the searcher's own top-k,
    which is the run's (`retriever.topk`)."""

    def search(self, queries: list[str], topk: int | None = None) -> list[list[Hit]]: ...


class RolloutAgent(Protocol):
    retrieval_wait_s: float  # the last rollout's seconds with the engine waiting on retrieval
    # The most examples x samples one `rollout` call should carry (the per-turn loop holds them all in one batch
    # through every turn); None: any number (the continuous scheduler caps what is in flight itself).
    rows_per_call: int | None

    def rollout(self, examples: list[QAExample], params: SamplingParams, samples_per_example: int = 1,
                on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """`samples_per_example` trajectories per example, example-major; `on_done` sees each as it finishes."""
        ...


class RolloutSteps:
    """The protocol's steps for one trajectory, shared by both schedulers: prompts, sampling parameters per turn,
    what a generated turn means, what is appended after it, and the final answer."""

    def __init__(self, tokenizer, settings: RolloutSettings):
        self.tokenizer = tokenizer
        self.settings = settings

    @property
    def search_turns(self) -> int:
        """Turns that may search; one final turn without search follows them."""
        return self.settings.max_turns if self.settings.mode == "agent" else 0

    def prompts(self, examples: list[QAExample], passages: list[list[Hit]] | None,
                error: str | None = None) -> list[list[int]]:
        """Prompt ids; rag mode puts each question's passages (one search of all questions) in its prompt."""
        mode = self.settings.mode
        if mode != "rag":
            return [prompt_ids(self.tokenizer, prompt_text(ex.question, mode)) for ex in examples]
        if passages is None:
            raise RetrieverError(f"rag mode could not retrieve passages: {error}")
        return [
            prompt_ids(self.tokenizer, prompt_text(ex.question, "rag", format_hits(hits)))
            for ex, hits in zip(examples, passages, strict=True)
        ]

    @staticmethod
    def trajectories(examples: list[QAExample], prompts: list[list[int]], samples: int) -> list[Trajectory]:
        return [
            Trajectory(
                uid=f"{ex.id}#{s}", group_id=ex.id, question=ex.question, golden_answers=list(ex.golden_answers),
                prompt_ids=list(ids),
            )
            for ex, ids in zip(examples, prompts, strict=True)
            for s in range(samples)
        ]

    def turn_params(self, params: SamplingParams, turn: int) -> SamplingParams:
        # Each turn gets its own seed so a trajectory's samples differ across turns but the run is reproducible.
        return replace(params, max_tokens=self.settings.max_tokens_per_turn, seed=turn_seed(params.seed, turn))

    def stop(self, turn: int) -> list[str]:
        return [ANSWER_STOP] if turn == self.search_turns else [SEARCH_STOP, ANSWER_STOP]

    def take_turn(self, traj: Trajectory, gen: Generation, turn_index: int) -> Turn:
        """Append the sampled ids and act on them: an answer (or the final turn) ends the trajectory, an invalid
        action gets the invalid-action message; a search turn (kind "search", trajectory not done) waits for
        `observe`."""
        start, end = traj.append(gen.token_ids, model=True, logprobs=gen.logprobs)
        action = parse_action(self.tokenizer.decode(gen.token_ids))
        turn = Turn(kind=action.kind, start=start, end=end, finish_reason=gen.finish_reason)
        traj.turns.append(turn)
        if action.kind == "answer":
            traj.done = True
        elif turn_index == self.search_turns:
            turn.kind, traj.done = "final", True
        elif action.kind == "search":
            turn.query = action.content
        else:
            _, turn.observation_end = traj.append(encode(self.tokenizer, INVALID_ACTION), model=False)
        return turn

    def observe(self, traj: Trajectory, turn: Turn, hits: list[Hit] | None, error: str | None) -> None:
        """Append a search's results (or the failure message; the error is recorded on the turn), truncated."""
        if hits is None:
            turn.retrieval_error = error
            body = SEARCH_FAILED
        else:
            turn.doc_ids = [h.id for h in hits]
            body = format_hits(hits)
        _, turn.observation_end = traj.append(observation_ids(self.tokenizer, body, self.settings.max_obs_tokens),
                                              model=False)

    def finish(self, traj: Trajectory) -> None:
        traj.answer = extract_answer([self.tokenizer.decode(traj.response_ids[t.start : t.end]) for t in traj.turns])


class SearchAgent(RolloutSteps):
    """The per-turn loop: every active trajectory's turn in one backend call, then one search for all of them."""

    def __init__(self, backend: RolloutBackend, tokenizer, retriever: Searcher | None, settings: RolloutSettings):
        if retriever is None and settings.mode != "direct":
            raise ValueError(f"mode {settings.mode!r} needs a retriever")
        super().__init__(tokenizer, settings)
        self.backend = backend
        self.rows_per_call: int | None = settings.max_in_flight
        self.retriever = retriever
        self.retrieval_wait_s = 0.0  # the last rollout's seconds in searches (the whole batch waits for them)

    def _search(self, queries: list[str]) -> tuple[list[list[Hit]] | None, str | None]:
        assert self.retriever is not None
        start = time.perf_counter()
        try:
            return self.retriever.search(queries), None
        except RetrieverError as e:  # the rollout goes on; the failure is shown to the model and recorded
            return None, str(e)
        finally:
            self.retrieval_wait_s += time.perf_counter() - start

    def rollout(self, examples: list[QAExample], params: SamplingParams, samples_per_example: int = 1,
                on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        self.retrieval_wait_s = 0.0
        passages, error = self._search([ex.question for ex in examples]) if self.settings.mode == "rag" else (None, None)
        trajectories = self.trajectories(examples, self.prompts(examples, passages, error), samples_per_example)
        rows = {id(t): row for row, t in enumerate(trajectories)}  # a trajectory's row seeds engines that take one
        for turn_index in range(self.search_turns + 1):
            active = [t for t in trajectories if not t.done]
            if not active:
                break
            prompts = [t.prompt_ids + t.response_ids for t in active]
            generations = self.backend.generate(prompts, self.turn_params(params, turn_index), self.stop(turn_index),
                                                rows=[rows[id(t)] for t in active])
            searching = [(traj, self.take_turn(traj, gen, turn_index))
                         for traj, gen in zip(active, generations, strict=True)]
            searching = [(traj, turn) for traj, turn in searching if turn.kind == "search" and not traj.done]
            if searching:
                results, error = self._search([turn.query for _, turn in searching])  # type: ignore[misc]
                for i, (traj, turn) in enumerate(searching):
                    self.observe(traj, turn, None if results is None else results[i], error)
        for traj in trajectories:
            self.finish(traj)
            if on_done is not None:
                on_done(traj)
        return trajectories

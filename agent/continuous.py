"""Continuous multi-turn rollouts: one coroutine per trajectory on the vLLM engine's event loop.

Each trajectory is its own small state machine: generate (vLLM's async engine: ids in, ids and the sampler's
log-probs out, stop at `</search>` / `</answer>`) -> parse -> await the async retriever client -> append the
observation's ids (masked) -> generate again. The steps are the per-turn loop's own (`RolloutSteps`): the final
no-search turn, observation truncation and retrieval-failure handling are the same code. A trajectory whose search
returns goes straight back to the engine while others are still generating; nothing waits for a batch-wide turn.
Searches of concurrent trajectories still meet in the server's cross-request batcher.

At most `settings.max_in_flight` trajectories are in flight (the others wait, in order): that bounds the engine's batch
and the KV cache it needs. A trajectory's seed for turn t is row_seed(turn_seed(params.seed, t), its index)
(agent.seeds), as in the per-turn loop on vLLM, so its samples do not depend on when the other trajectories finish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from contextlib import nullcontext
from typing import Any, Protocol, TypeVar, runtime_checkable

from agent.backend import Generation, SamplingParams
from agent.rollout import RolloutSteps
from agent.settings import RolloutSettings
from agent.trajectory import Trajectory
from data.qa import QAExample
from retriever.client import Hit, RetrieverError

T = TypeVar("T")


class AsyncSearcher(Protocol):
    """retriever.client.AsyncRetrieverClient's interface."""

    async def search(self, queries: list[str], topk: int | None = None) -> list[list[Hit]]: ...

    async def __aenter__(self) -> AsyncSearcher: ...

    async def __aexit__(self, *exc) -> None: ...


@runtime_checkable
class AsyncEngine(Protocol):
    """An engine with an event loop of its own (agent.vllm_backend.VLLMBackend)."""

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T: ...

    async def agenerate(self, prompt: list[int], params: SamplingParams, stop: list[str], row: int = 0) -> Generation:
        ...


class IdleClock:
    """Wall-clock seconds the engine had nothing to generate while a search was pending: retrieval on the critical
    path. (The per-turn loop's equivalent is the whole time of its batched searches.)"""

    def __init__(self):
        self.generating = self.searching = 0
        self.idle_since: float | None = None
        self.seconds = 0.0

    def change(self, generating: int = 0, searching: int = 0) -> None:
        self.generating += generating
        self.searching += searching
        idle = self.generating == 0 and self.searching > 0
        now = time.perf_counter()
        if idle and self.idle_since is None:
            self.idle_since = now
        elif not idle and self.idle_since is not None:
            self.seconds += now - self.idle_since
            self.idle_since = None


class ContinuousSearchAgent(RolloutSteps):
    def __init__(self, engine: AsyncEngine, tokenizer, open_retriever: Callable[[], AsyncSearcher] | None,
                 settings: RolloutSettings):
        """`open_retriever()` makes an async client (an async context manager), opened on the engine's loop for each
        rollout: e.g. `functools.partial(AsyncRetrieverClient, urls, timeout_s=30)`."""
        if open_retriever is None and settings.mode != "direct":
            raise ValueError(f"mode {settings.mode!r} needs a retriever")
        super().__init__(tokenizer, settings)
        self.engine = engine
        self.open_retriever = open_retriever
        self.max_concurrency = settings.max_in_flight
        self.rows_per_call: int | None = None  # any number: at most max_concurrency of them are in flight
        self.retrieval_wait_s = 0.0  # the last rollout's (IdleClock)

    def rollout(self, examples: list[QAExample], params: SamplingParams, samples_per_example: int = 1,
                on_done: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        return self.engine.run(self._rollout(examples, params, samples_per_example, on_done))

    async def _rollout(self, examples: list[QAExample], params: SamplingParams, samples: int,
                       on_done: Callable[[Trajectory], None] | None) -> list[Trajectory]:
        clock = IdleClock()
        async with (self.open_retriever() if self.open_retriever is not None else nullcontext()) as retriever:
            passages, error = None, None
            if self.settings.mode == "rag":
                passages, error = await self._search(retriever, [ex.question for ex in examples], clock)
            trajectories = self.trajectories(examples, self.prompts(examples, passages, error), samples)
            slots = asyncio.Semaphore(self.max_concurrency)

            async def one(row: int, traj: Trajectory) -> None:
                async with slots:
                    await self._trajectory(row, traj, params, retriever, clock)
                self.finish(traj)
                if on_done is not None:
                    on_done(traj)

            async with asyncio.TaskGroup() as group:  # an engine error cancels the others and is raised here
                for row, traj in enumerate(trajectories):
                    group.create_task(one(row, traj))
        self.retrieval_wait_s = clock.seconds
        return trajectories

    async def _trajectory(self, row: int, traj: Trajectory, params: SamplingParams, retriever: AsyncSearcher | None,
                          clock: IdleClock) -> None:
        for turn_index in range(self.search_turns + 1):
            clock.change(generating=1)
            try:
                gen = await self.engine.agenerate(traj.prompt_ids + traj.response_ids,
                                                  self.turn_params(params, turn_index), self.stop(turn_index), row)
            finally:
                clock.change(generating=-1)
            turn = self.take_turn(traj, gen, turn_index)
            if traj.done:
                return
            if turn.kind == "search":
                results, error = await self._search(retriever, [turn.query], clock)  # type: ignore[list-item]
                self.observe(traj, turn, None if results is None else results[0], error)

    async def _search(self, retriever: AsyncSearcher | None, queries: list[str],
                      clock: IdleClock) -> tuple[list[list[Hit]] | None, str | None]:
        assert retriever is not None
        clock.change(searching=1)
        try:
            return await retriever.search(queries), None
        except RetrieverError as e:  # this trajectory goes on; the failure is shown to the model and recorded
            return None, str(e)
        finally:
            clock.change(searching=-1)


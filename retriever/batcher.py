"""Cross-request batching and a result cache in front of an index.

Rollout workers send many small /retrieve requests at once. Encoding each alone wastes the encoder: a batch of
256 queries costs little more than one. So concurrent requests are queued; whenever the encoder is free, every
waiting request (up to `max_batch_queries` queries) is taken at once, deduplicated, encoded and searched in one
call on a worker thread (the event loop never blocks), and each caller gets its own slice. While that batch
encodes, the next one collects in the queue, so the encoder never waits between batches, and a lone request goes
straight to it: by default there is no timed window (`max_wait_ms` 0; a window only delayed every batch, and under
load the queue fills during the previous encode anyway). GRPO groups repeat the same query, so results are also
kept in an LRU cache keyed by the exact query string.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from retriever.api import Hit
from retriever.metrics import RetrieverMetrics

SearchFn = Callable[[list[str], int], list[list[Hit]]]


class ResultCache:
    """LRU of query -> (k it was searched with, hits). A hit for k serves any request for k' <= k."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[int, list[Hit]]] = OrderedDict()

    def get(self, query: str, k: int) -> list[Hit] | None:
        entry = self._entries.get(query)
        if entry is None or entry[0] < k:
            return None
        self._entries.move_to_end(query)
        return entry[1][:k]

    def put(self, query: str, k: int, hits: list[Hit]) -> None:
        if self.max_entries <= 0:
            return
        old = self._entries.get(query)
        if old is not None and old[0] > k:
            return  # keep the deeper result list
        self._entries[query] = (k, list(hits))
        self._entries.move_to_end(query)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class _Pending:
    queries: list[str]
    k: int
    future: asyncio.Future[list[list[Hit]]] = field(repr=False)


class BatchingSearcher:
    """`await search(queries, k)` from any number of concurrent request handlers."""

    def __init__(
        self,
        search_fn: SearchFn,
        *,
        batching: bool = True,
        max_batch_queries: int = 256,
        max_wait_ms: float = 0.0,
        cache_size: int = 100_000,
        search_threads: int = 1,
        metrics: RetrieverMetrics | None = None,
    ):
        self.search_fn = search_fn
        self.batching = batching
        self.max_batch_queries = max_batch_queries
        self.max_wait_s = max_wait_ms / 1000
        self.cache = ResultCache(cache_size)
        self.metrics = metrics or RetrieverMetrics()
        self._executor = ThreadPoolExecutor(max_workers=search_threads, thread_name_prefix="emapg-search")
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.batching and self._worker is None:
            self._worker = asyncio.create_task(self._batch_loop(), name="emapg-batcher")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        self.metrics.queries.inc(len(queries))
        cached = [self.cache.get(q, k) for q in queries]
        misses = list(dict.fromkeys(q for q, hits in zip(queries, cached, strict=True) if hits is None))
        self.metrics.cache_hits.inc(len(queries) - len(misses))
        self.metrics.cache_misses.inc(len(misses))
        if misses:
            found = await (self._enqueue(misses, k) if self.batching else self._run(misses, k, requests=1))
            by_query = dict(zip(misses, found, strict=True))
            for q, hits in by_query.items():
                self.cache.put(q, k, hits)
            cached = [hits if hits is not None else by_query[q] for q, hits in zip(queries, cached, strict=True)]
        return cached  # type: ignore[return-value]

    async def _enqueue(self, queries: list[str], k: int) -> list[list[Hit]]:
        future: asyncio.Future[list[list[Hit]]] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(queries, k, future))
        return await future

    async def _run(self, queries: list[str], k: int, requests: int) -> list[list[Hit]]:
        start = time.perf_counter()
        results = await asyncio.get_running_loop().run_in_executor(self._executor, self.search_fn, queries, k)
        self.metrics.search_seconds.observe(time.perf_counter() - start)
        self.metrics.batch_queries.observe(len(queries))
        self.metrics.batch_requests.observe(requests)
        return results

    async def _collect(self) -> list[_Pending]:
        """The first waiting request, then every other one already queued, and whatever arrives within max_wait,
        until the batch is full. Queued requests are taken without yielding to the event loop."""
        batch = [await self._queue.get()]
        size = len(batch[0].queries)
        deadline = asyncio.get_running_loop().time() + self.max_wait_s
        while size < self.max_batch_queries:
            if self._queue.empty():
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            else:
                item = self._queue.get_nowait()
            batch.append(item)
            size += len(item.queries)
        return batch

    async def _batch_loop(self) -> None:
        while True:
            batch = await self._collect()
            live = [p for p in batch if not p.future.done()]  # a caller may have gone (client disconnect)
            if not live:
                continue
            unique = list(dict.fromkeys(q for p in live for q in p.queries))
            k = max(p.k for p in live)
            try:
                found = dict(zip(unique, await self._run(unique, k, requests=len(live)), strict=True))
            except Exception as e:  # the error goes to every caller in the batch; the loop keeps serving
                for p in live:
                    if not p.future.done():
                        p.future.set_exception(e)
                continue
            for p in live:
                if not p.future.done():
                    p.future.set_result([found[q][: p.k] for q in p.queries])

"""The cross-request batcher and the cache, against a fake index (a pure function of the query text)."""

import asyncio
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from retriever.api import Hit
from retriever.batcher import BatchingSearcher, ResultCache


class FakeIndex:
    """Deterministic hits derived from the query string; records every call it gets."""

    def __init__(self, delay_s: float = 0.0, fail_on: str | None = None):
        self.calls: list[tuple[list[str], int]] = []
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.lock = threading.Lock()

    def hits_for(self, query: str, k: int) -> list[Hit]:
        return [Hit(id=f"{query}#{i}", contents=f'"{query}"\nhit {i}', score=float(-i)) for i in range(k)]

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        with self.lock:
            self.calls.append((list(queries), k))
        if self.fail_on in queries:
            raise RuntimeError(f"boom on {self.fail_on}")
        threading.Event().wait(self.delay_s)
        return [self.hits_for(q, k) for q in queries]


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_are_coalesced_and_each_gets_its_own_hits():
    fake = FakeIndex(delay_s=0.05)

    async def main():
        searcher = BatchingSearcher(fake.search, max_wait_ms=20, cache_size=0)
        await searcher.start()
        requests = [([f"q{i}", "shared"], 2 + i % 3) for i in range(40)]
        results = await asyncio.gather(*(searcher.search(qs, k) for qs, k in requests))
        await searcher.stop()
        return requests, results

    requests, results = run(main())
    for (queries, k), got in zip(requests, results, strict=True):
        assert got == [fake.hits_for(q, k) for q in queries]
    assert len(fake.calls) < 10  # 40 requests, far fewer encode+search calls
    for queries, _ in fake.calls:
        assert len(queries) == len(set(queries))  # "shared" is searched once per batch


def test_batching_off_searches_each_request_alone():
    fake = FakeIndex()

    async def main():
        searcher = BatchingSearcher(fake.search, batching=False, cache_size=0)
        await searcher.start()
        out = await asyncio.gather(*(searcher.search([f"q{i}"], 3) for i in range(5)))
        await searcher.stop()
        return out

    assert run(main()) == [[fake.hits_for(f"q{i}", 3)] for i in range(5)]
    assert len(fake.calls) == 5


def test_an_error_reaches_every_caller_of_its_batch_and_the_loop_keeps_serving():
    fake = FakeIndex(fail_on="bad")

    async def main():
        searcher = BatchingSearcher(fake.search, max_wait_ms=50, cache_size=0)
        await searcher.start()
        first = await asyncio.gather(searcher.search(["bad"], 1), searcher.search(["good"], 1), return_exceptions=True)
        second = await searcher.search(["good"], 1)
        await searcher.stop()
        return first, second

    first, second = run(main())
    assert all(isinstance(r, RuntimeError) for r in first)
    assert second == [fake.hits_for("good", 1)]


def test_cache_serves_repeats_without_searching_and_only_for_enough_k():
    fake = FakeIndex()

    async def main():
        searcher = BatchingSearcher(fake.search, max_wait_ms=0)
        await searcher.start()
        a = await searcher.search(["q"], 5)
        b = await searcher.search(["q", "q"], 3)  # served from the k=5 entry
        c = await searcher.search(["q"], 8)  # deeper than cached: searched again
        await searcher.stop()
        return a, b, c

    a, b, c = run(main())
    assert b == [fake.hits_for("q", 3)] * 2 and c == [fake.hits_for("q", 8)]
    assert [k for _, k in fake.calls] == [5, 8]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=6), st.integers(1, 6)), min_size=1, max_size=40), st.integers(1, 8))
def test_cache_never_returns_another_querys_hits(operations, capacity):
    fake = FakeIndex()
    cache = ResultCache(capacity)
    for query, k in operations:
        got = cache.get(query, k)
        if got is None:
            cache.put(query, k, fake.hits_for(query, k))
        else:
            assert got == fake.hits_for(query, k)
        assert len(cache) <= capacity


def test_a_lone_request_goes_straight_to_the_encoder_and_requests_arriving_meanwhile_form_the_next_batch():
    fake = FakeIndex(delay_s=0.3)

    async def main():
        searcher = BatchingSearcher(fake.search, cache_size=0)  # the default: no batching window
        await searcher.start()
        first = asyncio.create_task(searcher.search(["alone"], 1))
        while not fake.calls:  # dispatched without waiting for company
            await asyncio.sleep(0.01)
        later = [asyncio.create_task(searcher.search([f"q{i}"], 1)) for i in range(3)]
        await asyncio.gather(first, *later)
        await searcher.stop()

    run(main())
    assert [queries for queries, _ in fake.calls] == [["alone"], ["q0", "q1", "q2"]]


def test_max_batch_queries_splits_what_is_queued_across_batches():
    fake = FakeIndex(delay_s=0.2)

    async def main():
        searcher = BatchingSearcher(fake.search, cache_size=0, max_batch_queries=4)
        await searcher.start()
        first = asyncio.create_task(searcher.search(["alone"], 1))
        while not fake.calls:
            await asyncio.sleep(0.01)
        later = [asyncio.create_task(searcher.search([f"q{i}", f"r{i}"], 1)) for i in range(3)]
        await asyncio.gather(first, *later)
        await searcher.stop()

    run(main())
    assert [len(queries) for queries, _ in fake.calls] == [1, 4, 2]

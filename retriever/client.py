"""HTTP client for `POST /retrieve` (ours or Search-R1's server), sync and async, with retries and batching.

Connection errors, timeouts and 5xx answers are retried with exponential backoff; a 4xx answer is the caller's
mistake and raises at once with the server's message. When the server stays down, the error names the URL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Generator

import httpx

from data.corpus import split_contents
from retriever.docstore import Hit

RETRYABLE = (httpx.TransportError,)  # connect/read/write errors, timeouts, dropped connections


class RetrieverError(RuntimeError):
    """The server answered with an error the caller must fix (4xx), or a malformed body."""


class RetrieverUnavailable(RetrieverError):
    """The server could not be reached (or kept failing) after all retries."""


def format_hits(hits: list[Hit]) -> str:
    """Search-R1's observation text: `Doc i(Title: <title>) <text>`, one hit per line."""
    lines = []
    for i, hit in enumerate(hits, 1):
        title, text = split_contents(hit.contents)
        lines.append(f"Doc {i}(Title: {title}) {text}")
    return "\n".join(lines)


def _parse(response: httpx.Response, url: str) -> list[list[Hit]]:
    try:
        body = response.json()
        return [
            [Hit(id=str(h["document"]["id"]), contents=h["document"]["contents"], score=float(h["score"])) for h in hits]
            for hits in body["result"]
        ]
    except (ValueError, KeyError, TypeError) as e:
        raise RetrieverError(f"{url} returned a body that is not a /retrieve response: {response.text[:200]}") from e


def _raise_for_client_error(response: httpx.Response, url: str) -> None:
    if 400 <= response.status_code < 500:
        try:
            message = response.json().get("message") or response.json().get("detail")
        except ValueError:
            message = response.text[:200]
        raise RetrieverError(f"{url} refused the request ({response.status_code}): {message}")


class _ClientBase:
    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        *,
        topk: int = 3,
        timeout_s: float = 30.0,
        retries: int = 5,
        backoff_s: float = 0.25,
        max_queries_per_request: int = 512,
        token: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.endpoint = self.url + "/retrieve"
        self.topk = topk
        self.timeout_s = timeout_s
        self.max_queries_per_request = max_queries_per_request
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retries = retries
        self.backoff_s = backoff_s

    def _chunks(self, queries: list[str]) -> list[list[str]]:
        n = self.max_queries_per_request
        return [queries[i : i + n] for i in range(0, len(queries), n)]

    def _body(self, queries: list[str], topk: int | None) -> dict:
        return {"queries": queries, "topk": topk or self.topk, "return_scores": True}

    def _exchange(self) -> Generator[float, httpx.Response | Exception, list[list[Hit]]]:
        """The retry policy without I/O, shared by the sync and async clients: yields how long to sleep before
        the next attempt, is sent that attempt's response (or transport error), returns the parsed hits."""
        last = ""
        for attempt in range(self.retries + 1):
            outcome = yield (0.0 if attempt == 0 else self.backoff_s * 2 ** (attempt - 1))
            if isinstance(outcome, Exception):
                last = f"{type(outcome).__name__}: {outcome}"
            elif outcome.status_code >= 500:
                last = f"HTTP {outcome.status_code}"
            else:
                _raise_for_client_error(outcome, self.endpoint)
                return _parse(outcome, self.endpoint)
        raise RetrieverUnavailable(f"retriever at {self.endpoint} unavailable after {self.retries + 1} attempts: {last}")


class RetrieverClient(_ClientBase):
    """Blocking client. `search(queries)` sends them in as few requests as the batch limit allows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._http = httpx.Client(timeout=self.timeout_s, headers=self.headers)

    def search(self, queries: list[str], topk: int | None = None) -> list[list[Hit]]:
        return [hits for chunk in self._chunks(queries) for hits in self._post(chunk, topk)]

    def _post(self, queries: list[str], topk: int | None) -> list[list[Hit]]:
        exchange = self._exchange()
        delay = next(exchange)
        while True:
            time.sleep(delay)
            try:
                outcome: httpx.Response | Exception = self._http.post(self.endpoint, json=self._body(queries, topk))
            except RETRYABLE as e:
                outcome = e
            try:
                delay = exchange.send(outcome)
            except StopIteration as done:
                return done.value

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RetrieverClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncRetrieverClient(_ClientBase):
    """Asyncio client; chunks of a large query list are sent concurrently."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._http = httpx.AsyncClient(timeout=self.timeout_s, headers=self.headers)

    async def search(self, queries: list[str], topk: int | None = None) -> list[list[Hit]]:
        parts = await asyncio.gather(*(self._post(chunk, topk) for chunk in self._chunks(queries)))
        return [hits for part in parts for hits in part]

    async def _post(self, queries: list[str], topk: int | None) -> list[list[Hit]]:
        exchange = self._exchange()
        delay = next(exchange)
        while True:
            await asyncio.sleep(delay)
            try:
                outcome: httpx.Response | Exception = await self._http.post(self.endpoint, json=self._body(queries, topk))
            except RETRYABLE as e:
                outcome = e
            try:
                delay = exchange.send(outcome)
            except StopIteration as done:
                return done.value

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncRetrieverClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

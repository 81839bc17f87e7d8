"""HTTP client for `POST /retrieve` (ours or Search-R1's server), sync and async, with retries, replicas and batching;
`health()` reads `GET /health` the same way. Bodies go out and come back through the models of `retriever/api.py`;
searches return structured hits (`Hit`): the text an agent shows a model is its own (agent.protocol.format_hits).

Give one URL, or a list of replica URLs serving the same index: requests go round-robin over the replicas.
Connection errors, timeouts and 5xx answers are retryable: the request moves at once to the next replica, and the
replica that failed sits out a short cool-off, so other requests do not wait on it too. Only when every replica
has failed does the client back off exponentially and try them all again; after `retries` such rounds it raises
RetrieverUnavailable naming every URL. A 4xx answer is the caller's mistake (any replica would refuse it) and
raises at once with the server's message.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from retriever.api import Health, Hit, RetrieveRequest, ScoredRetrieveResponse

Model = TypeVar("Model", bound=BaseModel)
Parsed = TypeVar("Parsed")

RETRYABLE = (httpx.TransportError,)  # connect/read/write errors, timeouts, dropped connections
# A replica that does not accept a connection within this is taken as down and the request moves on; a busy server
# still accepts connections at once (the kernel does), so only the read may take the whole timeout_s.
CONNECT_TIMEOUT_S = 5.0


class RetrieverError(RuntimeError):
    """The server answered with an error the caller must fix (4xx), or a malformed body."""


class RetrieverUnavailable(RetrieverError):
    """No replica could be reached (or every one kept failing) after all retries."""


def _parse(model: type[Model], response: httpx.Response, url: str) -> Model:
    try:
        return model.model_validate_json(response.content)
    except ValidationError as e:
        raise RetrieverError(f"{url} returned a body that is not a {model.__name__}: {response.text[:200]}") from e


def _parse_hits(response: httpx.Response, url: str) -> list[list[Hit]]:
    return _parse(ScoredRetrieveResponse, response, url).hits()


def _parse_health(response: httpx.Response, url: str) -> Health:
    return _parse(Health, response, url)


def _raise_for_client_error(response: httpx.Response, url: str) -> None:
    if 400 <= response.status_code < 500:
        try:
            message = response.json().get("message") or response.json().get("detail")
        except ValueError:
            message = response.text[:200]
        raise RetrieverError(f"{url} refused the request ({response.status_code}): {message}")


def replica_urls(urls: str | Sequence[str]) -> list[str]:
    """The replicas' base URLs; refuses no URL, a URL that is not http(s), or one given twice."""
    urls = [urls] if isinstance(urls, str) else list(urls)
    if not urls:
        raise ValueError("retriever url: give at least one URL")
    for url in urls:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever url {url!r} must start with http:// or https://")
    bases = [url.rstrip("/") for url in urls]
    if len(set(bases)) < len(bases):
        raise ValueError(f"retriever urls {urls} name a replica twice")
    return bases


def retrieve_endpoints(urls: str | Sequence[str]) -> list[str]:
    """The `/retrieve` endpoint of each replica URL, checked as `replica_urls` checks them."""
    return [url + "/retrieve" for url in replica_urls(urls)]


class Replicas:
    """The replicas' base URLs, whose turn is next (round-robin), and which are cooling off after a failure.

    Shared by every request of a client. A replica that failed is skipped until its cool-off ends: while it is down,
    requests then go straight to the others instead of each paying a connection error or timeout on it first.
    """

    def __init__(self, urls: list[str], cooloff_s: float):
        self.urls = urls
        self.cooloff_s = cooloff_s
        self._turn = itertools.count()  # next() on a count is atomic in CPython: safe across threads
        self._cooling_until: dict[str, float] = {}

    def rotation(self) -> list[str]:
        """The replicas not cooling off, each once, starting with the one whose turn it is (turns go round the
        ready ones, so they share a failed replica's load evenly). When all are cooling off, all of them: a request
        never fails without trying."""
        now = time.monotonic()
        ready = [u for u in self.urls if self._cooling_until.get(u, 0.0) <= now] or self.urls
        start = next(self._turn) % len(ready)
        return ready[start:] + ready[:start]

    def failed(self, url: str) -> None:
        self._cooling_until[url] = time.monotonic() + self.cooloff_s

    def answered(self, url: str) -> None:
        self._cooling_until.pop(url, None)


class _ClientBase:
    def __init__(
        self,
        url: str | Sequence[str] = "http://127.0.0.1:8000",
        *,
        topk: int = 3,
        timeout_s: float = 30.0,
        retries: int = 5,
        backoff_s: float = 0.25,
        cooloff_s: float = 5.0,
        max_queries_per_request: int = 512,
        token: str | None = None,
    ):
        self.replicas = Replicas(replica_urls(url), cooloff_s)
        self.topk = topk
        self.timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S))
        self.max_queries_per_request = max_queries_per_request
        # The server reads its token from EMAPG_RETRIEVER_TOKEN; a client in the same environment (a training run,
        # a compose service) sends the same one unless given another.
        token = token if token is not None else os.environ.get("EMAPG_RETRIEVER_TOKEN") or None
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.retries = retries
        self.backoff_s = backoff_s

    @property
    def urls(self) -> list[str]:
        """The replicas' base URLs (where `/health` is)."""
        return self.replicas.urls

    def _chunks(self, queries: list[str]) -> list[list[str]]:
        n = self.max_queries_per_request
        return [queries[i : i + n] for i in range(0, len(queries), n)]

    def _body(self, queries: list[str], topk: int | None) -> dict:
        return RetrieveRequest(queries=queries, topk=topk or self.topk, return_scores=True).model_dump()

    def _exchange(
        self, route: str = "/retrieve", parse: Callable[[httpx.Response, str], Parsed] = _parse_hits
    ) -> Generator[tuple[float, str], httpx.Response | Exception, Parsed]:
        """The retry and failover policy without I/O, shared by the sync and async clients: yields (seconds to sleep,
        URL of `route` on a replica) for each attempt, is sent that attempt's response (or transport error), returns
        what `parse` makes of the answer (by default the hits of a `/retrieve` answer).

        A round tries the replicas in rotation, moving to the next at once when one fails; only after a round in
        which all failed does it back off (exponentially) before the next, for at most `retries` more rounds. With
        one URL this is plain retry with backoff.
        """
        errors: dict[str, str] = {}  # each replica's latest failure, for the final message
        attempts = 0
        for round_ in range(self.retries + 1):
            delay = 0.0 if round_ == 0 else self.backoff_s * 2 ** (round_ - 1)
            for replica in self.replicas.rotation():
                endpoint = replica + route
                outcome = yield delay, endpoint
                delay, attempts = 0.0, attempts + 1
                if isinstance(outcome, Exception):
                    errors[endpoint] = f"{type(outcome).__name__}: {outcome}"
                elif outcome.status_code >= 500:
                    errors[endpoint] = f"HTTP {outcome.status_code}"
                else:
                    _raise_for_client_error(outcome, endpoint)
                    self.replicas.answered(replica)
                    return parse(outcome, endpoint)
                self.replicas.failed(replica)
        raise RetrieverUnavailable(
            f"retriever at {', '.join(url + route for url in self.replicas.urls)} unavailable after {attempts} "
            "attempts: " + "; ".join(f"{endpoint}: {error}" for endpoint, error in errors.items())
        )


class RetrieverClient(_ClientBase):
    """Blocking client over one URL or a list of replicas. `search(queries)` sends them in as few requests as the
    batch limit allows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._http = httpx.Client(timeout=self.timeout, headers=self.headers)

    def search(self, queries: list[str], topk: int | None = None) -> list[list[Hit]]:
        return [hits for chunk in self._chunks(queries) for hits in self._post(chunk, topk)]

    def health(self) -> Health:
        """`GET /health` of the first replica that answers: what is served, and the server's search limits."""
        return self._call(self._exchange("/health", _parse_health), self._http.get)

    def _post(self, queries: list[str], topk: int | None) -> list[list[Hit]]:
        body = self._body(queries, topk)
        return self._call(self._exchange(), lambda url: self._http.post(url, json=body))

    def _call(self, exchange: Generator[tuple[float, str], httpx.Response | Exception, Parsed],
              send: Callable[[str], httpx.Response]) -> Parsed:
        """Run an exchange: sleep as it says, send to the URL it names, hand it the outcome, until it returns."""
        delay, url = next(exchange)
        while True:
            time.sleep(delay)
            try:
                outcome: httpx.Response | Exception = send(url)
            except RETRYABLE as e:
                outcome = e
            try:
                delay, url = exchange.send(outcome)
            except StopIteration as done:
                return done.value

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RetrieverClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncRetrieverClient(_ClientBase):
    """Asyncio client over one URL or a list of replicas; chunks of a large query list are sent concurrently (so
    they spread over the replicas)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._http = httpx.AsyncClient(timeout=self.timeout, headers=self.headers)

    async def search(self, queries: list[str], topk: int | None = None) -> list[list[Hit]]:
        parts = await asyncio.gather(*(self._post(chunk, topk) for chunk in self._chunks(queries)))
        return [hits for part in parts for hits in part]

    async def health(self) -> Health:
        """`GET /health` of the first replica that answers: what is served, and the server's search limits."""
        return await self._call(self._exchange("/health", _parse_health), self._http.get)

    async def _post(self, queries: list[str], topk: int | None) -> list[list[Hit]]:
        body = self._body(queries, topk)
        return await self._call(self._exchange(), lambda url: self._http.post(url, json=body))

    async def _call(self, exchange: Generator[tuple[float, str], httpx.Response | Exception, Parsed],
                    send: Callable[[str], Awaitable[httpx.Response]]) -> Parsed:
        """Run an exchange: sleep as it says, send to the URL it names, hand it the outcome, until it returns."""
        delay, url = next(exchange)
        while True:
            await asyncio.sleep(delay)
            try:
                outcome: httpx.Response | Exception = await send(url)
            except RETRYABLE as e:
                outcome = e
            try:
                delay, url = exchange.send(outcome)
            except StopIteration as done:
                return done.value

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncRetrieverClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

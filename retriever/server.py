"""The retrieval HTTP service: Search-R1's `POST /retrieve`, plus `/health`, `/tool` (the search tool's OpenAI
function-calling schema), Prometheus `/metrics` and `/docs`. The request and response models are in
`retriever/api.py`, shared with the client.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Literal

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from retriever.api import (
    DEFAULT_TOPK,
    MAX_QUERIES,
    MAX_QUERY_CHARS,
    MAX_TOPK,
    ErrorDetail,
    ErrorResponse,
    Health,
    OpenAITool,
    RetrieveRequest,
    RetrieveResponse,
    ScoredRetrieveResponse,
    SearchLimits,
    openai_tool,
    retrieve_response,
)
from retriever.batcher import BatchingSearcher
from retriever.encoder import resolve_encoder
from retriever.index import SearchIndex, load_index
from retriever.manifest import Manifest, check_requested_encoder
from retriever.memory import ProcessMemory, process_memory
from retriever.metrics import RetrieverMetrics

TOKEN_ENV = "EMAPG_RETRIEVER_TOKEN"
SETTINGS_ENV = "EMAPG_SERVER_SETTINGS"  # how `serve` hands its settings to uvicorn's worker processes


class ServerSettings(BaseModel):
    """Every knob of the service; `emapg serve` fills it from the command line."""

    index: Path
    encoder: str | None = None  # must match the index's manifest; None = the manifest's own encoder
    host: str = "127.0.0.1"  # loopback unless told otherwise: the service has no auth by default
    port: int = 8000
    default_topk: int = DEFAULT_TOPK
    max_topk: int = MAX_TOPK
    max_queries: int = MAX_QUERIES
    max_query_chars: int = MAX_QUERY_CHARS
    batching: bool = True
    max_batch_queries: int = 256
    max_wait_ms: float = 0.0
    cache_size: int = 100_000
    search_threads: int = 1
    device: str = "cpu"
    query_dtype: Literal["float32", "bfloat16"] = "float32"
    encoder_backend: str = "auto"  # retriever/encoder.py BACKENDS; auto: the measured CPU default, torch on a GPU
    gpu_index: bool = False
    search_params: str | None = None
    # Processes on the one port, each with its own encoder and batcher; the FAISS index is memory-mapped, so they
    # share one copy of its pages (GET /health's memory shows each worker's private and shared bytes).
    workers: int = Field(1, ge=1)
    # One log line per request costs ~10% of the throughput of 32 single-query clients on 2 cores
    # (docs/benchmarks.md); /metrics counts requests and latencies without it.
    access_log: bool = False
    token: str | None = Field(default=None, repr=False)

    @property
    def limits(self) -> SearchLimits:
        return SearchLimits(
            default_topk=self.default_topk, max_topk=self.max_topk, max_queries=self.max_queries,
            max_query_chars=self.max_query_chars,
        )


def _error_response(status: int, body: ErrorResponse, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=body.model_dump(exclude_none=True), headers=headers)


def _error(field: list[str | int], message: str) -> JSONResponse:
    """A 422 with the same body shape as FastAPI's own validation errors, plus a one-line `message`."""
    name = ".".join(str(x) for x in field)
    detail = [ErrorDetail(loc=["body", *field], msg=message)]
    return _error_response(422, ErrorResponse(message=f"{name}: {message}", detail=detail))


def _check_limits(req: RetrieveRequest, s: ServerSettings) -> JSONResponse | None:
    if len(req.queries) > s.max_queries:
        return _error(["queries"], f"{len(req.queries)} queries in one request; the limit is {s.max_queries}")
    for i, q in enumerate(req.queries):
        if not q.strip():
            return _error(["queries", i], "query is empty")
        if len(q) > s.max_query_chars:
            return _error(["queries", i], f"query has {len(q)} characters; the limit is {s.max_query_chars}")
    if req.topk is not None and not 1 <= req.topk <= s.max_topk:
        return _error(["topk"], f"topk must be between 1 and {s.max_topk}, got {req.topk}")
    return None


def create_app(index: SearchIndex, settings: ServerSettings) -> FastAPI:
    metrics = RetrieverMetrics()
    # A backend that memory-maps files names them (DenseIndex: the FAISS file), so /health shows whether workers
    # share their pages; one that does not is reported by process totals alone.
    index_files = getattr(index, "index_files", {})

    def memory() -> ProcessMemory:
        return process_memory(index_files=index_files)

    metrics.watch_memory(memory)
    searcher = BatchingSearcher(
        index.search,
        batching=settings.batching,
        max_batch_queries=settings.max_batch_queries,
        max_wait_ms=settings.max_wait_ms,
        cache_size=settings.cache_size,
        search_threads=settings.search_threads,
        metrics=metrics,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await searcher.start()
        yield
        await searcher.stop()

    app = FastAPI(
        title="emapg retriever",
        description="Search-R1-compatible retrieval over a FAISS or BM25 index, with cross-request batching.",
        lifespan=lifespan,
    )
    app.state.searcher = searcher
    bearer = HTTPBearer(auto_error=False)

    # async: FastAPI runs a plain-def dependency on its thread pool, one thread hop per request.
    async def require_token(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if settings.token is None:
            return
        if credentials is None or not secrets.compare_digest(credentials.credentials, settings.token):
            raise _Unauthorized()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": ["body"], "msg": "invalid request"}
        name = ".".join(str(x) for x in first["loc"][1:]) or "body"
        # pydantic's error dicts can hold the offending value as a non-JSON object (bytes, exceptions).
        detail = [ErrorDetail(loc=list(e["loc"]), msg=e["msg"], type=e.get("type", "")) for e in errors]
        if request.url.path == "/retrieve":
            metrics.requests.labels(status="422").inc()
        return _error_response(422, ErrorResponse(message=f"{name}: {first['msg']}", detail=detail))

    @app.exception_handler(_Unauthorized)
    async def unauthorized(request: Request, exc: _Unauthorized) -> JSONResponse:
        metrics.requests.labels(status="401").inc()
        body = ErrorResponse(message=f"missing or wrong bearer token (the server's {TOKEN_ENV})")
        return _error_response(401, body, headers={"WWW-Authenticate": "Bearer"})

    error_responses = {
        401: {"model": ErrorResponse, "description": f"missing or wrong bearer token (when {TOKEN_ENV} is set)"},
        422: {"model": ErrorResponse, "description": "bad input; `message` names the field"},
    }

    # FastAPI serializes the answer with pydantic-core straight to JSON bytes (its fast path for a response model).
    @app.post(
        "/retrieve", dependencies=[Depends(require_token)], response_model=ScoredRetrieveResponse | RetrieveResponse,
        responses=error_responses,
    )
    async def retrieve(req: RetrieveRequest) -> ScoredRetrieveResponse | RetrieveResponse | JSONResponse:
        start = time.perf_counter()
        if (bad := _check_limits(req, settings)) is not None:
            metrics.requests.labels(status="422").inc()
            return bad
        k = req.topk if req.topk is not None else settings.default_topk
        results = await searcher.search(req.queries, k)
        metrics.requests.labels(status="200").inc()
        metrics.request_seconds.observe(time.perf_counter() - start)
        return retrieve_response(results, req.return_scores)

    @app.get("/health")
    async def health() -> Health:
        # /proc is read off the event loop: a few ms that concurrent /retrieve requests need not wait for.
        process = await asyncio.to_thread(memory)
        m = index.manifest
        return Health(
            kind=m.kind,
            num_docs=m.corpus.num_docs,
            index_factory=m.index_factory,
            encoder=m.encoder.name if m.encoder else None,
            passage_dtype=m.encoder.passage_dtype if m.encoder else None,
            corpus_sha256=m.corpus.sha256,
            batching=settings.batching,
            cache_entries=len(searcher.cache),
            limits=settings.limits,
            search_params=getattr(index, "search_params", None),
            memory=process,
        )

    @app.get("/tool")
    async def tool() -> OpenAITool:
        """The search tool in OpenAI's function-calling form, under this server's limits."""
        return openai_tool(settings.limits)

    @app.get(
        "/metrics", dependencies=[Depends(require_token)], response_class=PlainTextResponse,
        responses={401: error_responses[401]},
    )
    async def prometheus_metrics() -> Response:
        # Off the event loop: the memory gauges read /proc (tens of ms in a process with torch's many mappings).
        return Response(await asyncio.to_thread(generate_latest, metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _Unauthorized(Exception):
    pass


def app_from_settings(settings: ServerSettings) -> FastAPI:
    if settings.token is None and os.environ.get(TOKEN_ENV):
        settings = settings.model_copy(update={"token": os.environ[TOKEN_ENV]})
    index = load_index(
        settings.index,
        encoder=settings.encoder,
        device=settings.device,
        query_dtype=settings.query_dtype,
        query_backend=settings.encoder_backend,
        gpu=settings.gpu_index,
        search_params=settings.search_params,
    )
    return create_app(index, settings)


def app_from_environment() -> FastAPI:
    """The app factory each uvicorn worker process calls: `serve` put the settings in the environment."""
    return app_from_settings(ServerSettings.model_validate_json(os.environ[SETTINGS_ENV]))


def check_index_folder(settings: ServerSettings) -> None:
    """Refuse a folder that is not an index, an index file that is not the one built, or an encoder it was not built
    with, before any worker starts: once, as a clear error, rather than as a traceback from each worker. Reads the
    manifest and the index file's ends."""
    manifest = Manifest.read(settings.index)
    if manifest.index_file is not None:  # a truncated or replaced file: one error now, not one per worker
        from retriever.faiss_file import check_index_file

        check_index_file(settings.index, manifest.index_file)
    if settings.encoder is None:
        return
    if manifest.encoder is None:
        raise ValueError(f"index {settings.index} is BM25: it takes no encoder (got {settings.encoder!r})")
    check_requested_encoder(manifest.encoder, resolve_encoder(settings.encoder))


def serve(settings: ServerSettings) -> None:
    """One process loads the index and serves; with `workers` > 1, uvicorn starts that many processes sharing the
    port, each loading the index itself (uvicorn needs an app factory it can import for that): each memory-maps the
    same FAISS file, so the page cache holds it once."""
    import uvicorn

    if settings.workers == 1:
        uvicorn.run(app_from_settings(settings), host=settings.host, port=settings.port, log_level="info",
                    access_log=settings.access_log)
        return
    check_index_folder(settings)
    os.environ[SETTINGS_ENV] = settings.model_dump_json()
    uvicorn.run(
        "retriever.server:app_from_environment", factory=True, workers=settings.workers, host=settings.host,
        port=settings.port, log_level="info", access_log=settings.access_log,
    )

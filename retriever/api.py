"""The retrieval service's contract: what `POST /retrieve`, `GET /health` and `GET /tool` take and return.

The server declares these models as its FastAPI response models (so `/docs` and `/openapi.json` show them) and
validates what it sends through them; the client parses what it receives through the same models. The wire format
is Search-R1's:

Request  {"queries": [str, ...], "topk": int | null, "return_scores": bool = false}
Response {"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}   (return_scores: true)
         {"result": [[{"id", "contents"}, ...], ...]}                                   (return_scores: false)

Anything outside `retriever/` takes `Hit` and the clients from here or from `retriever.client`, never from the
server's modules. The search tool (one query, topk) that the MCP server exposes and `GET /tool` describes in
OpenAI's function-calling form is defined here too, under the limits a server runs with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, create_model, field_validator
from pydantic.fields import FieldInfo

from retriever.kinds import index_kind
from retriever.memory import ProcessMemory

DEFAULT_TOPK = 3  # Search-R1's default and the paper's recipe
MAX_TOPK = 100
MAX_QUERIES = 1024
MAX_QUERY_CHARS = 2048


@dataclass(frozen=True)
class Hit:
    """One retrieved passage as the agent and trainer use it: the document and its score, flat."""

    id: str
    contents: str
    score: float


class RetrieveRequest(BaseModel):
    # Unknown fields are refused: a typo such as "top_k" would otherwise silently get the default topk.
    model_config = ConfigDict(extra="forbid")

    queries: list[StrictStr] = Field(min_length=1)
    topk: StrictInt | None = None
    return_scores: StrictBool = False


class Document(BaseModel):
    # Search-R1's own server may send integer ids (its corpus rows); ours are strings.
    model_config = ConfigDict(coerce_numbers_to_str=True)

    id: str
    contents: str = Field(description='"<title>"\\n<text>, as in the corpus')


class ScoredDocument(BaseModel):
    document: Document
    score: float = Field(description="inner product of normalised embeddings (cosine), or BM25; higher is better")

    @classmethod
    def from_hit(cls, hit: Hit) -> ScoredDocument:
        return cls(document=Document(id=hit.id, contents=hit.contents), score=hit.score)

    def to_hit(self) -> Hit:
        return Hit(id=self.document.id, contents=self.document.contents, score=self.score)


class ScoredRetrieveResponse(BaseModel):
    """`return_scores: true`: for each query, its hits best first."""

    result: list[list[ScoredDocument]]

    def hits(self) -> list[list[Hit]]:
        return [[h.to_hit() for h in hits] for hits in self.result]


class RetrieveResponse(BaseModel):
    """`return_scores: false`: for each query, its documents best first."""

    result: list[list[Document]]


def retrieve_response(results: list[list[Hit]], return_scores: bool) -> ScoredRetrieveResponse | RetrieveResponse:
    """The `/retrieve` answer for these results, in the shape `return_scores` asks for."""
    if return_scores:
        return ScoredRetrieveResponse(result=[[ScoredDocument.from_hit(h) for h in hits] for hits in results])
    return RetrieveResponse(result=[[Document(id=h.id, contents=h.contents) for h in hits] for hits in results])


class ErrorDetail(BaseModel):
    loc: list[str | int]
    msg: str
    type: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx body: a one-line `message` naming the field, and (for 422) FastAPI-style `detail` entries."""

    message: str
    detail: list[ErrorDetail] | None = None


class SearchLimits(BaseModel):
    """What one request may ask for; a server runs with its own (`emapg serve --max-topk ...`)."""

    default_topk: int = DEFAULT_TOPK  # used when a request sends topk null
    max_topk: int = MAX_TOPK
    max_queries: int = MAX_QUERIES  # per /retrieve request
    max_query_chars: int = MAX_QUERY_CHARS


class Health(BaseModel):
    """`GET /health`: what the server serves (also the MCP server's index resource)."""

    status: Literal["ok"] = "ok"
    index_loaded: bool = True
    kind: str = Field(description="the index kind: a name of retriever/kinds.py's INDEX_KINDS (dense, bm25, ...)")
    num_docs: int
    index_factory: str | None = Field(description="FAISS factory string; null for BM25")
    encoder: str | None = Field(description="query encoder name; null for BM25")
    passage_dtype: str | None = Field(description="dtype the passages were encoded in; null for BM25")
    corpus_sha256: str = Field(description="checksum of the corpus file the index was built from")
    batching: bool
    cache_entries: int
    limits: SearchLimits
    search_params: str | None = Field(default=None, description="FAISS search parameters in use (the build's "
                                      "tuned ones unless the server was given others); null for none")
    memory: ProcessMemory | None = Field(default=None, description="this server process's memory (each worker "
                                         "answers for itself); null from servers before it was reported")

    @field_validator("kind")
    @classmethod
    def _registered_kind(cls, kind: str) -> str:
        # The registry is the one list of kinds: a backend added there is served (and read by clients) as it is.
        index_kind(kind)
        return kind


# --- the search tool: one query, topk; for MCP clients and OpenAI-style function calling ---------------------------

SEARCH_TOOL = "search"
SEARCH_TOOL_DESCRIPTION = (
    "Search the retrieval index for the passages most relevant to a query (a question or keywords). Returns the "
    "top passages, best first, each with its title."
)


def query_field(limits: SearchLimits) -> FieldInfo:
    return Field(min_length=1, max_length=limits.max_query_chars, description="what to search for")


def topk_field(limits: SearchLimits) -> FieldInfo:
    return Field(ge=1, le=limits.max_topk, description="how many passages to return")


def search_arguments(limits: SearchLimits) -> type[BaseModel]:
    """The search tool's arguments under these limits (the JSON schema an agent sees)."""
    return create_model(
        "SearchArguments",
        __config__=ConfigDict(extra="forbid"),
        query=Annotated[str, query_field(limits)],
        topk=(Annotated[int, topk_field(limits)], limits.default_topk),
    )


class SearchResult(BaseModel):
    """The search tool's structured result: the query and its hits as `/retrieve` gives them with scores."""

    query: str
    hits: list[ScoredDocument]


class FunctionSpec(BaseModel):
    name: str
    description: str
    parameters: dict[str, Any] = Field(description="JSON schema of the arguments")


class OpenAITool(BaseModel):
    """An entry of the `tools` list of OpenAI's chat completions API (function calling)."""

    type: Literal["function"] = "function"
    function: FunctionSpec


def openai_tool(limits: SearchLimits) -> OpenAITool:
    """The search tool in OpenAI's function-calling form. A framework runs a call as
    `POST /retrieve {"queries": [query], "topk": topk, "return_scores": true}`."""
    parameters = search_arguments(limits).model_json_schema()
    function = FunctionSpec(name=SEARCH_TOOL, description=SEARCH_TOOL_DESCRIPTION, parameters=parameters)
    return OpenAITool(function=function)

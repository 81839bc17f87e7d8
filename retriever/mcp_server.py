"""The retriever as an MCP server (the official `mcp` SDK), so any MCP client (Claude Desktop, an agent framework)
can search the index: a `search` tool and an `emapg://index` resource.

It holds no index: each call is forwarded to the HTTP retrieval service (one URL or replicas) by the async client,
with its token (EMAPG_RETRIEVER_TOKEN), retries and failover. The tool's arguments are checked against the
service's own limits (read from its /health at start), so a bad call is an MCP tool error naming the field, and
whatever the service still refuses comes back as a tool error with the service's message.

The tool's text is whatever `render_hits` makes of the hits (`emapg mcp` passes agent.protocol.format_hits:
Search-R1's observation text, which a model trained here reads); the retriever imports no agent code.

Transports: stdio (a desktop agent starts `emapg mcp --url ...` itself) and streamable HTTP (for remote agents:
`emapg mcp --transport http`, on 127.0.0.1 unless told otherwise; with EMAPG_MCP_TOKEN set, every request needs
`Authorization: Bearer <token>`).
"""

# No `from __future__ import annotations`: the tool's signature is built from this server's limits at run time,
# and the SDK reads parameter types from the function's annotations.

import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Annotated

from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp.types import CallToolResult, TextContent

from retriever.api import (
    SEARCH_TOOL,
    SEARCH_TOOL_DESCRIPTION,
    Hit,
    ScoredDocument,
    SearchLimits,
    SearchResult,
    query_field,
    topk_field,
)
from retriever.client import AsyncRetrieverClient, RetrieverError

MCP_TOKEN_ENV = "EMAPG_MCP_TOKEN"  # the MCP server's own token (EMAPG_RETRIEVER_TOKEN is the HTTP service's)
INDEX_RESOURCE = "emapg://index"
NO_HITS = "No passage matches the query."


class StaticTokenVerifier:
    """The SDK's bearer-token check (a `TokenVerifier`) against one shared secret, compared in constant time."""

    def __init__(self, token: str):
        self.token = token

    async def verify_token(self, token: str) -> AccessToken | None:
        if not secrets.compare_digest(token.encode(), self.token.encode()):
            return None
        return AccessToken(token=token, client_id="emapg-mcp", scopes=[])


def create_mcp_server(
    urls: str | Sequence[str],
    limits: SearchLimits,
    *,
    render_hits: Callable[[list[Hit]], str],
    http_token: str | None = None,
    timeout_s: float = 30.0,
    retries: int = 5,
) -> MCPServer:
    """An MCP server forwarding to the retrieval service at `urls`, whose limits are `limits` (its /health says).
    The tool's text content is `render_hits(hits)` (NO_HITS when there are none). `http_token`, when given, is
    required as a bearer token on the streamable HTTP transport."""
    client = AsyncRetrieverClient(urls, topk=limits.default_topk, timeout_s=timeout_s, retries=retries)

    @asynccontextmanager
    async def lifespan(_: MCPServer) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await client.aclose()

    auth = {}
    if http_token is not None:
        # The SDK's settings require an OAuth issuer URL; it is never used nor published here (no authorization
        # server, no resource metadata): the one shared token is all StaticTokenVerifier accepts.
        auth = {
            "token_verifier": StaticTokenVerifier(http_token),
            "auth": AuthSettings(issuer_url="http://127.0.0.1", resource_server_url=None),
        }
    server = MCPServer(
        "emapg-retriever",
        instructions="Passage search over an emapg retrieval index (Search-R1's protocol). Call `search` with a "
        f"question or keywords; {INDEX_RESOURCE} says what is indexed.",
        lifespan=lifespan,
        **auth,
    )

    @server.tool(name=SEARCH_TOOL, description=SEARCH_TOOL_DESCRIPTION)
    async def search(
        query: Annotated[str, query_field(limits)], topk: Annotated[int, topk_field(limits)] = limits.default_topk
    ) -> Annotated[CallToolResult, SearchResult]:
        try:
            (hits,) = await client.search([query], topk)
        except RetrieverError as e:  # the service refused the query, or no replica answered
            raise ToolError(str(e)) from e
        result = SearchResult(query=query, hits=[ScoredDocument.from_hit(h) for h in hits])
        return CallToolResult(
            content=[TextContent(type="text", text=render_hits(hits) or NO_HITS)],
            structured_content=result.model_dump(mode="json"),
        )

    @server.resource(
        INDEX_RESOURCE, name="index", mime_type="application/json",
        description="The served index: kind, encoder, number of passages, corpus checksum, search limits.",
    )
    async def index() -> str:
        try:
            return (await client.health()).model_dump_json(indent=2)
        except RetrieverError as e:
            raise ResourceError(str(e)) from e

    return server

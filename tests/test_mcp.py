"""The MCP server (`emapg mcp`) as an MCP client sees it: the SDK's own client, over stdio and streamable HTTP, against
`emapg mcp` processes forwarding to the real retrieval server (child processes on loopback ports)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from agent.protocol import format_hits
from retriever.client import RetrieverClient
from retriever.mcp_server import INDEX_RESOURCE, NO_HITS
from retriever.process import free_port, running_server, start_server

REPO = Path(__file__).resolve().parents[1]
QUESTION = "who wrote pride and prejudice"


def stdio_server(*urls: str, env: dict[str, str] | None = None) -> StdioServerParameters:
    """`emapg mcp --url ...` as a desktop agent starts it (this checkout's code: cwd is the repo root)."""
    args = ["-m", "emapg.cli", "mcp", *[a for url in urls for a in ("--url", url)]]
    return StdioServerParameters(command=sys.executable, args=args, cwd=REPO, env=env)


def retrieve(url: str, query: str, topk: int, token: str | None = None) -> list[dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"queries": [query], "topk": topk, "return_scores": True}
    return httpx.post(url + "/retrieve", json=body, headers=headers, timeout=30).json()["result"][0]


def text_of(result) -> str:
    return "\n".join(block.text for block in result.content)


async def search_session(client: Client, retriever_url: str, token: str | None = None) -> dict:
    """Everything a session checks, gathered in one connection: tools, a search, bad calls, the index resource."""
    out: dict = {"tools": (await client.list_tools()).tools}
    out["hits"] = await client.call_tool("search", {"query": QUESTION, "topk": 5})
    out["default"] = await client.call_tool("search", {"query": QUESTION})
    out["bad"] = {
        name: await client.call_tool("search", arguments)
        for name, arguments in {
            "empty": {"query": ""},
            "blank": {"query": "   "},
            "topk 0": {"query": QUESTION, "topk": 0},
            "topk over the limit": {"query": QUESTION, "topk": 51},
            "too long": {"query": "x" * 501},
            "no query": {"topk": 3},
        }.items()
    }
    out["after"] = await client.call_tool("search", {"query": QUESTION, "topk": 2})  # still serving
    out["resources"] = (await client.list_resources()).resources
    out["index"] = json.loads((await client.read_resource(INDEX_RESOURCE)).contents[0].text)
    return out


def check_session(out: dict, retriever_url: str, token: str | None = None) -> None:
    (tool,) = out["tools"]
    served = httpx.get(retriever_url + "/tool").json()["function"]
    assert tool.name == served["name"] == "search" and tool.description == served["description"]
    # One source of truth: the MCP tool's arguments are the OpenAI schema's, under the server's limits (50, 500).
    assert tool.input_schema["properties"] == served["parameters"]["properties"]
    assert tool.input_schema["required"] == served["parameters"]["required"] == ["query"]
    assert tool.input_schema["properties"]["topk"]["maximum"] == 50
    assert tool.output_schema["properties"]["hits"]["type"] == "array"

    result = out["hits"]
    assert not result.is_error, text_of(result)
    expected = retrieve(retriever_url, QUESTION, 5, token)
    assert result.structured_content == {"query": QUESTION, "hits": expected}  # the same hits, scores and order
    with RetrieverClient(retriever_url, token=token) as client:
        assert text_of(result) == format_hits(client.search([QUESTION], 5)[0])
    assert text_of(result).startswith("Doc 1(Title: Pride and Prejudice) ")
    assert len(out["default"].structured_content["hits"]) == 3  # the retriever's default topk

    bad = out["bad"]
    assert all(r.is_error for r in bad.values()), {k: text_of(r) for k, r in bad.items() if not r.is_error}
    assert "query" in text_of(bad["empty"]) and "at least 1 character" in text_of(bad["empty"])
    assert "query is empty" in text_of(bad["blank"])  # refused by the retrieval service, passed on
    assert "topk" in text_of(bad["topk 0"]) and "greater than or equal to 1" in text_of(bad["topk 0"])
    assert "topk" in text_of(bad["topk over the limit"]) and "less than or equal to 50" in text_of(
        bad["topk over the limit"])
    assert "at most 500 characters" in text_of(bad["too long"])
    assert "query" in text_of(bad["no query"]) and "Field required" in text_of(bad["no query"])
    assert not out["after"].is_error and len(out["after"].structured_content["hits"]) == 2

    (resource,) = out["resources"]
    assert str(resource.uri) == INDEX_RESOURCE and resource.mime_type == "application/json"
    health = httpx.get(retriever_url + "/health").json()
    index = out["index"]
    assert {k: index[k] for k in ("kind", "num_docs", "encoder", "corpus_sha256", "limits")} == {
        k: health[k] for k in ("kind", "num_docs", "encoder", "corpus_sha256", "limits")
    }
    assert index["num_docs"] > 400 and index["limits"]["max_query_chars"] == 500


def test_stdio_lists_searches_refuses_bad_arguments_and_describes_the_index(server_url):
    dead = f"http://127.0.0.1:{free_port()}"  # a replica that is down: the client fails over from it

    async def main():
        async with Client(stdio_server(dead, server_url)) as client:
            return await search_session(client, server_url)

    check_session(asyncio.run(main()), server_url)


def test_no_hits_in_words_and_a_retriever_gone_mid_session_is_a_tool_error(bm25_index_dir):
    server = start_server(bm25_index_dir)
    try:

        async def session():
            params = stdio_server(server.url)
            params.args += ["--retries", "0", "--timeout-s", "5"]
            async with Client(params) as client:
                nothing = await client.call_tool("search", {"query": "qqqzzzxxx"})  # no term in the corpus
                before = await client.call_tool("search", {"query": "Pride and Prejudice"})
                server.stop()
                after = await client.call_tool("search", {"query": "Pride and Prejudice"})
                return nothing, before, after

        nothing, before, after = asyncio.run(session())
    finally:
        server.stop()
    assert not nothing.is_error and nothing.structured_content["hits"] == [] and text_of(nothing) == NO_HITS
    assert not before.is_error and text_of(before).startswith("Doc 1(Title: Pride and Prejudice)")
    assert after.is_error and f"{server.url}/retrieve unavailable after 1 attempts" in text_of(after)


def test_mcp_refuses_to_start_without_a_retriever():
    dead = f"http://127.0.0.1:{free_port()}"
    run = subprocess.run([sys.executable, "-m", "emapg.cli", "mcp", "--url", dead], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""  # stdout is the MCP channel: errors go to stderr
    assert f"{dead}/health unavailable" in " ".join(run.stderr.split())
    run = subprocess.run([sys.executable, "-m", "emapg.cli", "mcp", "--url", dead, "--transport", "sse"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--transport must be 'stdio' or 'http', got 'sse'" in run.stderr


# --- streamable HTTP ---------------------------------------------------------------------------------------------


@contextmanager
def mcp_over_http(*args: str, env: dict[str, str]) -> Iterator[str]:
    """`emapg mcp --transport http` on a free loopback port; yields its endpoint once it accepts connections."""
    port = free_port()
    cmd = [sys.executable, "-m", "emapg.cli", "mcp", "--transport", "http", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"emapg mcp exited with {proc.returncode}"
            try:
                httpx.get(endpoint, timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "emapg mcp did not start listening"
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def http_client(endpoint: str, token: str | None) -> Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return Client(streamable_http_client(endpoint, http_client=httpx2.AsyncClient(headers=headers, timeout=60)))


@pytest.fixture(scope="module")
def retriever_with_token(bm25_index_dir):
    """A real retriever that wants a token (BM25: quick to start)."""
    with running_server(bm25_index_dir, "--max-topk", "50", "--max-query-chars", "500",
                        env={"EMAPG_RETRIEVER_TOKEN": "retriever-secret"}) as url:
        yield url


def test_http_transport_needs_the_token_and_forwards_the_retrievers(retriever_with_token):
    env = {"EMAPG_MCP_TOKEN": "mcp-secret", "EMAPG_RETRIEVER_TOKEN": "retriever-secret"}
    with mcp_over_http("--url", retriever_with_token, env=env) as endpoint:
        initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer retriever-secret"}):
            refused = httpx.post(endpoint, json=initialize, headers=headers, timeout=10)
            assert refused.status_code == 401, (headers, refused.text)

        async def main():
            async with http_client(endpoint, "mcp-secret") as client:
                return await search_session(client, retriever_with_token, "retriever-secret")

        out = asyncio.run(main())
    check_session(out, retriever_with_token, "retriever-secret")


def test_http_transport_without_a_token_is_open_on_loopback(server_url):
    with mcp_over_http("--url", server_url, env={"EMAPG_MCP_TOKEN": ""}) as endpoint:
        assert endpoint.startswith("http://127.0.0.1:")

        async def main():
            async with http_client(endpoint, None) as client:
                return await client.call_tool("search", {"query": QUESTION, "topk": 4})

        result = asyncio.run(main())
    assert not result.is_error and result.structured_content["hits"] == retrieve(server_url, QUESTION, 4)

"""The retrieval service's typed contract (retriever/api.py): declared in /openapi.json, what the real server sends,
what the client parses, the OpenAI tool schema (`GET /tool`, `emapg tool-schema`); and the import boundaries."""

from __future__ import annotations

import ast
import asyncio
import json
from pathlib import Path

import httpx
import jsonschema
import pytest
from typer.testing import CliRunner

from emapg.cli import app
from retriever.api import (
    ErrorResponse,
    Health,
    RetrieveResponse,
    ScoredRetrieveResponse,
    SearchLimits,
    openai_tool,
)
from retriever.client import AsyncRetrieverClient, RetrieverClient, RetrieverError

REPO = Path(__file__).resolve().parents[1]
QUESTION = "who wrote pride and prejudice"
# conftest's server runs with --max-queries 300 --max-query-chars 500 --max-topk 50
FIXTURE_LIMITS = SearchLimits(default_topk=3, max_topk=50, max_queries=300, max_query_chars=500)


def schema_ref(op: dict, status: str) -> dict:
    return op["responses"][status]["content"]["application/json"]["schema"]


def test_openapi_declares_the_response_schemas(server_url):
    spec = httpx.get(server_url + "/openapi.json").json()
    retrieve = spec["paths"]["/retrieve"]["post"]
    assert retrieve["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/RetrieveRequest"}
    assert schema_ref(retrieve, "200")["anyOf"] == [
        {"$ref": "#/components/schemas/ScoredRetrieveResponse"}, {"$ref": "#/components/schemas/RetrieveResponse"}]
    for status in ("401", "422"):
        assert schema_ref(retrieve, status) == {"$ref": "#/components/schemas/ErrorResponse"}
    assert schema_ref(spec["paths"]["/health"]["get"], "200") == {"$ref": "#/components/schemas/Health"}
    assert schema_ref(spec["paths"]["/tool"]["get"], "200") == {"$ref": "#/components/schemas/OpenAITool"}
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    # The declared schemas are the api models' own (FastAPI leaves out a `"default": null`).
    for model in (ScoredRetrieveResponse, RetrieveResponse, Health, ErrorResponse):
        declared = spec["components"]["schemas"][model.__name__]
        own = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
        assert without_defaults(declared["properties"]) == without_defaults(own["properties"])
        assert declared.get("required") == own.get("required")


def without_defaults(properties: dict) -> dict:
    return {name: {k: v for k, v in schema.items() if k != "default"} for name, schema in properties.items()}


def test_the_real_servers_answers_are_the_declared_models(server_url):
    def post(body: dict) -> httpx.Response:
        return httpx.post(server_url + "/retrieve", json=body, timeout=30)

    scored = post({"queries": [QUESTION, "jane austen"], "topk": 5, "return_scores": True})
    parsed = ScoredRetrieveResponse.model_validate_json(scored.content)
    assert [len(hits) for hits in parsed.result] == [5, 5]
    assert parsed.result[0][0].document.contents.startswith('"Pride and Prejudice"\n')
    # Byte-compatible with what the server sent before the models (Python's json, compact, UTF-8 as is).
    assert scored.content == json.dumps(scored.json(), ensure_ascii=False, separators=(",", ":")).encode()
    plain = post({"queries": [QUESTION], "topk": 5})
    assert RetrieveResponse.model_validate_json(plain.content).result[0] == [h.document for h in parsed.result[0]]
    assert plain.content == json.dumps(plain.json(), ensure_ascii=False, separators=(",", ":")).encode()

    refused = post({"queries": [QUESTION], "topk": 51})
    error = ErrorResponse.model_validate_json(refused.content)
    assert refused.status_code == 422 and error.message == "topk: topk must be between 1 and 50, got 51"

    health = Health.model_validate_json(httpx.get(server_url + "/health").content)
    assert health.kind == "dense" and health.num_docs > 400 and health.limits == FIXTURE_LIMITS
    assert len(health.corpus_sha256) == 64


def test_clients_read_health_through_the_model(server_url):
    with RetrieverClient(server_url) as client:
        health = client.health()

    async def read():
        async with AsyncRetrieverClient(server_url) as client:
            return await client.health()

    # The cache and the process's memory move between two reads; the rest is the same answer.
    assert health == asyncio.run(read()).model_copy(update={"cache_entries": health.cache_entries,
                                                            "memory": health.memory})
    assert health.memory is not None and health.memory.rss_bytes > 0
    assert health.limits == FIXTURE_LIMITS and health.encoder == "sentence-transformers/all-MiniLM-L6-v2"


def fake_answer(body) -> httpx.Response:
    """A fake server answer, for the client's parsing only."""
    return httpx.Response(200, json=body)


def parsed_by_client(body):
    exchange = RetrieverClient("http://a.invalid")._exchange()
    next(exchange)
    with pytest.raises(StopIteration) as done:
        exchange.send(fake_answer(body))
    return done.value.value


def test_client_takes_search_r1_integer_ids_and_refuses_bodies_that_are_not_the_model():
    (hits,) = parsed_by_client({"result": [[{"document": {"id": 7, "contents": '"T"\nx', "title": "T"}, "score": 1}]]})
    assert hits[0].id == "7" and hits[0].score == 1.0  # Search-R1's server sends its corpus rows' extra fields too
    for body in ({"result": [[{"id": "1", "contents": "x"}]]}, {"results": []}, [1, 2]):
        with pytest.raises(RetrieverError, match="returned a body that is not a ScoredRetrieveResponse"):
            parsed_by_client(body)


def test_get_tool_and_tool_schema_command_give_the_schema_under_the_servers_limits(server_url):
    served = httpx.get(server_url + "/tool").json()
    assert served == openai_tool(FIXTURE_LIMITS).model_dump(mode="json")
    assert served["type"] == "function" and served["function"]["name"] == "search"
    result = CliRunner().invoke(app, ["tool-schema", "--url", server_url])
    assert result.exit_code == 0 and json.loads(result.output) == served
    default = json.loads(CliRunner().invoke(app, ["tool-schema"]).output)
    assert default["function"]["parameters"]["properties"]["topk"]["maximum"] == 100  # the default limits
    refused = CliRunner().invoke(app, ["tool-schema", "--url", "127.0.0.1:8000"])
    assert refused.exit_code == 2 and "--url: retriever url '127.0.0.1:8000' must start with http://" in " ".join(
        refused.output.split())

    # A framework can check a model's call with any JSON-schema validator, then run it as POST /retrieve.
    parameters = served["function"]["parameters"]
    jsonschema.validate({"query": QUESTION, "topk": 5}, parameters)
    for bad in ({"query": ""}, {"query": "x", "topk": 51}, {"query": "x", "top_k": 3}, {"topk": 3}, {"query": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, parameters)
    call = {"query": QUESTION, "topk": 5}
    r = httpx.post(server_url + "/retrieve", json={"queries": [call["query"]], "topk": call["topk"]}, timeout=30)
    assert r.status_code == 200 and len(r.json()["result"][0]) == 5


# --- import boundaries -----------------------------------------------------------------------------------------------

SERVER_SIDE = {"retriever.docstore", "retriever.server"}
# The `serve` command runs the server, and the server's own tests configure it; nothing else reaches past the client.
# test_index_kinds.py serves a fake backend (defined in the test) through the server's own app, in its process;
# test_tuning.py reads the tuned search parameters back from the server's /health the same way.
MAY_IMPORT_THE_SERVER = {"emapg/cli_retriever.py", "tests/test_server.py", "tests/test_index_kinds.py",
                         "tests/test_tuning.py"}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function (`from a import b` counts as a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def python_files(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((REPO / folder).rglob("*.py"))]


def test_nothing_outside_retriever_imports_the_server_side():
    outside = python_files("agent", "trainer", "eval", "data", "emapg", "benchmarks", "tests")
    assert len(outside) > 40
    offenders = {}
    for path in outside:
        name = str(path.relative_to(REPO))
        reached = imported_modules(path) & SERVER_SIDE
        if name in MAY_IMPORT_THE_SERVER:
            reached -= {"retriever.server"}
        if reached:
            offenders[name] = sorted(reached)
    assert offenders == {}


def test_retriever_modules_import_each_other_without_a_cycle():
    graph = {
        f"retriever.{p.stem}": {m for m in imported_modules(p) if m.startswith("retriever.")}
        for p in python_files("retriever")
    }
    graph = {module: {m for m in imports if m in graph} for module, imports in graph.items()}
    assert "retriever.index" in graph["retriever.server"] and "retriever.build" in graph["retriever.dense"]

    def cycle_from(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        for dep in sorted(graph[module]):
            if (found := cycle_from(dep, path + [module])) is not None:
                return found
        return None

    assert {module: cycle_from(module, []) for module in graph} == {module: None for module in graph}

"""The real server (child process, free loopback port) against Search-R1's schema, its limits and concurrency."""

import concurrent.futures

import httpx
import pytest

QUESTION = "who wrote pride and prejudice"


def post(url, body=None, **kwargs):
    return httpx.post(url + "/retrieve", json=body, timeout=30, **kwargs)


def test_search_r1_schema_with_scores(server_url):
    r = post(server_url, {"queries": [QUESTION, "jane austen"], "topk": 3, "return_scores": True})
    assert r.status_code == 200
    result = r.json()["result"]
    assert len(result) == 2 and all(len(hits) == 3 for hits in result)
    top = result[0][0]
    assert set(top) == {"document", "score"} and set(top["document"]) == {"id", "contents"}
    assert top["document"]["contents"].startswith('"Pride and Prejudice"\n')
    scores = [h["score"] for h in result[0]]
    assert scores == sorted(scores, reverse=True)


def test_search_r1_schema_without_scores_and_default_topk(server_url):
    r = post(server_url, {"queries": [QUESTION], "topk": None, "return_scores": False})
    assert r.status_code == 200
    (hits,) = r.json()["result"]
    assert len(hits) == 3  # the server's default topk
    assert all(set(h) == {"id", "contents"} for h in hits)
    r = post(server_url, {"queries": [QUESTION]})  # both optional fields omitted
    assert r.status_code == 200 and r.json()["result"][0] == hits


BAD_BODIES = [
    ({"queries": []}, "queries"),
    ({"queries": ["x"] * 301}, "queries"),
    ({"queries": ["x" * 501]}, "queries.0"),
    ({"queries": ["ok", "   "]}, "queries.1"),
    ({"queries": ["x"], "topk": 0}, "topk"),
    ({"queries": ["x"], "topk": 51}, "topk"),
    ({"queries": ["x"], "topk": "3"}, "topk"),
    ({"queries": ["x"], "topk": True}, "topk"),
    ({"queries": "just a string"}, "queries"),
    ({"queries": [1, 2]}, "queries.0"),
    ({"queries": ["x"], "return_scores": "yes"}, "return_scores"),
    ({"queries": ["x"], "top_k": 5}, "top_k"),
    ({}, "queries"),
    ([1, 2, 3], "body"),
]


@pytest.mark.parametrize("body,field", BAD_BODIES)
def test_bad_input_gets_422_naming_the_field_and_the_server_keeps_serving(server_url, body, field):
    r = post(server_url, body)
    assert r.status_code == 422, r.text
    assert r.json()["message"].startswith(field), r.json()
    assert post(server_url, {"queries": [QUESTION]}).status_code == 200


def test_malformed_json_gets_422(server_url):
    r = httpx.post(server_url + "/retrieve", content=b'{"queries": ["x"', headers={"content-type": "application/json"})
    assert r.status_code == 422 and "JSON" in r.json()["message"]


def test_64_concurrent_clients_each_get_what_a_direct_search_gives(server_url, dense_index):
    store = dense_index.docstore
    questions = [f"tell me about {store.get(i).title}" for i in range(64)]
    direct = dense_index.search(questions, 5)

    def one(q):
        return post(server_url, {"queries": [q], "topk": 5, "return_scores": True}).json()["result"][0]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        served = list(pool.map(one, questions))
    for want, got in zip(direct, served, strict=True):
        assert [h["document"]["id"] for h in got] == [h.id for h in want]
        assert [h["document"]["contents"] for h in got] == [h.contents for h in want]
        assert all(abs(h["score"] - w.score) < 1e-4 for h, w in zip(got, want, strict=True))


def test_health_and_metrics(server_url):
    health = httpx.get(server_url + "/health").json()
    assert health["status"] == "ok" and health["index_loaded"] and health["num_docs"] > 400
    assert health["encoder"] == "sentence-transformers/all-MiniLM-L6-v2"
    memory = health["memory"]  # this process's; the index is memory-mapped (tests/test_shared_index_memory.py)
    assert memory["rss_bytes"] >= memory["private_bytes"] > 0 and memory["pss_bytes"] > 0
    assert [f["name"] for f in memory["index_files"]] == ["index.faiss"]
    post(server_url, {"queries": [QUESTION, QUESTION]})
    text = httpx.get(server_url + "/metrics").text
    for name in ["emapg_retriever_requests_total", "emapg_retriever_queries_total", "emapg_retriever_cache_hits_total",
                 "emapg_retriever_batch_queries_bucket", "emapg_retriever_request_seconds_bucket",
                 "emapg_retriever_memory_rss_bytes", "emapg_retriever_memory_pss_bytes",
                 "emapg_retriever_memory_private_bytes", 'emapg_retriever_index_file_resident_bytes{file="index.faiss"}']:
        assert name in text
    assert httpx.get(server_url + "/docs").status_code == 200
    assert "/retrieve" in httpx.get(server_url + "/openapi.json").json()["paths"]


def test_bearer_token(dense_index_dir, monkeypatch):
    from retriever.client import RetrieverClient
    from retriever.process import running_server

    with running_server(dense_index_dir, env={"EMAPG_RETRIEVER_TOKEN": "s3cret"}) as url:
        assert post(url, {"queries": ["x"]}).status_code == 401
        assert post(url, {"queries": ["x"]}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/health").status_code == 200  # for load balancers and docker healthchecks
        ok = post(url, {"queries": ["x"]}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        monkeypatch.setenv("EMAPG_RETRIEVER_TOKEN", "s3cret")  # a run in the server's environment sends its token
        with RetrieverClient(url, retries=0) as client:
            assert len(client.search(["x"])[0]) > 0


def test_binds_to_loopback_by_default():
    from retriever.server import ServerSettings

    assert ServerSettings(index=".").host == "127.0.0.1"


def test_access_log_is_off_unless_asked_for(dense_index_dir, tmp_path):
    """One line per request is off by default (/metrics counts requests); `--access-log` turns it on."""
    from retriever.process import running_server

    for extra, expected in (((), False), (("--access-log",), True)):
        log = tmp_path / f"server{len(extra)}.log"
        with running_server(dense_index_dir, *extra, log=log) as url:
            assert post(url, {"queries": ["x"]}).status_code == 200
        assert ('"POST /retrieve HTTP/1.1" 200' in log.read_text()) is expected


def test_bm25_health_reports_the_files_it_memory_maps(bm25_index_dir):
    """bm25s memory-maps its arrays: /health names them (and has no FAISS search parameters)."""
    from fastapi.testclient import TestClient

    from retriever.index import load_index
    from retriever.server import ServerSettings, create_app

    index = load_index(bm25_index_dir)
    with TestClient(create_app(index, ServerSettings(index=bm25_index_dir))) as client:
        health = client.get("/health").json()
        assert client.post("/retrieve", json={"queries": ["Jane Austen"]}).status_code == 200
    assert health["kind"] == "bm25" and health["search_params"] is None
    names = [f["name"] for f in health["memory"]["index_files"]]
    assert names and all(n.startswith("bm25/") and n.endswith(".npy") for n in names)

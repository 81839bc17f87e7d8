"""Retriever replicas: round-robin, failover from a failed replica, its cool-off, `emapg serve --workers`, and a
multi-turn rollout that keeps going when a replica is killed in the middle of it.

The policy unit tests drive the client's I/O-free exchange with fake answers; every other test uses real servers.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
from conftest import memorise_search_trajectory

from agent.backend import SamplingParams
from agent.hf_backend import TransformersBackend
from agent.rollout import SEARCH_FAILED, SearchAgent
from agent.settings import RolloutSettings
from data.qa import QAExample
from retriever.client import (
    AsyncRetrieverClient,
    RetrieverClient,
    RetrieverError,
    RetrieverUnavailable,
)
from retriever.process import free_port, running_server, start_server

A, B, C = "http://a.invalid", "http://b.invalid", "http://c.invalid"


# --- the policy, without I/O --------------------------------------------------------------------------------------


def fake_answer(status: int = 200, body: dict | None = None) -> httpx.Response:
    """A fake server answer, for the unit tests of the retry policy only."""
    body = body if body is not None else {"result": [[{"document": {"id": "1", "contents": '"T"\nx'}, "score": 1.0}]]}
    return httpx.Response(status, json=body)


def run_exchange(client, outcomes: list) -> tuple[list[tuple[float, str]], object]:
    """One request's exchange fed these outcomes in turn: the (delay, base URL) of each attempt, and its result."""
    exchange = client._exchange()
    attempts = [next(exchange)]
    for outcome in outcomes:
        try:
            attempts.append(exchange.send(outcome))
        except StopIteration as done:
            return [(d, e.removesuffix("/retrieve")) for d, e in attempts], done.value
    raise AssertionError(f"the exchange wants more outcomes after {attempts}")


def first_replica_asked(client) -> str:
    attempts, _ = run_exchange(client, [fake_answer()])
    return attempts[0][1]


def test_requests_take_turns_over_the_replicas():
    client = RetrieverClient([A, B, C])
    assert [first_replica_asked(client) for _ in range(5)] == [A, B, C, A, B]


def test_a_failed_replica_is_left_at_once_and_skipped_while_it_cools_off():
    client = RetrieverClient([A, B, C], cooloff_s=60)
    attempts, hits = run_exchange(client, [httpx.ConnectError("refused"), fake_answer()])
    assert attempts == [(0.0, A), (0.0, B)] and hits[0][0].id == "1"  # the next replica at once, no backoff
    assert [first_replica_asked(client) for _ in range(4)] == [C, B, C, B]  # B and C share A's turns

    client = RetrieverClient([A, B], cooloff_s=0.01)
    run_exchange(client, [httpx.ReadTimeout("slow"), fake_answer()])
    time.sleep(0.05)
    assert [first_replica_asked(client) for _ in range(2)] == [B, A]  # back in turn after its cool-off


def test_5xx_fails_over_but_4xx_is_the_callers_mistake():
    client = RetrieverClient([A, B])
    attempts, _ = run_exchange(client, [fake_answer(503), fake_answer()])
    assert [url for _, url in attempts] == [A, B]
    exchange = client._exchange()
    next(exchange)
    with pytest.raises(RetrieverError, match="refused the request \\(422\\): topk: too big"):
        exchange.send(fake_answer(422, {"message": "topk: too big"}))


def test_every_replica_failing_backs_off_between_rounds_then_names_every_url():
    client = RetrieverClient([A, B], retries=2, backoff_s=0.25)
    exchange = client._exchange()
    attempts = [next(exchange)]
    with pytest.raises(RetrieverUnavailable) as failure:
        while True:
            attempts.append(exchange.send(httpx.ConnectError("refused")))
    assert [delay for delay, _ in attempts] == [0.0, 0.0, 0.25, 0.0, 0.5, 0.0]  # backoff only after a whole round
    assert sorted(e for _, e in attempts) == sorted([f"{A}/retrieve", f"{B}/retrieve"] * 3)
    message = str(failure.value)
    assert f"retriever at {A}/retrieve, {B}/retrieve unavailable after 6 attempts" in message
    assert f"{A}/retrieve: ConnectError: refused" in message and f"{B}/retrieve: ConnectError: refused" in message


@pytest.mark.parametrize(("urls", "error"), [
    ([], "give at least one URL"),
    (["127.0.0.1:8000"], "'127.0.0.1:8000' must start with http://"),
    ([A, A + "/"], "name a replica twice"),
])
def test_bad_replica_lists_are_refused_naming_the_url(urls, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        RetrieverClient(urls)


# --- real replicas ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(bm25_index_dir, tmp_path_factory):
    """Two real BM25 servers over the same index."""
    logs = tmp_path_factory.mktemp("replica-logs")
    servers = [start_server(bm25_index_dir, log=logs / f"replica{i}.log") for i in range(2)]
    yield [s.url for s in servers]
    for s in servers:
        s.stop()


def requests_answered(url: str) -> int:
    """The server's own count of /retrieve requests it answered with 200, from its Prometheus /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    match = re.search(r'^emapg_retriever_requests_total\{status="200"\} (\S+)$', text, re.MULTILINE)
    return int(float(match.group(1))) if match else 0


def test_real_replicas_share_the_requests_round_robin(replicas):
    before = [requests_answered(u) for u in replicas]
    with RetrieverClient(replicas, topk=2) as client:
        results = [client.search([f"question {i} about novels"])[0] for i in range(6)]
    assert all(len(hits) == 2 for hits in results)
    assert [requests_answered(u) - b for u, b in zip(replicas, before, strict=True)] == [3, 3]


def test_sync_and_async_clients_fail_over_from_a_dead_replica(replicas):
    dead = f"http://127.0.0.1:{free_port()}"
    questions = ["who wrote pride and prejudice", "jane austen", "a city in england"]
    with RetrieverClient(replicas[0]) as alone:
        expected = [[h.id for h in hits] for hits in alone.search(questions)]
    with RetrieverClient([dead, replicas[0]], retries=0, max_queries_per_request=1) as client:
        assert [[h.id for h in hits] for hits in client.search(questions)] == expected

    async def search_async():
        async with AsyncRetrieverClient([dead, replicas[0]], retries=0, max_queries_per_request=1) as client:
            return await client.search(questions)

    assert [[h.id for h in hits] for hits in asyncio.run(search_async())] == expected


def test_dead_replicas_raise_unavailable_naming_every_url():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    every_url = f"{dead[0]}/retrieve, {dead[1]}/retrieve unavailable after 4 attempts"
    unavailable = pytest.raises(RetrieverUnavailable, match=every_url)
    with RetrieverClient(dead, retries=1, backoff_s=0.01) as client, unavailable:
        client.search(["x"])


def test_a_config_url_list_reaches_the_client(replicas):
    from emapg.session import connect_retriever, index_tag
    from retriever.api import Health
    from trainer.config import load_config

    cfg = load_config(None, [f"retriever.url=[{replicas[0]},{replicas[1]}]"])
    with connect_retriever(cfg) as (client, tag):
        assert client.urls == replicas
        assert tag == index_tag(Health.model_validate(httpx.get(replicas[1] + "/health").json()))
        assert client.search(["pride and prejudice"])[0][0].contents.startswith('"Pride and Prejudice"')


def test_replicas_of_different_indexes_are_refused(replicas, small_corpus, tmp_path):
    from emapg.session import served_index_tag
    from retriever.bm25 import build_bm25_index

    lines = small_corpus.read_text().splitlines(keepends=True)
    (tmp_path / "smaller.jsonl").write_text("".join(lines[:50]))
    build_bm25_index(tmp_path / "smaller.jsonl", tmp_path / "smaller")
    dead = f"http://127.0.0.1:{free_port()}"
    assert served_index_tag([dead, *replicas]) == served_index_tag(replicas[:1])  # a replica that is down is skipped
    with running_server(tmp_path / "smaller") as other, pytest.raises(ValueError, match="different indexes") as refused:
        served_index_tag([*replicas, other])
    message = str(refused.value)
    assert f"{replicas[0]} has bm25-bm25-bm25-" in message and f"{other} has bm25-bm25-bm25-50" in message


def test_serve_with_two_worker_processes(bm25_index_dir, tmp_path):
    log = tmp_path / "server.log"
    with running_server(bm25_index_dir, "--workers", "2", log=log) as url, RetrieverClient(url) as client:
        (hits,) = client.search(["Pride and Prejudice"])
        assert hits[0].contents.startswith('"Pride and Prejudice"')
    started = set(re.findall(r"Started server process \[(\d+)\]", log.read_text()))
    assert len(started) == 2, log.read_text()  # two processes, each loaded the index and served the port


def test_cli_takes_replica_urls_and_checks_them(replicas, tmp_path, dense_index_dir):
    from typer.testing import CliRunner

    from emapg.cli import app

    def invoke(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(app, list(args))
        return result.exit_code, " ".join(result.output.split())

    dead = f"http://127.0.0.1:{free_port()}"
    code, out = invoke("search", "pride and prejudice", "--url", dead, "--url", replicas[0])
    assert code == 0 and "Pride and Prejudice" in out, out
    code, out = invoke("eval", "--retriever-url", replicas[0], "--retriever-url", "127.0.0.1:1")
    assert code == 2 and "--retriever-url: retriever url '127.0.0.1:1' must start with http://" in out
    code, out = invoke("serve", "--index", str(tmp_path), "--workers", "2")  # refused before any worker starts
    assert code == 2 and "not an index folder" in out
    code, out = invoke("serve", "--index", str(dense_index_dir), "--encoder", "e5-base-v2", "--workers", "2")
    assert code == 2 and "encoder mismatch on name" in out


# --- acceptance: a replica killed in the middle of a multi-turn rollout -------------------------------------------

QUESTION = QAExample("nq/test/0", "nq", "test", "who wrote pride and prejudice?", ("Jane Austen",), "t")
SEARCHES = ["pride and prejudice", "jane austen"]


@pytest.fixture(scope="module")
def two_search_model(tiny_model, tokenizer, replicas):
    """The tiny random model after memorising one real trajectory with two searches (search -> real <information>
    -> search -> real <information> -> answer), so greedy decoding searches twice through the real servers."""
    return memorise_search_trajectory(tiny_model, tokenizer, replicas[0], QUESTION.question, SEARCHES, "Jane Austen",
                                      RolloutSettings().max_obs_tokens)


class KillsReplicaBeforeTurn:
    """The real generation backend, passed through; when generation of turn `turn` starts, it records how many
    requests `replica` has answered (the earlier turns' searches) and kills it (SIGKILL, no goodbye)."""

    def __init__(self, backend, replica, turn: int):
        self.backend, self.replica, self.turn = backend, replica, turn
        self.calls = 0
        self.answered_before_kill: int | None = None

    def generate(self, prompts, params, stop, rows=None):
        self.calls += 1
        if self.calls == self.turn:
            self.answered_before_kill = requests_answered(self.replica.url)
            self.replica.proc.kill()
            self.replica.proc.wait()
        return self.backend.generate(prompts, params, stop, rows=rows)


def test_rollout_survives_a_replica_killed_mid_rollout(two_search_model, tokenizer, bm25_index_dir, tmp_path):
    doomed = start_server(bm25_index_dir, log=tmp_path / "doomed.log")
    survivor = None
    try:
        survivor = start_server(bm25_index_dir, log=tmp_path / "survivor.log")
        backend = KillsReplicaBeforeTurn(TransformersBackend(two_search_model, tokenizer), doomed, turn=2)
        # One query per request: each turn's 4 searches are 4 requests, dealt round-robin (the doomed one first).
        with RetrieverClient([doomed.url, survivor.url], max_queries_per_request=1, timeout_s=30) as client:
            agent = SearchAgent(backend, tokenizer, client, RolloutSettings(max_turns=2, max_tokens_per_turn=16))
            trajectories = agent.rollout([QUESTION], SamplingParams(temperature=0), samples_per_example=4)
        survivor_answered = requests_answered(survivor.url)
        with RetrieverClient(survivor.url) as client:
            expected = {query: [h.id for h in hits] for query, hits in zip(SEARCHES, client.search(SEARCHES))}
    finally:
        doomed.stop()
        if survivor is not None:
            survivor.stop()

    assert doomed.proc.returncode == -9 and backend.answered_before_kill == 2  # it served turn 1, then died
    assert survivor_answered == 2 + 4  # its own turn-1 share, then every turn-2 search
    assert len(trajectories) == 4 and all(expected.values())  # none lost; both searches find documents
    for traj in trajectories:
        assert [t.kind for t in traj.turns] == ["search", "search", "answer"] and traj.answer == "Jane Austen"
        for turn, query in zip(traj.turns, SEARCHES, strict=False):
            assert turn.query == query and turn.retrieval_error is None and turn.doc_ids == expected[query]
            observation = tokenizer.decode(traj.response_ids[turn.end : turn.observation_end])
            assert observation.startswith("\n\n<information>Doc 1(Title: ") and SEARCH_FAILED not in observation

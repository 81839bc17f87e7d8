import threading
import time

import httpx
import pytest

from retriever.client import AsyncRetrieverClient, RetrieverClient, RetrieverError, RetrieverUnavailable
from retriever.process import free_port, running_server


def test_sync_and_async_clients_batch_and_agree(server_url):
    questions = [f"question number {i} about novels" for i in range(25)]
    with RetrieverClient(server_url, topk=2, max_queries_per_request=10) as client:
        sync = client.search(questions)
    assert len(sync) == 25 and all(len(h) == 2 for h in sync)

    import asyncio

    async def main():
        async with AsyncRetrieverClient(server_url, topk=2, max_queries_per_request=7) as client:
            return await client.search(questions)

    assert [[h.id for h in hits] for hits in asyncio.run(main())] == [[h.id for h in hits] for hits in sync]


def rejected_requests(url: str) -> float:
    """The server's count of /retrieve requests it answered 422 (Prometheus text from /metrics)."""
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith('emapg_retriever_requests_total{status="422"}'):
            return float(line.split()[-1])
    return 0.0


def test_client_error_is_raised_at_once_with_the_servers_message(server_url):
    before = rejected_requests(server_url)
    with RetrieverClient(server_url, retries=5, backoff_s=0.01) as client:
        with pytest.raises(RetrieverError, match="topk"):
            client.search(["x"], topk=10_000)
    assert rejected_requests(server_url) == before + 1  # sent once: a 4xx is not retried


def test_unreachable_server_error_names_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    with RetrieverClient(url, retries=2, backoff_s=0.01, timeout_s=1) as client:
        with pytest.raises(RetrieverUnavailable, match=f"{url}/retrieve unavailable after 3 attempts"):
            client.search(["x"])


def test_client_retries_through_a_server_restart(dense_index_dir):
    port = free_port()
    with running_server(dense_index_dir, port=port):
        pass  # started once and stopped: the port is now dead
    result: dict = {}

    def call():
        with RetrieverClient(f"http://127.0.0.1:{port}", retries=12, backoff_s=0.25, timeout_s=5) as client:
            result["hits"] = client.search(["who wrote pride and prejudice"])

    caller = threading.Thread(target=call)
    caller.start()  # fails its first attempts while the server is down
    time.sleep(0.5)
    with running_server(dense_index_dir, port=port):
        caller.join(timeout=120)
    assert result["hits"][0][0].contents.startswith('"Pride and Prejudice"')

"""`emapg serve --workers 2` holds one copy of the index, not two: each worker memory-maps the FAISS file, so after
both have searched all of it (a Flat search reads every vector) its pages are in each worker's RSS but in neither's
private memory. Read from /proc/<pid>/smaps of the real worker processes, and from their own /health and /metrics.

The index is ~48 MB of random unit vectors (a corpus of numbered passages, the real MiniLM encoder's manifest):
large enough to stand out from allocator noise, small enough for seconds. A whole worker's private memory is
dominated by the encoder's weights (~90 MB each, private by nature), so the per-process check is that RSS minus
private memory covers the index, i.e. the index is among the shared pages.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from retriever.memory import process_memory, processes_mapping
from retriever.process import start_server

NUM_VECTORS = 32_768  # x 384 dims x 4 bytes = 48 MiB


@pytest.fixture(scope="module")
def random_flat_index(tmp_path_factory) -> Path:
    from retriever.dense import build_dense_from_vectors
    from retriever.encoder import Encoder, resolve_encoder
    from retriever.manifest import encoder_manifest

    folder = tmp_path_factory.mktemp("shared")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"Passage {i}"\nnumber {i}'}) + "\n"
                              for i in range(NUM_VECTORS)))
    encoder = encoder_manifest(Encoder(resolve_encoder("minilm")))
    rng = np.random.default_rng(0)

    def chunks():
        for _ in range(NUM_VECTORS // 4096):
            x = rng.standard_normal((4096, encoder.dim)).astype(np.float32)
            yield x / np.linalg.norm(x, axis=1, keepdims=True)

    build_dense_from_vectors(corpus, folder / "index", chunks(), encoder=encoder, factory="Flat")
    return folder / "index"


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="reads Linux's /proc/<pid>/smaps_rollup")
def test_two_workers_share_one_copy_of_a_memory_mapped_index(random_flat_index):
    faiss_file = random_flat_index / "index.faiss"
    size = faiss_file.stat().st_size
    server = start_server(random_flat_index, "--workers", "2", "--cache-size", "0")
    try:
        deadline = time.monotonic() + 60
        while len(workers := processes_mapping(server.proc.pid, faiss_file)) < 2:
            assert time.monotonic() < deadline, "two workers did not map the index"
            time.sleep(0.5)

        def index_memory(pid):
            (mapped,) = process_memory(pid, {"index.faiss": faiss_file}).index_files
            return mapped

        seen_pids = set()
        while min(index_memory(p).resident_bytes for p in workers) < 0.95 * size:  # until each has searched it all
            assert time.monotonic() < deadline, [index_memory(p) for p in workers]
            for i in range(8):  # new connections land on either worker
                r = httpx.post(server.url + "/retrieve", json={"queries": [f"question {i} {time.monotonic()}"]})
                assert r.status_code == 200 and len(r.json()["result"][0]) == 3
            seen_pids.add(httpx.get(server.url + "/health").json()["memory"]["pid"])

        totals = [process_memory(p) for p in workers]
        files = [index_memory(p) for p in workers]
        for total, mapped in zip(totals, files, strict=True):
            assert mapped.private_bytes < 0.05 * size, mapped  # every page of the index is shared
            assert total.rss_bytes - total.private_bytes >= 0.95 * size, total  # it sits in the shared part of RSS
            assert total.pss_bytes < total.rss_bytes - 0.4 * size, total  # each is charged about half of it
        assert sum(m.private_bytes for m in files) < 0.1 * len(workers) * size
        assert seen_pids <= set(workers)

        health = httpx.get(server.url + "/health").json()["memory"]
        assert health["pid"] in workers and health["rss_bytes"] > size
        assert health["index_files"][0]["name"] == "index.faiss" and health["index_files"][0]["num_bytes"] == size
        metrics = httpx.get(server.url + "/metrics").text
        for gauge in ("emapg_retriever_memory_rss_bytes", "emapg_retriever_memory_pss_bytes",
                      "emapg_retriever_memory_private_bytes",
                      'emapg_retriever_index_file_resident_bytes{file="index.faiss"}',
                      'emapg_retriever_index_file_private_bytes{file="index.faiss"}'):
            assert gauge in metrics, gauge
    finally:
        server.stop()

"""What `emapg serve --workers N` holds in memory: one copy of the index or N. One server per N in `--workers`, one
after the other, over the same index folder:

    python benchmarks/shared_index_memory.py --index artifacts/scale/real-1000000/indexes/flat --workers 1,4

Each server gets windows of single-query requests from 32 concurrent clients (benchmarks/retriever_vs_search_r1.py's
closed loop) until every worker has the whole FAISS file resident (a Flat search reads all of it; other types touch
only what they probe, so they stop after `--max-queries`), then each worker's RSS, PSS and private bytes are read
from /proc, with the residency of the index file. RSS counts a shared page in every process that maps it; PSS
divides it among them, so the sum of PSS over the workers is what the machine holds. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from front_door_times import machine_kind
from retriever_vs_search_r1 import closed_loop, question_stream

from retriever.dense import FAISS_FILE
from retriever.memory import process_memory, processes_mapping
from retriever.process import start_server

CLIENTS = 32
WINDOW_S = 2.0


def measure(index: Path, workers: int, max_queries: int, timeout_s: float) -> dict:
    faiss_file = index / FAISS_FILE
    size = faiss_file.stat().st_size
    server = start_server(index, "--workers", str(workers), "--cache-size", "0")
    try:
        deadline = time.monotonic() + timeout_s
        while len(pids := processes_mapping(server.proc.pid, faiss_file)) < workers:
            if time.monotonic() > deadline:
                raise SystemExit(f"{workers} workers did not map {faiss_file} within {timeout_s} s")
            time.sleep(0.5)
        sent = 0

        def resident(pid: int) -> int:
            return process_memory(pid, {FAISS_FILE: faiss_file}).index_files[0].resident_bytes

        stream = question_stream(max_queries)
        while min(resident(p) for p in pids) < 0.95 * size and sent < max_queries and time.monotonic() < deadline:
            sent += asyncio.run(closed_loop(server.url, CLIENTS, 1, WINDOW_S, stream))["requests"]
        per_worker = []
        for pid in pids:
            m = process_memory(pid, {FAISS_FILE: faiss_file})
            per_worker.append({"pid": pid, "rss_bytes": m.rss_bytes, "pss_bytes": m.pss_bytes,
                               "private_bytes": m.private_bytes,
                               "index_resident_bytes": m.index_files[0].resident_bytes,
                               "index_private_bytes": m.index_files[0].private_bytes})
    finally:
        server.stop()
    return {"workers": workers, "queries_sent": sent, "index_file_bytes": size,
            "sum_rss_bytes": sum(w["rss_bytes"] for w in per_worker),
            "sum_pss_bytes": sum(w["pss_bytes"] for w in per_worker),
            "sum_private_bytes": sum(w["private_bytes"] for w in per_worker),
            "sum_index_private_bytes": sum(w["index_private_bytes"] for w in per_worker), "per_worker": per_worker}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", type=Path, required=True, help="a dense index folder")
    ap.add_argument("--workers", default="1,4", help="comma-separated worker counts, one server each")
    ap.add_argument("--max-queries", type=int, default=20_000)
    ap.add_argument("--timeout-s", type=float, default=600)
    args = ap.parse_args()
    rows = [measure(args.index, int(n), args.max_queries, args.timeout_s) for n in args.workers.split(",")]
    print(json.dumps({"benchmark": "shared_index_memory", "index": str(args.index), "runs": rows,
                      "machine_kind": machine_kind(Path("/proc/cpuinfo").read_text()),
                      "date": time.strftime("%Y-%m-%d", time.gmtime())}), flush=True)


if __name__ == "__main__":
    main()

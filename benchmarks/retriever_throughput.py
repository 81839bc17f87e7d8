"""Retrieval server throughput with cross-request batching on and off, in one run. Prints one JSON line.

Scenarios, each against a real server (child process, loopback) over the packaged-Wikipedia MiniLM index,
result cache off so every query is encoded:
  (a) 32 concurrent clients, each sending single-query requests back to back (how rollout workers call it);
  (b) one client sending requests of 256 queries.

    python benchmarks/retriever_throughput.py [--index DIR] [--requests-per-client 12]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
import numpy as np

from data.corpus import packaged_wiki_passages
from retriever.process import running_server

TEMPLATES = ["who was {}", "what is {}", "where is {}", "when did {} happen", "tell me about {}"]


def distinct_questions(n: int) -> list[str]:
    titles = [p.title for p in packaged_wiki_passages()]
    return [TEMPLATES[i % len(TEMPLATES)].format(titles[(i * 7919) % len(titles)]) for i in range(n)]


async def run_clients(url: str, batches_per_client: list[list[list[str]]]) -> dict:
    """Each client sends its batches back to back; returns queries/s over the whole run and request latencies."""
    latencies: list[float] = []

    async def client(batches: list[list[str]]) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            for queries in batches:
                start = time.perf_counter()
                r = await http.post(url + "/retrieve", json={"queries": queries, "topk": 3, "return_scores": True})
                r.raise_for_status()
                latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(client(b) for b in batches_per_client))
    wall = time.perf_counter() - start
    num_queries = sum(len(q) for b in batches_per_client for q in b)
    return {
        "queries_per_s": round(num_queries / wall, 1),
        "p50_ms": round(float(np.percentile(latencies, 50)) * 1000, 1),
        "p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 1),
        "requests": len(latencies),
        "queries": num_queries,
    }


def scenario_inputs(questions: list[str], clients: int, per_client: int, batch: int) -> list[list[list[str]]]:
    it = iter(questions)
    return [[[next(it) for _ in range(batch)] for _ in range(per_client)] for _ in range(clients)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", type=Path, default=Path("artifacts/indexes/wiki-minilm-flat"))
    ap.add_argument("--requests-per-client", type=int, default=12)
    ap.add_argument("--big-batches", type=int, default=4)
    args = ap.parse_args()
    if not (args.index / "manifest.json").exists():
        raise SystemExit(f"no index at {args.index}: run `make index` first")
    questions = distinct_questions(32 * args.requests_per_client + 256 * args.big_batches + 64)
    warmup = [[[q] for q in questions[-64:]]]
    concurrent = scenario_inputs(questions, 32, args.requests_per_client, 1)
    big = scenario_inputs(questions[32 * args.requests_per_client :], 1, args.big_batches, 256)
    results = {}
    for batching in (True, False):
        flags = ["--cache-size", "0"] + ([] if batching else ["--no-batching"])
        with running_server(args.index, *flags) as url:
            asyncio.run(run_clients(url, warmup))
            name = "batching_on" if batching else "batching_off"
            results[name] = {
                "a_32_concurrent_single_query": asyncio.run(run_clients(url, concurrent)),
                "b_one_client_batches_of_256": asyncio.run(run_clients(url, big)),
            }
    on, off = results["batching_on"], results["batching_off"]
    a_on, a_off = on["a_32_concurrent_single_query"], off["a_32_concurrent_single_query"]
    print(json.dumps({
        "benchmark": "retriever_throughput", "index": str(args.index), **results,
        "a_speedup_queries_per_s": round(a_on["queries_per_s"] / a_off["queries_per_s"], 2),
        "a_p99_ratio_on_over_off": round(a_on["p99_ms"] / a_off["p99_ms"], 2),
        "b_speedup_queries_per_s": round(
            on["b_one_client_batches_of_256"]["queries_per_s"] / off["b_one_client_batches_of_256"]["queries_per_s"], 2
        ),
    }))


if __name__ == "__main__":
    main()

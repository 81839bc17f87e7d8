"""Retrieval server throughput with cross-request batching on and off, in one run. Prints one JSON line.

Scenarios, each against a real server (child process, loopback) over the packaged-Wikipedia MiniLM index,
result cache off so every query is encoded:
  (a) 32 concurrent clients, each sending single-query requests back to back (how rollout workers call it);
  (b) one client sending requests of 256 queries.
The load comes from aiohttp clients in this process: on 2 cores the load generator shares the CPU with the
server, and httpx's per-request cost (about twice aiohttp's) hid half of the server's throughput. Each client
sends one untimed request first, so connection set-up is not counted as latency.

    python benchmarks/retriever_throughput.py [--index DIR] [--requests-per-client 12]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from data.corpus import packaged_wiki_passages
from retriever.process import running_server

TEMPLATES = ["who was {}", "what is {}", "where is {}", "when did {} happen", "tell me about {}"]


def distinct_questions(n: int) -> list[str]:
    titles = [p.title for p in packaged_wiki_passages()]
    return [TEMPLATES[i % len(TEMPLATES)].format(titles[(i * 7919) % len(titles)]) for i in range(n)]


async def run_clients(url: str, batches_per_client: list[list[list[str]]]) -> dict:
    """Each client sends its batches back to back; returns queries/s over the run and request latencies."""
    latencies: list[float] = []

    async def post(http: aiohttp.ClientSession, queries: list[str]) -> None:
        async with http.post(url + "/retrieve", json={"queries": queries, "topk": 3, "return_scores": True}) as r:
            r.raise_for_status()
            await r.read()

    async def client(batches: list[list[str]]) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            await post(http, ["connection warm-up"])
            for queries in batches:
                start = time.perf_counter()
                await post(http, queries)
                latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(client(b) for b in batches_per_client))
    wall = time.perf_counter() - start
    # The warm-up requests ran inside the timed window too, so they count as queries served.
    num_queries = sum(len(q) for b in batches_per_client for q in b) + len(batches_per_client)
    return {
        "queries_per_s": round(num_queries / wall, 1),
        "p50_ms": round(float(np.percentile(latencies, 50)) * 1000, 1),
        "p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 1),
        "requests": len(latencies),
        "queries": num_queries,
    }


def batch_totals(url: str) -> tuple[float, float]:
    """(queries searched, encode+search calls) so far, from the server's Prometheus histogram."""
    lines = httpx.get(url + "/metrics").text.splitlines()
    value = {ln.split()[0]: float(ln.split()[1]) for ln in lines if ln.startswith("emapg_retriever_batch_queries_")}
    return value["emapg_retriever_batch_queries_sum"], value["emapg_retriever_batch_queries_count"]


def scenario_inputs(questions: list[str], clients: int, per_client: int, batch: int) -> list[list[list[str]]]:
    it = iter(questions)
    return [[[next(it) for _ in range(batch)] for _ in range(per_client)] for _ in range(clients)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--index", type=Path, default=Path("artifacts/indexes/wiki-minilm-flat"))
    ap.add_argument("--requests-per-client", type=int, default=12)
    ap.add_argument("--big-batches", type=int, default=4)
    ap.add_argument("--max-wait-ms", type=float, default=None, help="the server's batching window (default: its own)")
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
        if args.max_wait_ms is not None:
            flags += ["--max-wait-ms", str(args.max_wait_ms)]
        with running_server(args.index, *flags) as url:
            asyncio.run(run_clients(url, warmup))
            name = "batching_on" if batching else "batching_off"
            queries_before, calls_before = batch_totals(url)
            a = asyncio.run(run_clients(url, concurrent))
            queries_after, calls_after = batch_totals(url)
            a["mean_queries_per_search"] = round((queries_after - queries_before) / (calls_after - calls_before), 1)
            results[name] = {"a_32_concurrent_single_query": a, "b_one_client_batches_of_256": asyncio.run(run_clients(url, big))}
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

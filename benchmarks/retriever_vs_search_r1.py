"""Our retrieval server against Search-R1's own `retrieval_server.py`, side by side in one run, on one index folder
and one query stream. Prints one JSON line.

Search-R1's server is read at run time from a local git clone of its repository (`--search-r1`; this
repository holds none of its code), written to a temp folder and patched for the CPU there: no `.cuda()` calls, fp32
instead of its hard-coded fp16 (which a CPU runs slowly), its corpus read with its own `read_jsonl` instead of the
`datasets` library (not installed here; a list is as fast to index), FAISS's BLAS rule of the version it pins
(faiss-gpu 1.8.0 searches batches of 20 queries or more through BLAS; the faiss-cpu 1.15.1 installed here would
scan its Flat index once per query below 333 queries at 384 dims, 17x slower on a 1M batch of 256: not its
users' speed), and loopback on a free port. It serves the
index folder's `index.faiss` and `corpus.jsonl` with the packaged MiniLM, mean pooling, normalised: the same
vectors, model and passages as ours.

Each server runs alone (child process); closed-loop aiohttp clients in this process send distinct questions from one
fixed stream (the same for both servers), topk 3 with scores, for `--window-s` seconds per scenario; each scenario
runs `--rounds` times and the best queries/s is kept (with that round's latencies). Requests still in flight when
the window closes are not counted. Our server runs with its result cache off, so every query is encoded.
Scenarios: c1, c8, c32 (that many clients, one query per request) and b256 (one client, 256 queries per request:
the encoder fed whole batches, our batching's ceiling).

    python benchmarks/retriever_vs_search_r1.py --search-r1 ../Search-R1 \
        [--index artifacts/indexes/wiki-minilm-flat] [--ours auto,torch] [--window-s 20] [--rounds 2]

Each `--ours` entry is an `--encoder-backend` value, optionally followed by more `emapg serve` options ("auto
--access-log"): variants of our server measured one after another in the same run. Without `--search-r1` only ours
run, and each variant is compared with the first (ABA: list the first again last).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from data.corpus import packaged_wiki_passages
from retriever.encoder import PACKAGED_MINILM, _load_path
from retriever.manifest import Manifest
from retriever.process import free_port, running_server

SERVER_PATH = "search_r1/search/retrieval_server.py"
# (text in Search-R1's server, what the CPU copy has instead); each must be found exactly once.
CPU_PATCH = [
    ("import datasets\n", ""),
    (
        "    corpus = datasets.load_dataset(\n        'json', \n        data_files=corpus_path,\n"
        '        split="train",\n        num_proc=4\n    )\n',
        "    corpus = read_jsonl(corpus_path)\n",
    ),
    ("    model.cuda()\n", ""),
    ("        inputs = {k: v.cuda() for k, v in inputs.items()}\n", ""),
    (
        "        self.index = faiss.read_index(self.index_path)\n",
        "        self.index = faiss.read_index(self.index_path)\n"
        "        faiss.cvar.distance_compute_blas_threshold = 20 * self.index.d\n",
    ),
    ("        retrieval_use_fp16=True,\n", "        retrieval_use_fp16=False,\n"),
    ('uvicorn.run(app, host="0.0.0.0", port=8000)', 'uvicorn.run(app, host="127.0.0.1", port=int(os.environ["PORT"]))'),
]
SCENARIOS = {"c1": (1, 1), "c8": (8, 1), "c32": (32, 1), "b256": (1, 256)}  # name: (clients, queries per request)
TEMPLATES = ["who was {}", "what is {}", "where is {}", "when did {} happen", "tell me about {}", "history of {}"]


def question_stream(n: int) -> list[str]:
    titles = [p.title for p in packaged_wiki_passages()]
    return [TEMPLATES[(i // len(titles)) % len(TEMPLATES)].format(titles[(i * 7919) % len(titles)]) for i in range(n)]


def search_r1_server(mirror: Path, folder: Path) -> Path:
    """Search-R1's server, patched for the CPU, as a file in `folder`."""
    if not mirror.exists():
        raise SystemExit(f"--search-r1: no git mirror at {mirror}")
    try:
        source = subprocess.run(
            ["git", "-C", str(mirror), "show", f"HEAD:{SERVER_PATH}"], check=True, capture_output=True, text=True
        ).stdout
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"--search-r1: {mirror} has no {SERVER_PATH} at HEAD: {e.stderr.strip()}") from e
    for old, new in CPU_PATCH:
        if source.count(old) != 1:
            raise SystemExit(f"Search-R1's server changed: the CPU patch expects {old!r} once, found {source.count(old)}")
        source = source.replace(old, new)
    path = folder / "retrieval_server.py"
    path.write_text(source)
    return path


async def post(http: aiohttp.ClientSession, url: str, queries: list[str]) -> None:
    async with http.post(url + "/retrieve", json={"queries": queries, "topk": 3, "return_scores": True}) as r:
        r.raise_for_status()
        body = await r.json()
        if len(body["result"]) != len(queries) or any(len(hits) != 3 for hits in body["result"]):
            raise ValueError("wrong number of results")


async def closed_loop(url: str, clients: int, per_request: int, window_s: float, stream: list[str]) -> dict:
    """`clients` clients, each sending its next request as soon as the last is answered, for window_s seconds."""
    position = iter(range(0, 10**9, per_request))
    latencies: list[float] = []
    errors = 0

    async def client(http: aiohttp.ClientSession, end: float) -> None:
        nonlocal errors
        while (start := time.perf_counter()) < end:
            offset = next(position) % (len(stream) - per_request)
            try:
                await asyncio.wait_for(post(http, url, stream[offset : offset + per_request]), timeout=end - start)
            except TimeoutError:  # still in flight when the window closed (a 21M scan): not counted, not waited for
                return
            except (aiohttp.ClientError, ValueError):
                errors += 1
                continue
            if (done := time.perf_counter()) <= end:
                latencies.append(done - start)

    sessions = [aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) for _ in range(clients)]
    try:
        # Opens each client's connection; a server too slow to answer them all within the timeout is measured anyway
        await asyncio.gather(*(post(http, url, ["connection warm-up"]) for http in sessions), return_exceptions=True)
        end = time.perf_counter() + window_s
        await asyncio.gather(*(client(http, end) for http in sessions))
    finally:
        await asyncio.gather(*(http.close() for http in sessions))
    return {
        "queries_per_s": round(len(latencies) * per_request / window_s, 1),
        "p50_ms": round(float(np.percentile(latencies, 50)) * 1000, 1) if latencies else None,
        "p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 1) if latencies else None,
        "requests": len(latencies),
        "errors": errors,
    }


def measure(url: str, window_s: float, rounds: int, stream: list[str], scenarios: dict = SCENARIOS) -> dict:
    asyncio.run(closed_loop(url, 4, 64, min(3.0, window_s), stream))  # warm-up: thread pools, allocator, batches
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for name, (clients, per_request) in scenarios.items():
            got = asyncio.run(closed_loop(url, clients, per_request, window_s, stream))
            if name not in best or got["queries_per_s"] > best[name]["queries_per_s"]:
                best[name] = got
    return best


def wait_answering(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    """Search-R1's server has no /health: poll /retrieve until it answers."""

    async def ready() -> bool:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                await post(http, url, ["ready?"])
            return True
        except (aiohttp.ClientError, ValueError, TimeoutError):
            return False

    deadline = time.monotonic() + timeout_s
    while not asyncio.run(ready()):
        if proc.poll() is not None:
            raise RuntimeError(f"Search-R1's server exited with code {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError("Search-R1's server did not answer")
        time.sleep(1)


def measure_search_r1(server: Path, index: Path, window_s: float, rounds: int, stream: list[str],
                      scenarios: dict = SCENARIOS) -> dict:
    port = free_port()
    cmd = [
        sys.executable, str(server), "--index_path", str(index / "index.faiss"), "--corpus_path",
        str(index / "corpus.jsonl"), "--topk", "3", "--retriever_name", "minilm", "--retriever_model",
        _load_path(PACKAGED_MINILM),
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, "PORT": str(port)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_answering(url, proc)
        return measure(url, window_s, rounds, stream, scenarios)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--search-r1", type=Path, help="git dir of a Search-R1 mirror (read-only is fine); omit to "
                    "compare our variants only")
    ap.add_argument("--index", type=Path, default=Path("artifacts/indexes/wiki-minilm-flat"))
    ap.add_argument("--ours", default="auto", help="our server's variants, comma-separated: an --encoder-backend "
                    "value, then any other `emapg serve` options")
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    manifest = Manifest.read(args.index)
    if manifest.kind != "dense" or manifest.encoder.name != "sentence-transformers/all-MiniLM-L6-v2":
        raise SystemExit(f"--index: {args.index} must be a dense MiniLM index (build it with `emapg index`)")
    if not (args.index / "corpus.jsonl").exists():
        raise SystemExit(f"--index: {args.index} has no copied corpus.jsonl (build it without --no-copy-corpus)")
    stream = question_stream(20_000)
    results: dict[str, dict] = {}
    if args.search_r1 is not None:
        with tempfile.TemporaryDirectory() as tmp:
            results["search_r1_fp32"] = measure_search_r1(
                search_r1_server(args.search_r1, Path(tmp)), args.index, args.window_s, args.rounds, stream
            )
    variants = [v.split() for v in args.ours.split(",")]
    names = [f"ours_{'_'.join(v).replace('--', '')}" for v in variants]
    for variant, name in zip(variants, names, strict=True):
        key = name if name not in results else f"{name}_again"  # ABA: the first variant listed again
        with running_server(args.index, "--cache-size", "0", "--encoder-backend", *variant) as url:
            results[key] = measure(url, args.window_s, args.rounds, stream)
    ratios = {}
    for name in dict.fromkeys(k for k in results if k.startswith("ours_")):
        ours = results[name]
        ratios[name] = {
            "c32_vs_own_b256": round(ours["c32"]["queries_per_s"] / ours["b256"]["queries_per_s"], 2),
            **{f"{s}_vs_{names[0]}": round(ours[s]["queries_per_s"] / results[names[0]][s]["queries_per_s"], 2)
               for s in SCENARIOS if name != names[0]},
        }
        if "search_r1_fp32" in results:
            theirs = results["search_r1_fp32"]
            ratios[name] |= {
                **{f"{s}_vs_search_r1": round(ours[s]["queries_per_s"] / theirs[s]["queries_per_s"], 2)
                   for s in SCENARIOS},
                "c32_p99_vs_search_r1": round(ours["c32"]["p99_ms"] / theirs["c32"]["p99_ms"], 2),
            }
    print(json.dumps({
        "benchmark": "retriever_vs_search_r1", "index": str(args.index), "passage_backend":
        manifest.encoder.passage_backend, "window_s": args.window_s, "rounds": args.rounds,
        "load_average_1m_at_end": os.getloadavg()[0], **results, "ratios": ratios,
    }))


if __name__ == "__main__":
    main()

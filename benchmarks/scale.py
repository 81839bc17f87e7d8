"""The retriever at scale: for each FAISS index type, on >= 1M real MiniLM vectors and on 21M synthetic ones (wiki-18's
passage count), build time, file size, start-up time, memory (RSS, PSS, private) at start and under load, queries/s
and p99 at c1 / c32 / c256 single-query clients and one client of 256-query batches, and recall@3 / @10 against exact
search. One JSON line per (set, index type), printed and appended to <out>/results.jsonl (docs/scale.md).

Sets:
  real       windows of the packaged Wikipedia summaries (data/corpus.py): the corpus has 775,848 words, so 1M passages
             need windows at every word: 10- and 20-word windows, stride 1 (1.43M in all; neighbours overlap heavily).
             Whole articles (every 20th) are held out: queries are their windows, never near-copies of indexed
             ones. Encoded once with the packaged MiniLM (384 dims) and cached.
  synthetic  `--synthetic-vectors` vectors drawn from a Gaussian with the real vectors' mean and covariance, then
             L2-normalised (what a unit-norm encoder gives), chunk by chunk from per-chunk seeds: never held whole,
             only inside the index files. 384 dims: wiki-18's e5 vectors are 768, so its files are twice these.
             It has no neighbourhoods: an approximate index's recall on it is not a real corpus's.
  perturbed  as many vectors, each a real vector moved by noise (`perturbed_set`): the real set's neighbourhoods at
             21M, for the recall an approximate type keeps at that count and the speed of the setting that keeps it.
Exact top-10 of the held-out queries over each set is computed by streaming the set past them (retriever/tuning.py).
Approximate types are built with `--target-recall` tuning (nprobe, k_factor_rf) on a second, disjoint query sample;
recall is then measured on the first, in-process through the server's own loading code (memory-mapped).

Every step is cached under --out and skipped when its output exists, so an interrupted run resumes: the encoded
vectors (in parts), the corpora, the exact top-k, each index folder, each result. Index folders are deleted once
measured (21M x 384 fp32 is 32 GB each) unless --keep-indexes.

    python benchmarks/scale.py                      # real 1M, synthetic and perturbed 21M, every type (hours)
    python benchmarks/scale.py --sets real --search-r1 <a git clone of PeterGriffinJin/Search-R1>
    python benchmarks/scale.py --small --out /tmp/scale-small   # a minute: 4k real, 20k synthetic and perturbed
    OMP_NUM_THREADS=1 python benchmarks/scale.py --prepare      # the sets only: may share the machine (no timing)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
from front_door_times import machine_kind
from retriever_vs_search_r1 import measure, measure_search_r1, question_stream, search_r1_server
from tqdm import tqdm

from data.corpus import Passage, packaged_wiki_passages, write_jsonl
from retriever.dense import TuningRequest, build_dense_from_vectors
from retriever.encoder import Encoder, resolve_backend, resolve_dtype, resolve_encoder
from retriever.index import load_index
from retriever.manifest import EncoderManifest, Manifest, encoder_manifest
from retriever.process import start_server
from retriever.tuning import ExactTopK, recall_at_k

ROOT = Path(__file__).resolve().parents[1]
K = 10
WINDOW_WORDS = (10, 20)
HELD_OUT_EVERY = 20  # every 20th article's windows are queries, never indexed
SCENARIOS = {"c1": (1, 1), "c32": (32, 1), "c256": (256, 1), "b256": (1, 256)}  # (clients, queries per request)
# name: factory; {nlist} is ~4 sqrt(N) rounded to a power of two (FAISS's guideline 4-16 sqrt(N)).
KINDS = {
    "flat": "Flat",
    "sqfp16": "SQfp16",
    "sq8": "SQ8",
    "ivf-flat": "IVF{nlist},Flat",
    "ivf-pq-refine": "IVF{nlist},PQ48,Refine(SQfp16)",
    # The refine codes are added in memory: at 21M, SQfp16's are 16 GB (refused where MemAvailable is less), SQ8's 8.
    "ivf-pq-refine-sq8": "IVF{nlist},PQ48,Refine(SQ8)",
    "opq-ivf-pq-refine": "OPQ48_384,IVF{nlist},PQ48,Refine(SQfp16)",
}
SMALL_KINDS = ("flat", "ivf-flat")
TRAIN_VECTORS = 200_000  # >= 39 x nlist for the 21M set's 16,384 lists would be 640k; FAISS warns and trains well
CHUNK = 50_000
PERTURB_RANK = 10  # the perturbed set's noise: a vector's cosine to its origin is the real set's 10th-neighbour one
SINGLE_QUERIES, SINGLE_S = 100, 30.0  # the search alone, one query at a time: at most 100 queries or ~30 s


def nlist_for(n: int) -> int:
    return int(2 ** round(np.log2(4 * np.sqrt(n))))


def machine() -> dict:
    """The machine kind (as README's time table names it), its cores and memory."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    mem = next((int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), None) if Path("/proc/meminfo").exists() else None
    return {"kind": machine_kind(cpuinfo) if cpuinfo else platform.processor(), "cores": os.cpu_count(),
            "memory_bytes": mem}


class OtherWork:
    """How many cores other processes kept busy while a measurement ran, on average: the machine's busy time
    (/proc/stat: user, nice, system, irq, softirq) less this process's and its reaped children's (the servers it
    started and stopped), over the wall time. Near 0: the figure was taken alone; near a core or more: under load."""

    @staticmethod
    def _busy_s() -> float:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
        return (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def __enter__(self) -> OtherWork:
        self._start = (self._busy_s(), self._own_s(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        busy, own = self._busy_s() - self._start[0], self._own_s() - self._start[1]
        self.cores = round(max(0.0, busy - own) / (time.perf_counter() - self._start[2]), 2)


def commit() -> str:
    """HEAD's short hash, marked when the tree has uncommitted changes to tracked files."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        dirty = bool(git("status", "--porcelain", "-uno"))
        return git("rev-parse", "--short", "HEAD") + (" (uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# --- the real set: windows of the packaged summaries, encoded once ---------------------------------------------


def windows(words: list[str], size: int) -> list[str]:
    return [" ".join(words[i:i + size]) for i in range(max(1, len(words) - size + 1))]


def window_texts() -> tuple[list[str], list[str]]:
    """(indexable windows, held-out windows), deterministic."""
    indexed, held_out = [], []
    for i, p in enumerate(packaged_wiki_passages()):
        words = p.text.split()
        (held_out if i % HELD_OUT_EVERY == 0 else indexed).extend(w for size in WINDOW_WORDS for w in windows(words, size))
    return indexed, held_out


def encode_in_parts(enc: Encoder, texts: list[str], folder: Path, desc: str) -> np.ndarray:
    """Passage vectors of `texts`, encoded CHUNK at a time into part files (an interrupted run keeps its parts)."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    for start in tqdm(range(0, len(texts), CHUNK), desc=desc, unit="part"):
        part = folder / f"part-{start // CHUNK:05d}.npy"
        if not part.exists():
            np.save(part.with_suffix(".tmp.npy"), enc.encode_passages(texts[start:start + CHUNK], batch_size=256))
            part.with_suffix(".tmp.npy").replace(part)
        parts.append(np.load(part))
    return np.concatenate(parts)


def encoders() -> tuple[Encoder, Encoder]:
    """(passage encoder as `emapg index` picks it, query encoder as `emapg serve` runs it)."""
    backend = resolve_backend("auto")
    passages = Encoder(resolve_encoder("minilm"), dtype=resolve_dtype("auto", "cpu", backend), backend=backend)
    return passages, Encoder(resolve_encoder("minilm"), backend=resolve_backend("auto"))


class VectorSet:
    """A set's corpus (row i = vector i), its vectors as chunks, a training sample, the held-out query vectors
    (evaluation and tuning halves) and their exact top-K."""

    def __init__(self, name: str, folder: Path, encoder: EncoderManifest, num: int, eval_queries: np.ndarray,
                 tune_queries: np.ndarray, chunks, train: np.ndarray, copy_corpus: bool):
        self.name, self.folder, self.encoder, self.num = name, folder, encoder, num
        self.eval_queries, self.tune_queries = eval_queries, tune_queries
        self.chunks, self.train, self.copy_corpus = chunks, train, copy_corpus
        self.corpus = folder / "corpus.jsonl"
        exact_path = folder / f"exact-top{K}.npy"
        if not exact_path.exists():
            exact = ExactTopK(eval_queries, K)
            for x in tqdm(chunks(), desc=f"{name}: exact top-{K}", total=-(-num // CHUNK), unit="chunk"):
                exact.add(x)
            np.save(exact_path, exact.rows)
        self.exact = np.load(exact_path)


def real_set(out: Path, num: int, num_queries: int, passage_enc: Encoder, query_enc: Encoder) -> VectorSet:
    folder = out / f"real-{num}"
    indexed, held_out = window_texts()
    if num > len(indexed):
        raise SystemExit(f"--real-vectors {num:,}: the packaged corpus gives {len(indexed):,} windows")
    rng = np.random.default_rng(0)
    rows = np.sort(rng.choice(len(indexed), size=num, replace=False))
    texts = [indexed[r] for r in rows]
    queries = [held_out[q] for q in rng.choice(len(held_out), size=2 * num_queries, replace=False)]
    vectors = encode_in_parts(passage_enc, texts, folder / "vectors", f"real: encoding {num:,} windows")
    query_path = folder / f"queries-{num_queries}.npy"
    if not query_path.exists():
        np.save(query_path, query_enc.encode_queries(queries))
    query_vectors = np.load(query_path)
    if not (folder / "corpus.jsonl").exists():
        write_jsonl((Passage(id=str(i), contents=f'"window {i}"\n{t}') for i, t in enumerate(texts)),
                    folder / "corpus.jsonl")
    train = vectors[rng.choice(num, size=min(TRAIN_VECTORS, num), replace=False)]
    return VectorSet("real", folder, encoder_manifest(passage_enc), num, query_vectors[:num_queries],
                     query_vectors[num_queries:], lambda: (vectors[i:i + CHUNK] for i in range(0, num, CHUNK)), train,
                     copy_corpus=True)


def covariance_factor(vectors: np.ndarray) -> np.ndarray:
    """L with L L^T the vectors' covariance: z @ L.T for standard normal z has that covariance."""
    return np.linalg.cholesky(np.cov(vectors, rowvar=False) + 1e-9 * np.eye(vectors.shape[1]))


def drawn_set(name: str, folder: Path, num: int, real: VectorSet, draw, chunk_seed: int, train_seed: int) -> VectorSet:
    """A set drawn chunk by chunk, never held whole: chunk i is draw((chunk_seed, i), n), the training sample
    draw((train_seed, 0), n); the real set's queries; a corpus of numbered placeholder passages."""
    def chunks():
        for i, start in enumerate(range(0, num, CHUNK)):
            yield draw((chunk_seed, i), min(CHUNK, num - start))

    if not (folder / "corpus.jsonl").exists():
        write_jsonl((Passage(id=str(i), contents=f'"{name} {i}"\n{name} vector {i}') for i in range(num)),
                    folder / "corpus.jsonl")
    return VectorSet(name, folder, real.encoder, num, real.eval_queries, real.tune_queries, chunks,
                     draw((train_seed, 0), min(TRAIN_VECTORS, num)), copy_corpus=False)


def synthetic_set(out: Path, num: int, real: VectorSet, real_vectors: np.ndarray) -> VectorSet:
    """Gaussian with the real vectors' mean and covariance, L2-normalised; chunk i from seed (1, i)."""
    folder = out / f"synthetic-{num}"
    folder.mkdir(parents=True, exist_ok=True)
    mean, factor = real_vectors.mean(axis=0, dtype=np.float64), covariance_factor(real_vectors)

    def draw(seed: tuple[int, int], n: int) -> np.ndarray:
        z = np.random.default_rng(seed).standard_normal((n, len(mean)))
        x = (z @ factor.T + mean).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    return drawn_set("synthetic", folder, num, real, draw, chunk_seed=1, train_seed=2)


def neighbour_cosine(vectors: np.ndarray, rank: int, sample: int = 1000) -> float:
    """The median, over `sample` of `vectors` (seed 3), of the cosine to their `rank`-th nearest other one."""
    rows = np.random.default_rng(3).choice(len(vectors), size=min(sample, len(vectors)), replace=False)
    exact = ExactTopK(vectors[rows], rank + 1)  # column 0 is the vector itself
    for start in range(0, len(vectors), CHUNK):
        exact.add(vectors[start:start + CHUNK])
    return float(np.median(exact.scores[:, rank]))


def perturb(origins: np.ndarray, z: np.ndarray, factor: np.ndarray, scale: float) -> np.ndarray:
    """origins + scale * z @ factor.T, L2-normalised: unit vectors moved by noise of covariance scale^2 L L^T."""
    x = (origins + scale * (z @ factor.T)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def perturb_scale(vectors: np.ndarray, factor: np.ndarray, cosine: float, draws: int = 10_000) -> float:
    """The noise scale at which a perturbed vector's median cosine to its origin is `cosine`: bisection on `draws`
    perturbed vectors (seed 5), the cosine falling as the scale grows."""
    rng = np.random.default_rng(5)
    origins, z = vectors[rng.integers(0, len(vectors), draws)], rng.standard_normal((draws, len(factor)))
    low, high = 0.0, 100.0
    for _ in range(50):
        scale = (low + high) / 2
        low, high = (scale, high) if np.median((perturb(origins, z, factor, scale) * origins).sum(1)) > cosine \
            else (low, scale)
    return (low + high) / 2


def perturbed_set(out: Path, num: int, real: VectorSet, real_vectors: np.ndarray) -> VectorSet:
    """Real vectors with neighbourhoods, at any count: vector j is a real vector (drawn uniformly with replacement)
    moved by Gaussian noise shaped like the real vectors' covariance, then L2-normalised. The noise is scaled so the
    median cosine between a vector and the real one it came from equals the real set's median cosine between a vector
    and its PERTURB_RANK-th nearest other one: at 21M from 1M, each real vector's ~21 offspring spread over the
    neighbourhood where its nearest ~10 real neighbours lie."""
    folder = out / f"perturbed-{num}"
    folder.mkdir(parents=True, exist_ok=True)
    calibration = folder / "calibration.json"
    factor = covariance_factor(real_vectors)
    if not calibration.exists():
        cosine = neighbour_cosine(real_vectors, PERTURB_RANK)
        calibration.write_text(json.dumps({"rank": PERTURB_RANK, "cosine": cosine,
                                           "scale": perturb_scale(real_vectors, factor, cosine)}))
    scale = json.loads(calibration.read_text())["scale"]

    def draw(seed: tuple[int, int], n: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        origins = real_vectors[rng.integers(0, len(real_vectors), n)]
        return perturb(origins, rng.standard_normal((n, len(factor))), factor, scale)

    return drawn_set("perturbed", folder, num, real, draw, chunk_seed=4, train_seed=6)


# --- one index type: build, recall, serve under load --------------------------------------------------------------


def build(vs: VectorSet, kind: str, target_recall: float) -> tuple[Path, dict]:
    folder = vs.folder / "indexes" / kind
    record = vs.folder / "indexes" / f"{kind}.build.json"
    if record.exists() and (folder / "manifest.json").exists():
        return folder, json.loads(record.read_text())
    factory = KINDS[kind].format(nlist=nlist_for(vs.num))
    tuning = TuningRequest(vs.tune_queries, target_recall, K, "held-out windows (disjoint from the evaluation ones)")
    start = time.perf_counter()
    build_dense_from_vectors(vs.corpus, folder, tqdm(vs.chunks(), desc=f"{vs.name}: building {factory}",
                                                     total=-(-vs.num // CHUNK), unit="chunk"),
                             encoder=vs.encoder, factory=factory, train_vectors=vs.train, copy_corpus=vs.copy_corpus,
                             overwrite=True, tuning=tuning if factory != "Flat" else None)
    info = {"factory": factory, "build_s": round(time.perf_counter() - start, 1),
            "file_bytes": (folder / "index.faiss").stat().st_size}
    record.write_text(json.dumps(info))
    return folder, info


def recall(folder: Path, vs: VectorSet) -> dict:
    """Through the server's loading code (memory-mapped, the manifest's tuned parameters applied): recall against
    exact search, and the search alone (no encoder, no HTTP) timed on the evaluation queries, as one batch and one at a
    time (the first SINGLE_QUERIES, or as many as SINGLE_S allows: a scan from disk takes a minute), after one warm-up
    batch that pages the index in."""
    index = load_index(folder)
    index.search_vectors(vs.eval_queries, K)
    start = time.perf_counter()
    _, rows = index.search_vectors(vs.eval_queries, K)
    batch_s = time.perf_counter() - start
    start, singles = time.perf_counter(), 0
    for q in vs.eval_queries[:SINGLE_QUERIES]:
        index.search_vectors(q[None], K)
        singles += 1
        if time.perf_counter() - start > SINGLE_S:
            break
    single_s = time.perf_counter() - start
    index.docstore.close()
    return {"recall@3": round(recall_at_k(rows, vs.exact, 3), 4), "recall@10": round(recall_at_k(rows, vs.exact, 10), 4),
            "search_params": index.search_params,
            "search_only": {"batch_queries_per_s": round(len(vs.eval_queries) / batch_s, 1),
                            "single_queries_per_s": round(singles / single_s, 1)}}


def memory_fields(health: dict) -> dict:
    m = health["memory"] or {}
    files = m.get("index_files") or [{}]
    return {"rss_bytes": m.get("rss_bytes"), "pss_bytes": m.get("pss_bytes"), "private_bytes": m.get("private_bytes"),
            "index_resident_bytes": files[0].get("resident_bytes")}


class PeakMemory:
    """Polls the server's /health every second while the load runs (its /proc read is off the server's event loop);
    keeps each field's maximum."""

    def __init__(self, url: str):
        self.url, self.peak, self._stop = url, {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _sample(self, http: httpx.Client) -> None:
        try:
            now = memory_fields(http.get(self.url + "/health").json())
        except httpx.HTTPError:
            return
        self.peak = {k: max(v, self.peak.get(k) or 0) if v is not None else None for k, v in now.items()}

    def _poll(self) -> None:
        with httpx.Client(timeout=10) as http:
            while not self._stop.wait(1.0):
                self._sample(http)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        with httpx.Client(timeout=10) as http:  # once more at the end: a short load may see no poll
            self._sample(http)


def serve_and_load(folder: Path, window_s: float, rounds: int, stream: list[str]) -> dict:
    start = time.perf_counter()
    server = start_server(folder, "--cache-size", "0")
    try:
        startup_s = time.perf_counter() - start
        at_start = memory_fields(httpx.get(server.url + "/health", timeout=30).json())
        with PeakMemory(server.url) as peak:
            load = measure(server.url, window_s, rounds, stream, SCENARIOS)
        return {"startup_s": round(startup_s, 2), "memory_at_start": at_start, "memory_under_load_peak": peak.peak,
                "load": load}
    finally:
        server.stop()


def measure_kind(vs: VectorSet, kind: str, args, stream: list[str], results: Path) -> dict | None:
    result_path = vs.folder / "results" / f"{kind}.json"
    if result_path.exists():
        return json.loads(result_path.read_text())
    with OtherWork() as other:
        try:
            folder, built = build(vs, kind, args.target_recall)
        except ValueError as e:  # e.g. an in-memory build larger than MemAvailable: a result saying so, not an OOM kill
            row = {"set": vs.name, "kind": kind, "skipped": str(e)}
            print(json.dumps(row), flush=True)
            return None
        manifest = Manifest.read(folder)
        row = {
            "benchmark": "scale", "set": vs.name, "vectors": vs.num, "dim": vs.encoder.dim, "kind": kind, **built,
            "tuning": manifest.tuning.model_dump() if manifest.tuning else None, "queries": len(vs.eval_queries),
            **recall(folder, vs), **serve_and_load(folder, args.window_s, args.rounds, stream),
            "window_s": args.window_s, "rounds": args.rounds, "commit": commit(),
            "date": datetime.now(UTC).date().isoformat(), "small": args.small,
        }
    row["machine"] = {**machine(), "other_cores_busy": other.cores}
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.write_text(json.dumps(row))
    with open(results, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    if not args.keep_indexes and not (kind == "flat" and vs.name == "real" and args.search_r1):
        shutil.rmtree(folder)
    return row


def search_r1_row(vs: VectorSet, args, stream: list[str], results: Path) -> None:
    """Search-R1's own server (CPU-patched at run time, benchmarks/retriever_vs_search_r1.py) on the real Flat index
    folder, under the same load."""
    folder = vs.folder / "indexes" / "flat"
    if not (folder / "manifest.json").exists():
        folder, _ = build(vs, "flat", args.target_recall)
    with OtherWork() as other, tempfile.TemporaryDirectory() as tmp:
        load = measure_search_r1(search_r1_server(args.search_r1, Path(tmp)), folder, args.window_s, args.rounds,
                                 stream, SCENARIOS)
    row = {"benchmark": "scale", "set": vs.name, "vectors": vs.num, "kind": "search_r1_flat", "load": load,
           "window_s": args.window_s, "rounds": args.rounds, "machine": {**machine(), "other_cores_busy": other.cores},
           "commit": commit(), "date": datetime.now(UTC).date().isoformat()}
    with open(results, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "scale")
    ap.add_argument("--small", action="store_true", help="4k real, 20k synthetic and 20k perturbed vectors, flat and "
                    "ivf-flat, 100 queries, 0.5 s per load scenario: the test's run")
    ap.add_argument("--sets", default="real,synthetic,perturbed")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    ap.add_argument("--real-vectors", type=int, default=1_000_000)
    ap.add_argument("--synthetic-vectors", type=int, default=21_015_324, help="the synthetic and perturbed sets' size")
    ap.add_argument("--queries", type=int, default=1000, help="evaluation queries (as many again tune)")
    ap.add_argument("--target-recall", type=float, default=0.95, help="of recall@10, for the approximate types")
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keep-indexes", action="store_true")
    ap.add_argument("--prepare", action="store_true", help="compute the sets (encoded vectors, queries, exact top-k) "
                    "and stop before any build: nothing timed, so it may run beside other work")
    ap.add_argument("--search-r1", type=Path, help="a git clone of Search-R1: also measure its server on the "
                    "real set's Flat index")
    args = ap.parse_args()
    if args.small:
        args.real_vectors, args.synthetic_vectors, args.queries = 4_000, 20_000, 100
        args.window_s, args.rounds = 0.5, 1
        args.kinds = ",".join(k for k in args.kinds.split(",") if k in SMALL_KINDS)
    kinds = args.kinds.split(",")
    if unknown := [k for k in kinds if k not in KINDS]:
        raise SystemExit(f"--kinds: unknown {unknown}; one of {', '.join(KINDS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    stream = question_stream(20_000)
    passage_enc, query_enc = encoders()
    real = real_set(args.out, args.real_vectors, args.queries, passage_enc, query_enc)
    sets = {"real": lambda: real}
    real_vectors = functools.cache(lambda: np.concatenate(list(real.chunks())))  # both drawn sets model these
    sets["synthetic"] = lambda: synthetic_set(args.out, args.synthetic_vectors, real, real_vectors())
    sets["perturbed"] = lambda: perturbed_set(args.out, args.synthetic_vectors, real, real_vectors())
    for name in args.sets.split(","):
        vs = sets[name]()
        if args.prepare:
            print(json.dumps({"set": name, "vectors": vs.num, "prepared": str(vs.folder)}), flush=True)
            continue
        for kind in kinds:
            measure_kind(vs, kind, args, stream, results)
        if name == "real" and args.search_r1:
            search_r1_row(vs, args, stream, results)


if __name__ == "__main__":
    main()

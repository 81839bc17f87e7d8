"""FAISS's exhaustive search, per-query scan against BLAS, by batch size: why the server sets `BLAS_MIN_QUERIES`.

faiss-cpu 1.15.1 sends a Flat search through BLAS only when queries x dim >= 128,000; below that, each query scans
the whole database on its own. For a database larger than the CPU's caches (a Flat index of 1M vectors; the 16,384
centroids of a 21M IVF index's quantizer) every query then re-reads it from memory. Both variants run here on the
same index and queries, one after the other, best of `--repeats`:

    python benchmarks/faiss_blas_threshold.py [--vectors 1000000] [--dim 384] [--centroids 16384]

Prints one JSON line: queries/s per batch size for each database under FAISS's default and under
`use_blas_from(BLAS_MIN_QUERIES, dim)`, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import faiss
import numpy as np

from retriever.dense import BLAS_MIN_QUERIES, use_blas_from

BATCHES = (1, 2, 4, 8, 16, 64, 256)


def unit_rows(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    x = rng.standard_normal((n, d), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def queries_per_s(index: faiss.Index, queries: np.ndarray, repeats: int, min_seconds: float) -> float:
    """Best of `repeats` timings; each repeats the search until `min_seconds` have passed (small batches are fast)."""
    best = 0.0
    for _ in range(repeats):
        start, done = time.perf_counter(), 0
        while True:
            index.search(queries, 10)
            done += len(queries)
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        best = max(best, done / elapsed)
    return round(best, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vectors", type=int, default=1_000_000)
    ap.add_argument("--centroids", type=int, default=16_384)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-seconds", type=float, default=0.5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    queries = unit_rows(rng, max(BATCHES), args.dim)
    default_threshold = faiss.cvar.distance_compute_blas_threshold
    result = {"benchmark": "faiss_blas_threshold", "faiss": faiss.__version__, "dim": args.dim,
              "faiss_default_threshold": default_threshold, "blas_min_queries": BLAS_MIN_QUERIES,
              "threads": faiss.omp_get_max_threads(), "databases": {}}
    for name, rows in (("flat", args.vectors), ("quantizer", args.centroids)):
        index = faiss.IndexFlatIP(args.dim)
        index.add(unit_rows(rng, rows, args.dim))
        table = {}
        for batch in BATCHES:
            q = queries[:batch]
            faiss.cvar.distance_compute_blas_threshold = default_threshold
            scan = queries_per_s(index, q, args.repeats, args.min_seconds)
            use_blas_from(BLAS_MIN_QUERIES, args.dim)
            ours = queries_per_s(index, q, args.repeats, args.min_seconds)
            table[str(batch)] = {"faiss_default": scan, "ours": ours, "ratio": round(ours / scan, 2)}
        result["databases"][f"{name}_{rows}"] = table
        del index
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

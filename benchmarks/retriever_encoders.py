"""The encoder backends against PyTorch fp32, in one run: passage encoding speed (what an index build spends its time
on) and retrieval quality. Prints one JSON line.

For each backend, the packaged Wikipedia passages are encoded as `emapg index` encodes them (chunks of 1,024,
batches of 32 on a CPU) and timed, and a fixed stream of 10,000 distinct questions is encoded and searched (exact inner
product) over that backend's own passage vectors. Against torch fp32's results: `top3_identical`, the share of
questions whose top 3 (ids, in order) are the same, and `recall_at_10`, the mean overlap of the top 10. The
`queries_on_torch_index` figures are the backend's queries over torch's passages: an index built before the
backends existed, served with the new default. A backend may name its dtype (`openvino:bfloat16`); for a bf16 one,
`fp32_queries_on_own_index` is what a server with its default fp32 query encoder retrieves from that index.

    python benchmarks/retriever_encoders.py [--backends torch,onnx,onnx-int8,openvino,openvino:bfloat16] \
        [--passages 0] [--questions 10000] [--batch-sizes 32,128]

With several `--batch-sizes`, every backend is timed at each (`passages_per_s_at`); quality uses the first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import faiss
import numpy as np

from retriever_throughput import distinct_questions  # this folder is on sys.path when run as a script
from data.corpus import packaged_wiki_passages
from retriever.encoder import Encoder, resolve_encoder


def encode_like_a_build(enc: Encoder, passages: list[str], chunk_size: int = 1024, batch_size: int = 32) -> np.ndarray:
    """retriever/dense.py's build loop, less the FAISS adds (microseconds for Flat)."""
    it = iter(passages)
    return np.concatenate([enc.encode_passages(chunk, batch_size) for chunk in iter(lambda: list(itertools.islice(it, chunk_size)), [])])


def top_ids(passage_vectors: np.ndarray, query_vectors: np.ndarray, k: int) -> np.ndarray:
    index = faiss.IndexFlatIP(passage_vectors.shape[1])
    index.add(passage_vectors)
    return index.search(query_vectors, k)[1]


def agreement(got: np.ndarray, want: np.ndarray) -> dict:
    overlap = [len(set(g) & set(w)) / len(w) for g, w in zip(got, want, strict=True)]
    return {
        "top3_identical": round(float(np.mean((got[:, :3] == want[:, :3]).all(axis=1))), 4),
        "recall_at_10": round(float(np.mean(overlap)), 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="torch,onnx,onnx-int8,openvino", help="torch first: the reference (fp32)")
    ap.add_argument("--passages", type=int, default=0, help="encode only the first N passages (0: all 10,033)")
    ap.add_argument("--questions", type=int, default=10_000)
    ap.add_argument("--batch-sizes", default="32", help="passage batch sizes to time, comma-separated")
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    backends = args.backends.split(",")
    if backends[0] != "torch":
        raise SystemExit("--backends: the first must be torch (fp32), the reference")
    passages = [p.contents for p in packaged_wiki_passages()]
    passages = passages[: args.passages or len(passages)]
    questions = distinct_questions(args.questions)
    results, vectors = {}, {}
    for backend in backends:
        name, _, dtype = backend.partition(":")
        start = time.perf_counter()
        enc = Encoder(resolve_encoder("minilm"), backend=name, dtype=dtype or "float32")  # exports on first use
        load_s = time.perf_counter() - start
        seconds_at = {}
        for batch_size in reversed(batch_sizes):  # the first last: its vectors are the ones kept
            start = time.perf_counter()
            p = encode_like_a_build(enc, passages, batch_size=batch_size)
            seconds_at[batch_size] = time.perf_counter() - start
        passage_s = seconds_at[batch_sizes[0]]
        start = time.perf_counter()
        q = enc.encode_queries(questions)
        query_s = time.perf_counter() - start
        vectors[backend] = (p, q)
        results[backend] = {
            "load_s": round(load_s, 1),
            "passages_s": round(passage_s, 1),
            "passages_per_s": round(len(passages) / passage_s, 1),
            "passages_per_s_at": {b: round(len(passages) / t, 1) for b, t in seconds_at.items()},
            "questions_per_s_in_batches_of_256": round(len(questions) / query_s, 1),
        }
        print(backend, results[backend], flush=True)
    ref_p, ref_q = vectors["torch"]
    want = top_ids(ref_p, ref_q, 10)
    for backend in backends[1:]:
        p, q = vectors[backend]
        results[backend]["own_index"] = agreement(top_ids(p, q, 10), want)
        results[backend]["queries_on_torch_index"] = agreement(top_ids(ref_p, q, 10), want)
        if backend.endswith(":bfloat16"):
            fp32_queries = vectors.get(backend.partition(":")[0], vectors["torch"])[1]
            results[backend]["fp32_queries_on_own_index"] = agreement(top_ids(p, fp32_queries, 10), want)
        results[backend]["build_speedup_vs_torch"] = round(results["torch"]["passages_s"] / results[backend]["passages_s"], 2)
    print(json.dumps({
        "benchmark": "retriever_encoders", "passages": len(passages), "questions": len(questions),
        "batch_sizes": batch_sizes,
        "cpu_flags": sorted({f for f in open("/proc/cpuinfo").read().split() if f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")}),
        **results,
    }))


if __name__ == "__main__":
    main()

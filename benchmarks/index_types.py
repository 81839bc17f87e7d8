"""Memory and recall@10 of approximate FAISS indexes against Flat, on >= 200k real MiniLM vectors; and whether
a bf16-encoded corpus keeps fp32's neighbours. Prints one JSON line.

Vectors: 10-word windows (stride 3) of the packaged English Wikipedia summaries, encoded with the packaged
MiniLM in bf16 (cached in artifacts/bench/). Queries: 1,000 windows held out of the index.

    python benchmarks/index_types.py [--num-vectors 200000]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import faiss
import numpy as np

from data.corpus import packaged_wiki_passages
from retriever.dense import new_faiss_index, train_faiss_index
from retriever.encoder import Encoder, resolve_encoder
from retriever.tuning import recall_at_k

CACHE = Path("artifacts/bench")
NUM_QUERIES = 1000
K = 10


def windows(words_per_window: int = 10, stride: int = 3) -> list[str]:
    out = []
    for p in packaged_wiki_passages():
        words = p.text.split()
        out += [" ".join(words[i : i + words_per_window]) for i in range(0, max(1, len(words) - stride), stride)]
    return out


def vectors(num: int) -> np.ndarray:
    path = CACHE / f"minilm-bf16-windows-{num}.npy"
    if path.exists():
        return np.load(path)
    texts = windows()
    if len(texts) < num:
        raise SystemExit(f"only {len(texts)} windows in the packaged corpus, asked for {num}")
    rng = np.random.default_rng(0)
    chosen = [texts[i] for i in rng.choice(len(texts), size=num, replace=False)]
    enc = Encoder(resolve_encoder("minilm").model_copy(update={"max_length": 64}), dtype="bfloat16")
    x = enc.encode_passages(chosen, batch_size=256, show_progress=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    np.save(path, x)
    return x


def index_bytes(index: faiss.Index) -> int:
    return int(faiss.serialize_index(index).nbytes)


def measure(factory: str, base: np.ndarray, queries: np.ndarray, truth: np.ndarray, params: list[str]) -> list[dict]:
    index = new_faiss_index(base.shape[1], factory)
    start = time.perf_counter()
    if not index.is_trained:
        train_faiss_index(index, base[:100_000], factory)
    index.add(base)
    build_s = time.perf_counter() - start
    rows = []
    for p in params:
        if p:
            faiss.ParameterSpace().set_index_parameters(index, p)
        start = time.perf_counter()
        _, found = index.search(queries, K)
        rows.append({
            "index": factory, "params": p, "recall@10": round(recall_at_k(found, truth, K), 4),
            "memory_mb": round(index_bytes(index) / 2**20, 1), "build_s": round(build_s, 1),
            "search_ms_per_query": round((time.perf_counter() - start) / len(queries) * 1000, 4),
        })
    return rows


def bf16_corpus_recall(flat_fp32_dir: Path) -> dict | None:
    """Recall@10 of a bf16-encoded packaged corpus against the fp32 one (needs the fp32 demo index built)."""
    if not (flat_fp32_dir / "index.faiss").exists():
        return None
    fp32 = faiss.read_index(str(flat_fp32_dir / "index.faiss"))
    base32 = fp32.reconstruct_n(0, fp32.ntotal)
    passages = [p.contents for p in packaged_wiki_passages()]
    start = time.perf_counter()
    base16 = Encoder(resolve_encoder("minilm"), dtype="bfloat16").encode_passages(passages, show_progress=True)
    bf16_docs_per_s = len(passages) / (time.perf_counter() - start)
    enc = Encoder(resolve_encoder("minilm"))
    questions = enc.encode_queries([f"what is {p.partition(chr(10))[0].strip(chr(34))}?" for p in passages[::10]])
    truth = (questions @ base32.T).argsort(axis=1)[:, ::-1][:, :K]
    found = (questions @ base16.T).argsort(axis=1)[:, ::-1][:, :K]
    return {"bf16_vs_fp32_recall@10": round(recall_at_k(found, truth, K), 4), "queries": len(questions),
            "bf16_passages_per_s": round(bf16_docs_per_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-vectors", type=int, default=200_000)
    ap.add_argument("--fp32-index", type=Path, default=Path("artifacts/indexes/wiki-minilm-flat"))
    args = ap.parse_args()
    x = vectors(args.num_vectors + NUM_QUERIES)
    base, queries = x[:args.num_vectors], x[args.num_vectors:]
    flat = new_faiss_index(x.shape[1], "Flat")
    flat.add(base)
    _, truth = flat.search(queries, K)
    rows = measure("Flat", base, queries, truth, [""])
    rows += measure("HNSW32", base, queries, truth, ["efSearch=64", "efSearch=128", "efSearch=256"])
    rows += measure("IVF1024,PQ48", base, queries, truth, ["nprobe=16", "nprobe=64"])
    rows += measure("IVF1024,Flat", base, queries, truth, ["nprobe=16", "nprobe=64"])
    print(json.dumps({
        "benchmark": "index_types", "num_vectors": len(base), "dim": int(x.shape[1]), "queries": len(queries),
        "results": rows, "bf16_corpus": bf16_corpus_recall(args.fp32_index),
    }))


if __name__ == "__main__":
    main()

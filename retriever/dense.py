"""Dense retrieval: a FAISS index (any factory string) over L2-normalised embeddings, searched by inner product."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import faiss
import numpy as np
from tqdm import tqdm

from data.corpus import read_jsonl
from retriever.api import Hit
from retriever.build import add_corpus, building_folder, finish_build
from retriever.docstore import DocStore
from retriever.encoder import Encoder, resolve_encoder
from retriever.faiss_file import FaissFileWriter, read_faiss_file, record_index_file
from retriever.manifest import (
    CorpusManifest,
    EncoderManifest,
    Manifest,
    check_loaded_encoder,
    check_requested_encoder,
    encoder_manifest,
    spec_from_manifest,
)
from retriever.tuning import ExactTopK, tune_search

FAISS_FILE = "index.faiss"
# faiss-cpu 1.15.1 searches a Flat index (and an IVF index's Flat quantizer) through BLAS only from queries x dim >=
# 128,000 (333 queries at 384 dims); below that it scans the whole database once per query. At 1M x 384 a 256-query
# batch ran at 19 q/s that way and at 328 through BLAS, a 16k-centroid quantizer 7.6x faster; below ~8 queries the
# two are within 2% (benchmarks/faiss_blas_threshold.py, docs/benchmarks.md), so batches use BLAS from this many.
BLAS_MIN_QUERIES = 8


def use_blas_from(min_queries: int, dim: int) -> None:
    """Process-wide (FAISS keeps it in a global): batches of `min_queries` or more `dim`-dim queries go through BLAS."""
    faiss.cvar.distance_compute_blas_threshold = min_queries * dim


def new_faiss_index(dim: int, factory: str) -> faiss.Index:
    """`Flat`, `HNSW32`, `IVF4096,PQ64`, ...: inner product, so with normalised vectors the score is cosine."""
    try:
        return faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as e:
        raise ValueError(f"FAISS cannot build index type {factory!r} for dim {dim}: {str(e).splitlines()[-1]}") from e


def min_train_points(factory: str) -> int:
    """FAISS needs at least one training point per IVF list (and 256 per PQ codebook) to train."""
    ivf = re.search(r"IVF(\d+)", factory)
    pq = re.search(r"PQ\d+(?:x(\d+))?", factory)
    pq_points = 2 ** int(pq.group(1) or 8) if pq else 0
    return max(int(ivf.group(1)) if ivf else 0, pq_points, 1)


def train_faiss_index(index: faiss.Index, sample: np.ndarray, factory: str) -> None:
    if len(sample) < min_train_points(factory):
        raise ValueError(
            f"index type {factory!r} needs at least {min_train_points(factory)} training vectors, got {len(sample)}: "
            "use a larger --train-size, fewer IVF lists, or Flat/HNSW for a small corpus"
        )
    index.train(sample)


def to_all_gpus(index: faiss.Index) -> faiss.Index:
    """Shard the index over every visible GPU in fp16 (the wiki-18 Flat index is ~60 GB in fp32)."""
    num_gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if num_gpus == 0 or not hasattr(faiss, "GpuMultipleClonerOptions"):
        raise RuntimeError(
            f"--gpu needs faiss-gpu and a visible GPU; this faiss ({faiss.__version__}) sees {num_gpus} GPUs. "
            "Install faiss-gpu (conda or a CUDA wheel) or serve without --gpu."
        )
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    options.useFloat16 = True
    return faiss.index_cpu_to_all_gpus(index, co=options)


def build_dense_index(
    corpus: Path,
    out: Path,
    *,
    encoder: str = "minilm",
    factory: str = "Flat",
    batch_size: int | None = None,
    chunk_size: int = 1024,
    train_size: int = 100_000,
    copy_corpus: bool = True,
    overwrite: bool = False,
    device: str = "cpu",
    dtype: Literal["float32", "bfloat16"] = "float32",
    backend: str = "auto",
    seed: int = 0,
    target_recall: float | None = None,
    tune_k: int = 10,
    tune_queries: int = 500,
) -> Manifest:
    """Encode every passage of `corpus` and write an index folder at `out`. bfloat16 encodes ~2x faster on CPUs
    with AVX512-BF16/AMX (passage cosine to fp32 >= 0.998 with MiniLM; recall in docs/benchmarks.md); `backend`
    (retriever/encoder.py BACKENDS, or auto) is what runs the encoder, recorded in the manifest. `batch_size`
    None: 32 on a CPU, 128 on a GPU. With `target_recall`, the search parameters that reach it (recall@`tune_k`
    against exact search, on queries made from `tune_queries` sampled passages) are chosen and recorded."""
    out = Path(out)
    # Each chunk is sorted by length, so small batches pad little: on a CPU, 32 encoded 1.2x (onnx) and 1.1x (torch)
    # more passages/s than 128 (docs/benchmarks.md, "Encoder backends"); a GPU wants the larger batch.
    batch_size = batch_size or (32 if device == "cpu" else 128)
    enc = Encoder(resolve_encoder(encoder), device=device, dtype=dtype, backend=backend)
    new_faiss_index(enc.dim, factory)  # fail on a bad factory string before any encoding
    tmp = building_folder(out, overwrite)
    corpus_manifest, docstore = add_corpus(tmp, corpus, copy_corpus)
    n = len(docstore)

    def train_sample() -> np.ndarray:
        rows = np.sort(np.random.default_rng(seed).choice(n, size=min(train_size, n), replace=False))
        return enc.encode_passages([docstore.get(int(r)).contents for r in rows], batch_size, show_progress=True)

    def chunks() -> Iterator[np.ndarray]:
        passages = read_jsonl(docstore.corpus_path)
        with tqdm(total=n, desc=f"encoding {n:,} passages", unit="doc") as bar:
            while chunk := list(itertools.islice(passages, chunk_size)):
                yield enc.encode_passages([p.contents for p in chunk], batch_size)
                bar.update(len(chunk))

    tuning = None
    if target_recall is not None:
        rows = np.sort(np.random.default_rng(seed + 1).choice(n, size=min(tune_queries, n), replace=False))
        passages = [docstore.get(int(r)) for r in rows]
        texts = [" ".join((p.text or p.title).split()[:TUNE_QUERY_WORDS]) for p in passages]
        tuning = TuningRequest(enc.encode_queries(texts), target_recall, tune_k,
                               f"the first {TUNE_QUERY_WORDS} words of {len(texts)} sampled passages, encoded as queries")
    try:
        return write_dense_folder(tmp, out, factory=factory, dim=enc.dim, train=train_sample, chunks=chunks(),
                                  encoder=encoder_manifest(enc), corpus=corpus_manifest, tuning=tuning)
    finally:
        docstore.close()


TUNE_QUERY_WORDS = 12  # a query-length piece of a passage: its nearest neighbours are not just itself


@dataclass(frozen=True)
class TuningRequest:
    """Choose the search parameters reaching `target_recall` (recall@k on `queries` against exact search)."""

    queries: np.ndarray
    target_recall: float
    k: int = 10
    query_source: str = ""


def write_dense_folder(
    tmp: Path,
    out: Path,
    *,
    factory: str,
    dim: int,
    train: Callable[[], np.ndarray],
    chunks: Iterable[np.ndarray],
    encoder: EncoderManifest,
    corpus: CorpusManifest,
    tuning: TuningRequest | None = None,
) -> Manifest:
    """The FAISS part of a dense index folder whose corpus `add_corpus` put in `tmp`: train (`train` is called only
    when the index type needs training), add the vectors of every passage in corpus order (streamed to the file for
    flat-code types), tune if asked, record the file, write the manifest and move `tmp` to `out`."""
    index = new_faiss_index(dim, factory)
    if not index.is_trained:
        train_faiss_index(index, train(), factory)
    if tuning is not None and tuning.k > corpus.num_docs:
        raise ValueError(f"recall@{tuning.k} needs at least {tuning.k} passages; the corpus has {corpus.num_docs}")
    exact = ExactTopK(tuning.queries, tuning.k) if tuning is not None else None
    with FaissFileWriter(index, tmp / FAISS_FILE, expected=corpus.num_docs) as writer:
        for vectors in chunks:
            writer.add(vectors)
            if exact is not None:
                exact.add(vectors)
    if writer.ntotal != corpus.num_docs:
        raise ValueError(f"{writer.ntotal:,} vectors for the {corpus.num_docs:,} passages of {corpus.path}")
    del index, writer  # an in-memory index (IVF, HNSW) is on disk now; tuning reads the file as the server will
    searched = None
    if tuning is not None:
        served = read_faiss_file(tmp, FAISS_FILE, None)
        searched = tune_search(served, tuning.queries, exact.rows, tuning.k, tuning.target_recall,
                               tuning.query_source)
        del served
    manifest = Manifest(
        kind="dense",
        metric="inner_product",
        index_factory=factory,
        encoder=encoder,
        corpus=corpus,
        index_file=record_index_file(tmp, FAISS_FILE),
        tuning=searched,
    )
    finish_build(tmp, out, manifest)
    return manifest


def build_dense_from_vectors(
    corpus: Path,
    out: Path,
    vectors: Iterable[np.ndarray],
    *,
    encoder: EncoderManifest,
    factory: str = "Flat",
    train_vectors: np.ndarray | None = None,
    copy_corpus: bool = True,
    overwrite: bool = False,
    tuning: TuningRequest | None = None,
) -> Manifest:
    """An index folder over vectors computed elsewhere (row i = passage i of `corpus`, embedded by `encoder`): the
    scale benchmark's cached and synthetic vectors, and tests."""
    tmp = building_folder(Path(out), overwrite)
    corpus_manifest, docstore = add_corpus(tmp, corpus, copy_corpus)
    docstore.close()

    def train() -> np.ndarray:
        if train_vectors is None:
            raise ValueError(f"index type {factory!r} needs training vectors")
        return train_vectors

    return write_dense_folder(tmp, Path(out), factory=factory, dim=encoder.dim, train=train, chunks=vectors,
                              encoder=encoder, corpus=corpus_manifest, tuning=tuning)


class DenseIndex:
    def __init__(self, manifest: Manifest, docstore: DocStore, faiss_index: faiss.Index, encoder: Encoder,
                 folder: Path | None = None, search_params: str | None = None):
        self.manifest = manifest
        self.docstore = docstore
        self.faiss_index = faiss_index
        self.encoder = encoder
        self.search_params = search_params
        # The files /health reports the residency of: the FAISS file is memory-mapped, shared between workers.
        self.index_files = {FAISS_FILE: Path(folder) / FAISS_FILE} if folder is not None else {}

    @classmethod
    def load(
        cls,
        folder: Path,
        manifest: Manifest,
        docstore: DocStore,
        *,
        encoder: str | None = None,
        device: str = "cpu",
        query_dtype: Literal["float32", "bfloat16"] = "float32",
        query_backend: str = "auto",
        gpu: bool = False,
        search_params: str | None = None,
    ) -> DenseIndex:
        if manifest.encoder is None:
            raise ValueError(f"index {folder}: a dense manifest without an encoder section; rebuild the index")
        spec = spec_from_manifest(manifest.encoder)
        if encoder is not None:
            requested = resolve_encoder(encoder)
            check_requested_encoder(manifest.encoder, requested)
            spec = requested
        # Any backend of the index's model may encode the queries (the probe check refuses one that drifts).
        enc = Encoder(spec, device=device, dtype=query_dtype, backend=query_backend)
        check_loaded_encoder(manifest.encoder, enc)
        index = read_faiss_file(folder, FAISS_FILE, manifest.index_file)
        use_blas_from(BLAS_MIN_QUERIES, index.d)
        if index.ntotal != manifest.corpus.num_docs or index.d != manifest.encoder.dim:
            raise ValueError(
                f"index {folder}: {FAISS_FILE} holds {index.ntotal} vectors of dim {index.d}, the manifest says "
                f"{manifest.corpus.num_docs} of dim {manifest.encoder.dim}; rebuild the index"
            )
        # e.g. "nprobe=64" for IVF, "efSearch=128" for HNSW; without one, what `--target-recall` chose at build
        search_params = search_params or (manifest.tuning.params if manifest.tuning else None)
        if search_params:
            try:
                faiss.ParameterSpace().set_index_parameters(index, search_params)
            except RuntimeError as e:
                raise ValueError(f"search parameters {search_params!r} do not apply to this {manifest.index_factory} "
                                 f"index: {str(e).strip().splitlines()[-1]}") from e
        if gpu:
            index = to_all_gpus(index)
        return cls(manifest, docstore, index, enc, folder=Path(folder), search_params=search_params or None)

    def search_vectors(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), each (n, k), best first; row -1 where the index has fewer than k results."""
        return self.faiss_index.search(np.ascontiguousarray(vectors, dtype=np.float32), k)

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        scores, rows = self.search_vectors(self.encoder.encode_queries(queries), k)
        return [
            [self.docstore.hit(int(row), float(score)) for score, row in zip(score_row, index_row, strict=True) if row >= 0]
            for score_row, index_row in zip(scores, rows, strict=True)
        ]

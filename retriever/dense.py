"""Dense retrieval: a FAISS index (any factory string) over L2-normalised embeddings, searched by inner product."""

from __future__ import annotations

import itertools
import re
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
from retriever.manifest import (
    Manifest,
    check_loaded_encoder,
    check_requested_encoder,
    encoder_manifest,
    spec_from_manifest,
)

FAISS_FILE = "index.faiss"


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
) -> Manifest:
    """Encode every passage of `corpus` and write an index folder at `out`. bfloat16 encodes ~2x faster on CPUs
    with AVX512-BF16/AMX (passage cosine to fp32 >= 0.998 with MiniLM; recall in docs/benchmarks.md); `backend`
    (retriever/encoder.py BACKENDS, or auto) is what runs the encoder, recorded in the manifest. `batch_size`
    None: 32 on a CPU, 128 on a GPU."""
    out = Path(out)
    # Each chunk is sorted by length, so small batches pad little: on a CPU, 32 encoded 1.2x (onnx) and 1.1x (torch)
    # more passages/s than 128 (docs/benchmarks.md, "Encoder backends"); a GPU wants the larger batch.
    batch_size = batch_size or (32 if device == "cpu" else 128)
    enc = Encoder(resolve_encoder(encoder), device=device, dtype=dtype, backend=backend)
    index = new_faiss_index(enc.dim, factory)  # fail on a bad factory string before any encoding
    tmp = building_folder(out, overwrite)
    corpus_manifest, docstore = add_corpus(tmp, corpus, copy_corpus)
    n = len(docstore)
    if not index.is_trained:
        rows = np.sort(np.random.default_rng(seed).choice(n, size=min(train_size, n), replace=False))
        sample = enc.encode_passages([docstore.get(int(r)).contents for r in rows], batch_size, show_progress=True)
        train_faiss_index(index, sample, factory)
    passages = read_jsonl(docstore.corpus_path)
    with tqdm(total=n, desc=f"encoding {n:,} passages", unit="doc") as bar:
        while chunk := list(itertools.islice(passages, chunk_size)):
            index.add(enc.encode_passages([p.contents for p in chunk], batch_size))
            bar.update(len(chunk))
    faiss.write_index(index, str(tmp / FAISS_FILE))
    docstore.close()
    manifest = Manifest(
        kind="dense",
        metric="inner_product",
        index_factory=factory,
        encoder=encoder_manifest(enc),
        corpus=corpus_manifest,
    )
    finish_build(tmp, out, manifest)
    return manifest


class DenseIndex:
    def __init__(self, manifest: Manifest, docstore: DocStore, faiss_index: faiss.Index, encoder: Encoder):
        self.manifest = manifest
        self.docstore = docstore
        self.faiss_index = faiss_index
        self.encoder = encoder

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
        try:
            index = faiss.read_index(str(Path(folder) / FAISS_FILE))
        except RuntimeError as e:
            raise ValueError(f"index {folder}: {FAISS_FILE} is missing or corrupt; rebuild the index ({e})") from e
        if index.ntotal != manifest.corpus.num_docs or index.d != manifest.encoder.dim:
            raise ValueError(
                f"index {folder}: {FAISS_FILE} holds {index.ntotal} vectors of dim {index.d}, the manifest says "
                f"{manifest.corpus.num_docs} of dim {manifest.encoder.dim}; rebuild the index"
            )
        if search_params:  # e.g. "nprobe=64" for IVF, "efSearch=128" for HNSW
            faiss.ParameterSpace().set_index_parameters(index, search_params)
        if gpu:
            index = to_all_gpus(index)
        return cls(manifest, docstore, index, enc)

    def search_vectors(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), each (n, k), best first; row -1 where the index has fewer than k results."""
        return self.faiss_index.search(np.ascontiguousarray(vectors, dtype=np.float32), k)

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        scores, rows = self.search_vectors(self.encoder.encode_queries(queries), k)
        return [
            [self.docstore.hit(int(row), float(score)) for score, row in zip(score_row, index_row, strict=True) if row >= 0]
            for score_row, index_row in zip(scores, rows, strict=True)
        ]

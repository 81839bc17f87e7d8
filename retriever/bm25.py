"""Sparse retrieval: BM25 (bm25s, Lucene's variant) over the same corpus format and docstore as the dense index."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from data.corpus import read_jsonl
from retriever.api import Hit
from retriever.build import add_corpus, building_folder, finish_build
from retriever.docstore import DocStore
from retriever.manifest import BM25Manifest, Manifest

if TYPE_CHECKING:
    import bm25s


def _bm25s():
    """bm25s, with JAX kept on the CPU. bm25s imports JAX where it is installed and runs a top-k at import; on a GPU
    machine JAX then takes 75% of the GPU's memory (its default preallocation), in this process and in the retrieval
    server's. Measured on an H200: 106 + 33 GiB gone before the policy's first step, which ran out of memory
    (docs/benchmarks.md, "GPU"). BM25's top-k is CPU work; a platform the caller chose is kept."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s

    return bm25s


BM25_DIR = "bm25"


def tokenize(texts: list[str], params: BM25Manifest, show_progress: bool = False) -> list[list[str]]:
    return _bm25s().tokenize(texts, stopwords=params.stopwords, return_ids=False, show_progress=show_progress)


def build_bm25_index(
    corpus: Path, out: Path, *, copy_corpus: bool = True, overwrite: bool = False, params: BM25Manifest | None = None
) -> Manifest:
    out, params = Path(out), params or BM25Manifest()
    tmp = building_folder(out, overwrite)
    corpus_manifest, docstore = add_corpus(tmp, corpus, copy_corpus)
    texts = [p.contents for p in read_jsonl(docstore.corpus_path)]
    model = _bm25s().BM25(k1=params.k1, b=params.b, method=params.method)
    model.index(tokenize(texts, params, show_progress=True), show_progress=True)
    model.save(str(tmp / BM25_DIR), show_progress=False)
    docstore.close()
    manifest = Manifest(kind="bm25", metric="bm25", bm25=params, corpus=corpus_manifest)
    finish_build(tmp, out, manifest)
    return manifest


class BM25Index:
    def __init__(self, manifest: Manifest, docstore: DocStore, model: bm25s.BM25, folder: Path | None = None):
        self.manifest = manifest
        self.docstore = docstore
        self.model = model
        self.params = manifest.bm25 or BM25Manifest()
        # bm25s memory-maps its arrays (load(mmap=True)): workers share their pages, as /health shows.
        files = sorted((Path(folder) / BM25_DIR).glob("*.npy")) if folder is not None else []
        self.index_files = {f"{BM25_DIR}/{f.name}": f for f in files}

    @classmethod
    def load(cls, folder: Path, manifest: Manifest, docstore: DocStore) -> BM25Index:
        logging.getLogger("bm25s").setLevel(logging.WARNING)
        try:
            model = _bm25s().BM25.load(str(Path(folder) / BM25_DIR), mmap=True, show_progress=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"index {folder}: the BM25 files are missing or corrupt; rebuild the index ({e})") from e
        return cls(manifest, docstore, model, Path(folder))

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        k = min(k, len(self.docstore))
        rows, scores = self.model.retrieve(tokenize(queries, self.params), k=k, show_progress=False)
        results = []
        for score_row, index_row in zip(scores, rows, strict=True):
            # A passage sharing no term with the query scores 0: it is not a match, so it is not returned
            # (like Search-R1's BM25 retriever, which returns fewer than k then).
            keep = np.flatnonzero(score_row > 0)
            results.append([self.docstore.hit(int(index_row[i]), float(score_row[i])) for i in keep])
        return results

"""Index kinds by name: where each retrieval backend's builder and searcher live, and which of the `emapg index`
and `emapg serve` options each takes. Imports nothing heavy: a manifest names its kind, and validating one (or a CLI
option) loads no backend.

A new backend is one file: its module defines `build_<kind>_index(corpus, out, *, copy_corpus, overwrite,
**build_options) -> Manifest` (writing `Manifest(kind=..., params=...)` for its own settings) and a searcher class
with `load(folder, manifest, docstore, **load_options)` (retriever/index.py's `SearchIndex`), and registers itself
with `register_index_kind` (a built-in backend is one line of INDEX_KINDS instead, so that reading a manifest imports
nothing). Every list of kinds is this registry: the CLI's --kind, the manifest's `kind`, and `GET /health`'s `kind`
(retriever/api.py), so nothing else changes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class IndexKind:
    module: str  # the backend's module
    builder: str  # its build function
    searcher: str  # its SearchIndex class
    metric: str  # what its scores are
    build_options: tuple[str, ...] = ()  # the `emapg index` options it takes (beyond corpus, out, copy, overwrite)
    load_options: tuple[str, ...] = ()  # the load/serve options it takes (encoder, device, ...)

    def build(self, corpus, out, *, copy_corpus: bool, overwrite: bool, **options):
        """Build with the options this kind takes; the others (another kind's) are not passed."""
        fn = getattr(importlib.import_module(self.module), self.builder)
        return fn(corpus, out, copy_corpus=copy_corpus, overwrite=overwrite,
                  **{k: v for k, v in options.items() if k in self.build_options})

    def load(self, folder, manifest, docstore, **options):
        cls = getattr(importlib.import_module(self.module), self.searcher)
        return cls.load(folder, manifest, docstore, **{k: v for k, v in options.items() if k in self.load_options})


INDEX_KINDS: dict[str, IndexKind] = {
    "dense": IndexKind("retriever.dense", "build_dense_index", "DenseIndex", "inner_product",
                       build_options=("encoder", "factory", "batch_size", "train_size", "device", "dtype", "backend",
                                      "target_recall", "tune_k"),
                       load_options=("encoder", "device", "query_dtype", "query_backend", "gpu", "search_params")),
    "bm25": IndexKind("retriever.bm25", "build_bm25_index", "BM25Index", "bm25"),
}


def index_kind(name: str) -> IndexKind:
    if name not in INDEX_KINDS:
        raise ValueError(f"unknown index kind {name!r}: one of {', '.join(INDEX_KINDS)} (retriever/kinds.py)")
    return INDEX_KINDS[name]


def register_index_kind(name: str, kind: IndexKind) -> None:
    """Add a backend under `name`; registering the same definition again is a no-op, another one under a taken name
    is refused (two backends would read each other's index folders)."""
    if INDEX_KINDS.get(name, kind) != kind:
        raise ValueError(f"index kind {name!r} is already registered to {INDEX_KINDS[name].module}")
    INDEX_KINDS[name] = kind

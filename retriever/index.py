"""Index folders: load one (dense FAISS or BM25, as its manifest says) and search it; `retriever/build.py` writes
them.

A folder holds `manifest.json` (written last, so a half-built folder is never mistaken for an index),
`offsets.npy` (row -> byte offset in the corpus), the corpus itself when copied in, and the backend's files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol

from data.corpus import file_sha256
from retriever.api import Hit
from retriever.docstore import OFFSETS_FILE, DocStore
from retriever.kinds import index_kind
from retriever.manifest import Manifest


class SearchIndex(Protocol):
    """What the server searches. A backend may also set `index_files` ({name: path} of the files it memory-maps,
    whose residency GET /health reports) and `search_params` (what it searches with, shown there)."""

    manifest: Manifest

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Best first, at most k hits per query (fewer only when the index has fewer matches)."""
        ...


def open_docstore(folder: Path, manifest: Manifest, verify_checksum: bool = False) -> DocStore:
    """The corpus the index was built from; refused if its size (or, when asked, its sha256) changed."""
    corpus = Path(folder) / manifest.corpus.path  # an absolute recorded path stays absolute
    if not corpus.is_file():
        raise FileNotFoundError(f"index {folder}: corpus {corpus} is missing")
    if corpus.stat().st_size != manifest.corpus.num_bytes or (
        verify_checksum and file_sha256(corpus) != manifest.corpus.sha256
    ):
        raise ValueError(f"index {folder}: corpus {corpus} changed since the index was built; rebuild the index")
    return DocStore.open(corpus, Path(folder) / OFFSETS_FILE, manifest.corpus.num_docs)


def load_index(
    folder: Path,
    *,
    encoder: str | None = None,
    device: str = "cpu",
    query_dtype: Literal["float32", "bfloat16"] = "float32",
    query_backend: str = "auto",
    gpu: bool = False,
    search_params: str | None = None,
    verify_checksum: bool = False,
) -> SearchIndex:
    """Load an index folder. `encoder` (preset, name or path) must match the manifest's, else it is refused."""
    manifest = Manifest.read(folder)
    kind = index_kind(manifest.kind)
    if encoder is not None and "encoder" not in kind.load_options:
        raise ValueError(f"index {folder} is {manifest.kind}: it takes no encoder (got {encoder!r})")
    docstore = open_docstore(folder, manifest, verify_checksum)
    # The backend's module is imported here, not at the top: a BM25 server need not load FAISS, nor a dense one bm25s.
    return kind.load(folder, manifest, docstore, encoder=encoder, device=device, query_dtype=query_dtype,
                     query_backend=query_backend, gpu=gpu, search_params=search_params)

"""Index folders: build one from a JSONL corpus (dense FAISS or BM25), load one, search it.

A folder holds `manifest.json` (written last, so a half-built folder is never mistaken for an index),
`offsets.npy` (row -> byte offset in the corpus), the corpus itself when copied in, and the backend's files.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from data.corpus import file_sha256
from retriever.docstore import OFFSETS_FILE, DocStore, Hit, scan_corpus
from retriever.manifest import CorpusManifest, Manifest

COPIED_CORPUS = "corpus.jsonl"


class SearchIndex(Protocol):
    manifest: Manifest

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        """Best first, at most k hits per query (fewer only when the index has fewer matches)."""
        ...


def building_folder(out: Path, overwrite: bool) -> Path:
    """A fresh temp folder beside `out`; the finished build is renamed over `out` by `finish_build`."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it")
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def finish_build(tmp: Path, out: Path, manifest: Manifest) -> None:
    manifest.write(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def add_corpus(tmp: Path, corpus_path: Path, copy_corpus: bool) -> tuple[CorpusManifest, DocStore]:
    """Copy (or reference) the corpus, record each row's byte offset and the file's checksum."""
    corpus_path = Path(corpus_path).resolve()
    if not corpus_path.is_file():
        raise FileNotFoundError(f"corpus {corpus_path} does not exist")
    if copy_corpus:
        shutil.copyfile(corpus_path, tmp / COPIED_CORPUS)
        corpus_path, recorded = tmp / COPIED_CORPUS, COPIED_CORPUS
    else:
        recorded = str(corpus_path)
    offsets, sha256 = scan_corpus(corpus_path)
    if len(offsets) == 0:
        raise ValueError(f"corpus {corpus_path} has no documents")
    np.save(tmp / OFFSETS_FILE, offsets)
    manifest = CorpusManifest(
        path=recorded, sha256=sha256, num_bytes=corpus_path.stat().st_size, num_docs=len(offsets)
    )
    return manifest, DocStore(corpus_path, offsets)


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
    gpu: bool = False,
    search_params: str | None = None,
    verify_checksum: bool = False,
) -> SearchIndex:
    """Load an index folder. `encoder` (preset, name or path) must match the manifest's, else it is refused."""
    manifest = Manifest.read(folder)
    docstore = open_docstore(folder, manifest, verify_checksum)
    if manifest.kind == "bm25":
        from retriever.bm25 import BM25Index

        if encoder is not None:
            raise ValueError(f"index {folder} is BM25: it takes no encoder (got {encoder!r})")
        return BM25Index.load(folder, manifest, docstore)
    from retriever.dense import DenseIndex

    return DenseIndex.load(
        folder, manifest, docstore, encoder=encoder, device=device, query_dtype=query_dtype, gpu=gpu,
        search_params=search_params,
    )

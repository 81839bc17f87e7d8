"""Writing an index folder: built in a temp folder beside the target, the corpus (copied or referenced) with its row
offsets and checksum, the manifest last, then renamed into place. `dense.py` and `bm25.py` add their own files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from retriever.docstore import OFFSETS_FILE, DocStore, scan_corpus
from retriever.manifest import CorpusManifest, Manifest

COPIED_CORPUS = "corpus.jsonl"


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

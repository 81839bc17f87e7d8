"""The FAISS file of a dense index folder: written (streamed to disk where the index type allows), recorded in the
manifest, checked against that record and memory-mapped at load.

Memory-mapped, the index's codes stay in the page cache, shared by every process that maps the file: `emapg serve
--workers N`, and replicas on one host, hold one copy of the pages, not N (FAISS >= 1.15 maps the codes of flat,
scalar-quantised, PQ, IVF and HNSW indexes alike with IO_FLAG_MMAP_IFC; measured: under 1.3 MB of heap for each of
those at 100k x 128 dims). An index larger than the memory available is still served, from disk, with a warning.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import faiss
import numpy as np

from retriever.manifest import IndexFileManifest
from retriever.memory import available_bytes

log = logging.getLogger(__name__)
ENDS_BYTES = 1 << 20  # hashed at each end of the file
# Codes mapped, not read: the file's pages are shared between processes and paged in as searches touch them.
MMAP_FLAGS = faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY


def ends_sha256(path: Path) -> str:
    """sha256 of the file's first and last MiB and its size: milliseconds, even on a 64 GB file."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        h.update(f.read(ENDS_BYTES))
        f.seek(max(0, size - ENDS_BYTES))
        h.update(f.read(ENDS_BYTES))
    h.update(size.to_bytes(8, "little"))
    return h.hexdigest()


def record_index_file(folder: Path, name: str) -> IndexFileManifest:
    path = Path(folder) / name
    return IndexFileManifest(name=name, num_bytes=path.stat().st_size, ends_sha256=ends_sha256(path))


def check_index_file(folder: Path, record: IndexFileManifest) -> Path:
    """The file, if it is the one the manifest recorded; else a ValueError naming it and what differs."""
    path = Path(folder) / record.name
    if not path.is_file():
        raise ValueError(f"index {folder}: {path} is missing; rebuild the index")
    size = path.stat().st_size
    if size != record.num_bytes:
        what = "truncated" if size < record.num_bytes else "longer than it was written"
        raise ValueError(f"index {folder}: {path} is {size:,} bytes, the manifest records {record.num_bytes:,} "
                         f"({what}: an interrupted copy?); copy it again or rebuild the index")
    if ends_sha256(path) != record.ends_sha256:
        raise ValueError(f"index {folder}: {path} is not the file this index was built with (its first and last MiB "
                         "differ from the manifest's checksum: corrupt or replaced); rebuild the index")
    return path


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def warn_if_larger_than_memory(path: Path) -> None:
    size, available = path.stat().st_size, available_bytes()
    if available is not None and size > available:
        log.warning(
            "%s is %s, more than the %s of memory available (MemAvailable): it is served memory-mapped, so searches "
            "will read from disk (a search that scans the whole index, Flat or SQ, reads all of it each time) and "
            "share the page cache with every other process; expect disk-speed latency, not an out-of-memory kill",
            path, _size(size), _size(available),
        )


def read_faiss_file(folder: Path, name: str, record: IndexFileManifest | None) -> faiss.Index:
    """The folder's FAISS file, memory-mapped, after checking it against the manifest's record (manifests from
    before the record, and adopted folders, are read unchecked; FAISS's own errors still name the file)."""
    path = check_index_file(folder, record) if record is not None else Path(folder) / name
    if not path.is_file():
        raise ValueError(f"index {folder}: {path} is missing; rebuild the index")
    warn_if_larger_than_memory(path)
    try:
        return faiss.read_index(str(path), MMAP_FLAGS)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ValueError(f"index {folder}: {path} is not a FAISS index FAISS {faiss.__version__} can read "
                         f"(corrupt or truncated?): {reason}; rebuild the index") from e


class _StreamLayout:
    """Where a flat-code index's file keeps its vector count and its codes: the file is `head`, the codes' length
    field, the codes, then `tail`; `head` holds ntotal at `ntotal_at`. Found by serialising the trained index
    empty, with one vector and with two, and kept only if it predicts all three files byte for byte."""

    def __init__(self, empty: bytes, ntotal_at: int, size_at: int, size_unit: int):
        self.head, self.tail = empty[:size_at], empty[size_at + 8:]
        self.ntotal_at, self.size_unit = ntotal_at, size_unit

    def file(self, n: int, codes: bytes) -> bytes:
        return self.header(n) + (self.size_unit * n).to_bytes(8, "little") + codes + self.tail

    def header(self, n: int) -> bytes:
        return self.head[:self.ntotal_at] + n.to_bytes(8, "little") + self.head[self.ntotal_at + 8:]


def _serialized(index: faiss.Index) -> bytes:
    return faiss.serialize_index(index).tobytes()


def stream_layout(index: faiss.Index) -> _StreamLayout | None:
    """The layout of this trained, empty index's file if its codes can be streamed (IndexFlatCodes: Flat, SQ, PQ
    in FAISS's current format), else None (IVF, HNSW, refine: added in memory)."""
    if index.ntotal != 0 or not isinstance(faiss.downcast_index(index), faiss.IndexFlatCodes):
        return None
    probe = np.random.default_rng(0).standard_normal((2, index.d)).astype(np.float32)
    probe /= np.linalg.norm(probe, axis=1, keepdims=True)
    codes = faiss.downcast_index(index).sa_encode(probe).tobytes()
    empty = _serialized(index)
    grown = []
    for n in (1, 2):
        copy = faiss.clone_index(index)
        copy.add(probe[:n])
        grown.append(_serialized(copy))
    one, two = grown
    ntotal_at = next((i for i, (a, b) in enumerate(zip(empty, one)) if a != b), None)
    if ntotal_at is None or one[ntotal_at:ntotal_at + 8] != (1).to_bytes(8, "little"):
        return None
    code_bytes = len(codes) // 2
    for size_at in range(ntotal_at + 8, len(empty) - 7):
        if empty[size_at:size_at + 8] != bytes(8) or one[size_at + 8:size_at + 8 + code_bytes] != codes[:code_bytes]:
            continue
        layout = _StreamLayout(empty, ntotal_at, size_at, int.from_bytes(one[size_at:size_at + 8], "little"))
        if layout.file(0, b"") == empty and layout.file(1, codes[:code_bytes]) == one and \
                layout.file(2, codes) == two:
            return layout
    return None


def in_memory_bytes_per_vector(index: faiss.Index, probe_size: int = 256) -> float:
    """What one more vector adds to this trained index held in memory (its codes, ids and refine codes), from
    adding a few to a copy."""
    copy = faiss.clone_index(index)
    before = len(faiss.serialize_index(copy))
    probe = np.random.default_rng(0).standard_normal((probe_size, index.d)).astype(np.float32)
    copy.add(probe / np.linalg.norm(probe, axis=1, keepdims=True))
    return (len(faiss.serialize_index(copy)) - before) / probe_size


class FaissFileWriter:
    """Add vectors to a trained index and write it to `path`. A flat-code index (Flat, SQ8, SQfp16, PQ) is
    streamed: its codes go to the file as they are added, so building one larger than memory works (21M x 768 Flat
    is 64.5 GB; FAISS's own `add` would hold it all). Any other index is added in memory and written on close; with
    `expected` vectors, one that would not fit in the memory available is refused before anything is added, rather
    than killed for it halfway."""

    def __init__(self, index: faiss.Index, path: Path, expected: int | None = None):
        self.index, self.path = index, Path(path)
        self.layout = stream_layout(index)
        if self.layout is None and expected is not None:
            need, available = expected * in_memory_bytes_per_vector(index), available_bytes()
            if available is not None and need > available:
                raise ValueError(
                    f"building this index over {expected:,} vectors holds ~{_size(int(need))} in memory (FAISS adds "
                    f"IVF, HNSW and refine codes in memory before writing them), more than the {_size(available)} "
                    "available (MemAvailable): use a flat-code type (Flat, SQ8, SQfp16: streamed to disk), a "
                    "smaller code (PQ), or a machine with more memory"
                )
        self.ntotal = 0
        self._file = open(self.path, "wb") if self.layout is not None else None
        if self._file is not None:
            self._file.write(self.layout.header(0) + bytes(8))

    @property
    def streamed(self) -> bool:
        return self.layout is not None

    def add(self, vectors: np.ndarray) -> None:
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.index.d:
            raise ValueError(f"vectors of shape {vectors.shape} for an index of dim {self.index.d}")
        if self._file is None:
            self.index.add(vectors)
        else:
            self._file.write(faiss.downcast_index(self.index).sa_encode(vectors).tobytes())
        self.ntotal += len(vectors)

    def close(self) -> None:
        if self._file is None:
            faiss.write_index(self.index, str(self.path))
            return
        self._file.write(self.layout.tail)
        self._file.seek(0)
        self._file.write(self.layout.header(self.ntotal) + (self.layout.size_unit * self.ntotal).to_bytes(8, "little"))
        self._file.close()

    def __enter__(self) -> FaissFileWriter:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        elif self._file is not None:
            self._file.close()

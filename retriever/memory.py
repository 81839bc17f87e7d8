"""What a server process holds in memory, read from Linux's /proc: its RSS, PSS and private bytes, and how much of
the index files it maps are resident and whether those pages are its own or shared.

RSS counts every page a process touches, so N workers memory-mapping one index each show the whole index in RSS;
PSS divides each shared page among the processes mapping it (summed over the processes it is the machine's real
use), and private bytes are what this process alone holds (what a second worker would add). A memory-mapped index
shows as shared, a copy read into the heap as private. On other systems the fields are None.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, Field

PROC = Path("/proc")


class MappedFile(BaseModel):
    name: str = Field(description="the file, relative to the index folder")
    num_bytes: int = Field(description="the file's size")
    resident_bytes: int = Field(description="its pages in this process's RSS")
    private_bytes: int = Field(description="of those, pages no other process maps (a read copy would be all private)")


class ProcessMemory(BaseModel):
    """One server process's memory (`GET /health`'s `memory`; the `emapg_retriever_memory_*` gauges)."""

    pid: int
    rss_bytes: int | None = Field(description="resident set: every page this process touches, shared ones whole")
    pss_bytes: int | None = Field(description="proportional set: shared pages divided among the processes that "
                                  "map them; summed over processes, the machine's real use")
    private_bytes: int | None = Field(description="pages only this process holds (Private_Clean + Private_Dirty): "
                                      "what one more worker adds")
    index_files: list[MappedFile] = Field(default_factory=list, description="the index's memory-mapped files")


def _kib_fields(text: str) -> dict[str, int]:
    """`Name:   123 kB` lines as bytes."""
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[name.strip()] = int(parts[0]) * 1024
    return out


def _mapped_files(pid: int | str, paths: set[str]) -> dict[str, tuple[int, int]]:
    """{path: (resident bytes, private bytes)} over this process's mappings of those files (/proc/<pid>/smaps). A
    process with torch loaded has ~10k lines of smaps: the paths are found by string search, and only their
    mappings' fields are parsed; most of the cost is the kernel writing the file, so callers read it off their event
    loop."""
    text = (PROC / str(pid) / "smaps").read_text()
    found = {}
    for path in paths:
        rss = private = 0
        at = text.find(" " + path + "\n")
        while at >= 0:
            fields = _kib_fields("\n".join(itertools.takewhile(  # the mapping's "Name: value" lines
                lambda line: line.split(" ", 1)[0].endswith(":"), text[at:at + 4096].split("\n")[1:])))
            rss += fields.get("Rss", 0)
            private += fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
            at = text.find(" " + path + "\n", at + 1)
        found[path] = (rss, private)
    return found


def process_memory(pid: int | str = "self", index_files: Mapping[str, Path] | None = None) -> ProcessMemory:
    """This process's memory (or another's, by pid), with the residency of `index_files` ({name: path}) where it
    maps them."""
    number = os.getpid() if pid == "self" else int(pid)
    try:
        rollup = _kib_fields((PROC / str(pid) / "smaps_rollup").read_text())
    except OSError:  # not Linux, or a kernel without smaps_rollup (< 4.14)
        return ProcessMemory(pid=number, rss_bytes=None, pss_bytes=None, private_bytes=None)
    files = {str(Path(path).resolve()): name for name, path in (index_files or {}).items()}
    mapped = _mapped_files(pid, set(files)) if files else {}
    return ProcessMemory(
        pid=number,
        rss_bytes=rollup.get("Rss"),
        pss_bytes=rollup.get("Pss"),
        private_bytes=rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0),
        index_files=[
            MappedFile(name=name, num_bytes=os.path.getsize(real), resident_bytes=mapped.get(real, (0, 0))[0],
                       private_bytes=mapped.get(real, (0, 0))[1])
            for real, name in files.items()
        ],
    )


def available_bytes() -> int | None:
    """MemAvailable: what the kernel can give without swapping (free memory plus reclaimable page cache)."""
    try:
        return _kib_fields((PROC / "meminfo").read_text()).get("MemAvailable")
    except OSError:
        return None


def processes_mapping(root: int, path: Path) -> list[int]:
    """`root` and its child processes that map `path`: a one-process server itself, or the worker processes of
    `emapg serve --workers N` (uvicorn's parent maps nothing)."""
    real = " " + str(Path(path).resolve()) + "\n"
    try:
        kids = [int(c) for c in (PROC / str(root) / "task" / str(root) / "children").read_text().split()]
    except OSError:
        return []
    found = []
    for pid in [root, *kids]:
        try:
            if real in (PROC / str(pid) / "maps").read_text():
                found.append(pid)
        except OSError:  # exited meanwhile
            continue
    return found

"""The README is a front door: short, and every page it sends a reader to exists (the sections moved out of it are
reachable from it), and so does every relative link of the pages under docs/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(page.read_text()) if "://" not in target]


def test_the_readme_is_short_and_links_every_moved_section():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 250
    linked = {Path(target).name for target in relative_links(readme)}
    moved = {"retriever.md", "training.md", "evaluation.md", "viewer.md", "scaling.md", "docker.md", "evidence.md",
             "export.md", "metrics.md", "algorithm.md", "architecture.md", "benchmarks.md"}
    assert moved <= linked, sorted(moved - linked)


def test_every_relative_link_in_the_readme_and_docs_resolves():
    broken = [f"{page.relative_to(ROOT)} -> {target}" for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
              for target in relative_links(page) if not (page.parent / target).exists()]
    assert not broken, broken

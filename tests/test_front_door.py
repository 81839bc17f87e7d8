"""The README is a front door: short, and every page it sends a reader to exists (the sections moved out of it are
reachable from it), and so does every relative link of the pages under docs/ and every repository path README names.

Which of README's words are repository paths (`named_paths`): README is read with its fenced code blocks and its
inline code spans, and each whitespace-separated word of those, plus each `](target)` link target, is looked at. A word
is taken for a path when, after trimming the punctuation around it,
- it starts with `../`, or with `/` and ends in a file suffix (`.md`, `.py`, ...): a path outside the repository,
  always refused (URL routes such as `/health` have no suffix and are not paths);
- or its first segment, before any `/`, is a top-level file or folder of the repository that git does not ignore
  (`trainer/run/loop.py`, `configs/cpu_demo.yaml`, `docs/x.md`, `Makefile`): it must exist.
Anything else is not a path: commands and options, config keys (`kl.beta=0.1`), metric names (`kl/grad_share`),
URLs, globs and brace patterns, names relative to a folder said beside them (`kl.py` under `trainer/`), and what a
run writes under an ignored folder (`artifacts/runs/cpu-demo/report.md`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
SUFFIXES = (".md", ".py", ".yaml", ".yml", ".json", ".jsonl", ".sh", ".toml", ".png", ".txt", ".gz", ".cfg")
NOT_A_PATH = re.compile(r"://|[*?{}\[\]<>=$]")
SESSION_LABEL = re.compile(r"\bsession \d+", re.I)


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(page.read_text()) if "://" not in target]


def top_level_names(root: Path) -> set[str]:
    """The repository's top-level files and folders that git keeps: not hidden, not in .gitignore's plain names."""
    ignore_file = root / ".gitignore"
    ignored = {line.strip().strip("/") for line in (ignore_file.read_text().splitlines() if ignore_file.exists() else [])
               if line.strip() and not line.startswith("#") and "*" not in line}
    return {p.name for p in root.iterdir() if not p.name.startswith(".") and p.name not in ignored}


def named_paths(text: str, top_level: set[str]) -> list[str]:
    """Every word of README's code (fenced blocks and inline spans) and every link target that is a path (rule above)."""
    fenced = FENCE.findall(text)
    words = [word for block in fenced for word in block.split()]
    words += [word for span in SPAN.findall(FENCE.sub("", text)) for word in span.split()]
    words += LINK.findall(text)
    paths = []
    for word in words:
        word = word.strip("()[],;:'\"").rstrip(".")
        if not word or NOT_A_PATH.search(word):
            continue
        outside = word.startswith("../") or (word.startswith("/") and word.endswith(SUFFIXES))
        if outside or word.removeprefix("./").split("/")[0] in top_level:
            paths.append(word)
    return sorted(set(paths))


def bad_paths(text: str, root: Path) -> list[str]:
    """The paths `named_paths` finds that point outside the repository or name nothing in it."""
    bad = []
    for path in named_paths(text, top_level_names(root)):
        if path.startswith(("../", "/")):
            bad.append(f"{path} (outside the repository)")
        elif not (root / path).exists():
            bad.append(f"{path} (does not exist)")
    return bad


def test_the_readme_is_short_and_links_every_moved_section():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 250
    linked = {Path(target).stem for target in relative_links(readme)}
    moved = {"retriever", "training", "evaluation", "viewer", "scaling", "docker", "evidence", "export", "metrics",
             "algorithm", "architecture", "benchmarks", "design"}
    assert moved <= linked, sorted(moved - linked)


def test_every_relative_link_in_the_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = [f"{page.relative_to(ROOT)} -> {target}" for page in pages
              for target in relative_links(page) if not (page.parent / target).exists()]
    assert not broken, broken


def test_every_repository_path_the_readme_names_exists_inside_it():
    assert not bad_paths((ROOT / "README.md").read_text(), ROOT)


def test_the_path_check_refuses_a_path_outside_and_a_missing_one_and_ignores_what_is_not_a_path():
    outside = "../shared/design" + ".md"  # spelled apart: tests/test_layering.py refuses the name in source
    text = (f"Design: `{outside}`. The loop: `trainer/nope.py`, [gone](docs/nope.md).\n"
            "```\nemapg train --config configs/nope.yaml\n```\n"
            "Fine: `trainer/run/loop.py`, `kl.beta=0.1`, `kl/grad_share`, `/health`, `make demo`, "
            "`artifacts/runs/cpu-demo/report.md`, `docs/evidence/*.tar.gz`, http://127.0.0.1:8050/, [a](docs/design.md)")
    assert bad_paths(text, ROOT) == [f"{outside} (outside the repository)",
                                     "configs/nope.yaml (does not exist)", "docs/nope.md (does not exist)",
                                     "trainer/nope.py (does not exist)"]


def test_no_page_names_an_internal_work_period():
    """Dates, commits and machine kinds label what happened; internal work-period numbers mean nothing to a reader."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [f"{page.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for page in pages
             for n, line in enumerate(page.read_text().splitlines(), 1) if SESSION_LABEL.search(line)]
    assert not found, found

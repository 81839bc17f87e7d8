"""The layers and who assembles them (docs/architecture.md), checked on the source: who may construct rollout engines
and agents, who opens a run's session, and what eval/ may import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("retriever", "agent", "trainer", "eval", "data", "emapg", "experiments")


def sources(*packages: str) -> list[Path]:
    return sorted(path for package in packages for path in (ROOT / package).rglob("*.py"))


def called(path: Path, names: set[str]) -> list[str]:
    """`file:line name` for every call of one of `names` (as `name(...)` or `x.name(...)`) in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if name in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    return found


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, those inside functions included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return out


def test_rollout_engines_and_agents_are_constructed_only_in_agent():
    constructors = {"TransformersBackend", "VLLMBackend", "SearchAgent", "ContinuousSearchAgent"}
    outside = [hit for path in sources(*(p for p in PACKAGES if p != "agent")) for hit in called(path, constructors)]
    assert not outside, f"build them with agent.factory (open_backend, make_agent): {outside}"


def test_only_the_session_opens_a_runs_pieces():
    """emapg's commands get retriever, engine and agents from emapg/session.py; the trainer and the evaluation are
    handed theirs. (A Ray rollout worker is a process of its own: trainer/run/ray_workers.py assembles it with
    agent.factory, the one exception.)"""
    setup = {"running_server", "connect_retriever", "open_backend", "make_agent", "RetrieverClient"}
    callers = sources("emapg", "trainer", "eval")
    allowed = {ROOT / "emapg" / "session.py", ROOT / "trainer" / "run" / "ray_workers.py"}
    # `emapg search` / `emapg mcp` are clients of a running server, not runs: their client is the command itself.
    commands = {"RetrieverClient"}
    outside = [hit for path in callers if path not in allowed for hit in called(path, setup)
               if not (path.name == "cli_retriever.py" and hit.rsplit(" ", 1)[1] in commands)]
    assert not outside, f"open a run's pieces with emapg.session.open_session: {outside}"


def test_eval_imports_nothing_from_the_retriever_or_the_trainer():
    bad = [f"{path.relative_to(ROOT)}:{line} {module}" for path in sources("eval")
           for line, module in imported_modules(path) if module.split(".")[0] in ("retriever", "trainer")]
    assert not bad, f"eval/ reads agents, trajectories and data only: {bad}"


def test_the_checker_sees_calls_and_imports_inside_functions():
    """The scans above read nested code too (the project imports heavy modules inside functions)."""
    probe = ROOT / "emapg" / "session.py"
    assert any("RetrieverClient" in hit for hit in called(probe, {"RetrieverClient"}))
    assert any(module == "agent.factory" for _, module in imported_modules(probe))


def test_docstrings_cite_documents_inside_the_repository():
    """A reader of the code must be able to open what it cites: the design's math is docs/algorithm.md."""
    cited = "design" + ".md"  # spelled apart, so that this file does not match itself
    outside = [f"{path.relative_to(ROOT)}:{i}" for path in sources(*PACKAGES, "tests", "benchmarks")
               for i, line in enumerate(path.read_text().splitlines(), 1) if cited in line]
    assert not outside, f"cite docs/algorithm.md (inside the repository), not the design file outside it: {outside}"

"""The layers and who assembles them (docs/architecture.md), checked on the source: who may construct rollout engines
and agents, who opens a run's session, and what eval/ may import."""

from __future__ import annotations

import ast
import re
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
    """A reader of the code must be able to open what it cites: the design is docs/design.md and its math
    docs/algorithm.md, never the developers' design notes outside the repository (cited by a bare file name)."""
    cited = re.compile(r"(?<!docs/)\b" + "design" + r"\.md")  # spelled apart, so that this file does not match itself
    outside = [f"{path.relative_to(ROOT)}:{i}" for path in sources(*PACKAGES, "tests", "benchmarks")
               for i, line in enumerate(path.read_text().splitlines(), 1) if cited.search(line)]
    assert not outside, f"cite docs/design.md or docs/algorithm.md, inside the repository: {outside}"


# The layers, lowest first (docs/architecture.md): a module may import its own layer and those below it. data is read
# by all; the retriever is reached from above only through its client; agent rolls out; eval scores agents; trainer
# trains. Inside trainer: the algorithm at its top level, then trainer/learner/, then trainer/run/ (the run drives the
# learner, never the other way). emapg (the commands) and experiments assemble everything.
LAYERS = {"data": 0, "retriever": 1, "agent": 2, "eval": 3, "trainer": 4, "trainer.learner": 5, "trainer.run": 6,
          "emapg": 7, "experiments": 7}


def layer(module: str) -> int | None:
    """The layer of a dotted module name (the longest listed prefix), None for what is not the project's."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    return None


def upward_imports(paths: list[Path]) -> list[str]:
    bad = []
    for path in paths:
        own = layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
        bad += [f"{path.relative_to(ROOT)}:{line} {module}" for line, module in imported_modules(path)
                if (theirs := layer(module)) is not None and theirs > own]
    return bad


def test_no_module_imports_from_a_higher_layer():
    bad = upward_imports(sources(*PACKAGES))
    assert not bad, f"an import that points up a layer (LAYERS above): {bad}"


def test_the_layer_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself can fail: a learner module importing the run, and an agent module importing eval."""
    fake_root = tmp_path / "project"
    for name, text in {"trainer/learner/fake_up.py": "from trainer.run.guard import Guard\n",
                       "agent/fake_up.py": "def f():\n    from eval.metrics import exact_match\n",
                       "trainer/fake_down.py": "from data.qa import normalize_answer\n"}.items():
        (fake_root / name).parent.mkdir(parents=True, exist_ok=True)
        (fake_root / name).write_text(text)
    monkeypatch.setattr(__import__(__name__), "ROOT", fake_root)
    bad = upward_imports(sorted(fake_root.rglob("*.py")))
    assert sorted(hit.split(":")[0] for hit in bad) == ["agent/fake_up.py", "trainer/learner/fake_up.py"]

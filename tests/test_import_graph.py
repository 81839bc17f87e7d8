"""The project's modules import each other without a circle (read from the source: every `import`, lazy ones inside
functions included, since a lazy import is how a circle hides), and validating a config imports no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("retriever", "agent", "trainer", "eval", "data", "emapg", "experiments")


def project_modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of PACKAGES (a package by its __init__.py)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` (module `name`) imports anywhere in its body: `from a import b` counts a.b where
    that is a module, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            out.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return {m for m in out if m in modules and m != name}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_circles_finds_a_circle_through_a_lazy_import(tmp_path):
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    lazy = tmp_path / "m.py"
    lazy.write_text("import os\n\ndef f():\n    from trainer import kl\n    from . import n\n")
    modules = {"trainer": Path(), "trainer.kl": Path(), "trainer.m": lazy, "trainer.n": Path()}
    assert imported(lazy, "trainer.m", modules) == {"trainer.kl", "trainer.n"}


def test_no_module_of_the_project_imports_itself_through_others():
    modules = project_modules()
    assert {"trainer.learner.learner", "trainer.kl", "trainer.registry", "emapg.cli"} <= set(modules)
    graph = {name: imported(path, name, modules) for name, path in modules.items()}
    assert circles(graph) == []


def test_validating_a_config_imports_no_torch():
    """In a fresh interpreter: a config with every registered-name field set to a built-in is checked without
    importing torch or any algorithm module. (A name no registry declares is looked for in the module that defines
    the built-ins, so that a new one there needs no declaration: that error path may import it; it still fails.)"""
    code = (
        "import sys\n"
        "from trainer.config import ConfigError, load_config\n"
        "load_config(ROOT / 'configs/cpu_evidence.yaml', ['kl.estimator=k3', 'kl.iw_clip=2', "
        "'train.aggregation=seq-mean-token-mean', 'train.advantage=grpo'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') or m in "
        "('trainer.kl', 'trainer.advantages', 'trainer.policy_loss'))\n"
        "assert not heavy, heavy\n"
        "try:\n"
        "    load_config(overrides=['kl.estimator=k9'])\n"
        "except ConfigError as e:\n"
        "    assert 'kl.estimator' in str(e) and 'k3_clamped' in str(e)\n"
        "else:\n"
        "    raise AssertionError('an unknown estimator passed validation')\n"
    )
    subprocess.run([sys.executable, "-c", f"from pathlib import Path\nROOT = Path({str(ROOT)!r})\n{code}"],
                   cwd=ROOT, check=True)

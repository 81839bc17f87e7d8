"""The trainer reads top to bottom: no function in trainer/ nests its blocks (for, while, if, with, try) more than
three deep, counted from the function's own body (a nested function starts its own count)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def block_depth(node: ast.AST, depth: int = 0) -> int:
    """The deepest block nesting under `node` (an `elif` is the `if` it continues, not a level of its own)."""
    deepest = depth
    for child in ast.iter_child_nodes(node):
        if isinstance(child, FUNCTIONS):
            continue
        elif_of_node = isinstance(node, ast.If) and isinstance(child, ast.If) and node.orelse == [child]
        nested = depth + 1 if isinstance(child, BLOCKS) and not elif_of_node else depth
        deepest = max(deepest, block_depth(child, nested))
    return deepest


def test_block_depth_counts_loops_and_branches_and_not_an_elif():
    source = "def f(x):\n    for a in x:\n        if a:\n            pass\n        elif x:\n            with x:\n                pass\n"
    assert block_depth(ast.parse(source).body[0]) == 3


def test_no_function_in_trainer_nests_more_than_three_deep():
    deep = []
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and block_depth(node) > 3:
                deep.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({block_depth(node)})")
    assert not deep, deep

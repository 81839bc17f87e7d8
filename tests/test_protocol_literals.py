"""The protocol's text has one home, agent/protocol.py: no other module writes a tag or observation text itself, the
retriever imports no agent code, and the text is what it was (pinned)."""

from __future__ import annotations

import ast
from pathlib import Path

from agent import protocol
from agent.protocol import answer_turn, format_hits, search_turn, shown_documents, think
from retriever.client import Hit

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("retriever", "agent", "trainer", "eval", "data", "emapg", "experiments", "benchmarks")
HOME = REPO / "agent" / "protocol.py"
# Pieces of protocol text that only agent/protocol.py may write: the tags, the observation's document marker, the
# invalid-action and failed-search messages.
PROTOCOL_TEXT = ("<think>", "</think>", "<search>", "</search>", "<information>", "</information>", "<answer>",
                 "</answer>", "(Title:", "My previous action is invalid", "The search engine did not answer")


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module, its classes and functions (prose about the protocol is allowed)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def protocol_literals(source: str) -> list[tuple[int, str]]:
    """(line, piece) of every string literal in `source` (f-strings as written) holding a piece of protocol text;
    comments and docstrings are not literals the program uses."""
    tree = ast.parse(source)
    skip = docstrings(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = ast.get_source_segment(source, node) or ""
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value
        else:
            continue
        found.update((node.lineno, piece) for piece in PROTOCOL_TEXT if piece in text)
    return sorted(found)


def test_the_scanner_finds_literals_and_f_strings_not_docstrings_or_comments():
    source = (
        '"""A module about <search> and <answer>."""\n'
        "def turn(q):\n"
        '    """Writes <search> q </search>."""\n'
        "    # <think> in a comment\n"
        '    return f"<search> {q} </search>"\n'
        "def doc(i, title):\n"
        '    return f"Doc {i}(Title: {title})"\n'
        'MESSAGE = ("\\nMy previous action is invalid. "\n'
        '           "Let me try again.")\n'
    )
    assert protocol_literals(source) == [(5, "</search>"), (5, "<search>"), (7, "(Title:"),
                                         (8, "My previous action is invalid")]


def test_no_protocol_text_outside_agent_protocol():
    assert all(piece in HOME.read_text() for piece in PROTOCOL_TEXT)  # each piece is protocol text, written there
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {piece!r}"
        for folder in SCANNED
        for path in sorted((REPO / folder).rglob("*.py"))
        if path != HOME
        for line, piece in protocol_literals(path.read_text())
    ]
    assert not offenders, "protocol text belongs in agent/protocol.py:\n" + "\n".join(offenders)


def test_the_retriever_imports_no_agent_code():
    """trainer -> agent -> retriever: the retriever's hits are structured; the text shown a model is the agent's."""
    offenders = []
    for path in sorted((REPO / "retriever").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "agent"]
    assert not offenders, offenders


HITS = [Hit("1", '"Pride and Prejudice"\nA novel by Jane Austen.', 1.0), Hit("2", '"Bath"\nA city.', 0.5)]


def test_format_hits_is_search_r1s_observation_text():
    assert format_hits(HITS) == "Doc 1(Title: Pride and Prejudice) A novel by Jane Austen.\nDoc 2(Title: Bath) A city."
    assert format_hits([]) == ""


def test_shown_documents_parses_format_hits_up_to_the_truncation():
    shown = format_hits(HITS)
    assert shown_documents(shown, 2) == ["Doc 1(Title: Pride and Prejudice) A novel by Jane Austen.\n",
                                         "Doc 2(Title: Bath) A city."]
    assert shown_documents(shown, 1) == ["Doc 1(Title: Pride and Prejudice) A novel by Jane Austen.\n"]
    cut = shown[: shown.index("Doc 2") + 9]  # document 2's marker cut: it is not shown
    assert shown_documents(cut, 2) == ["Doc 1(Title: Pride and Prejudice) A novel by Jane Austen.\nDoc 2(Tit"]
    assert shown_documents("", 2) == []


def test_turn_writers_and_messages_are_the_pinned_text():
    assert think("I need to look this up.") == "<think> I need to look this up. </think>\n"
    assert search_turn("mona lisa painter") == "<search> mona lisa painter </search>"
    assert answer_turn("Beijing") == "<answer> Beijing </answer>"
    assert (protocol.SEARCH_STOP, protocol.ANSWER_STOP) == ("</search>", "</answer>")
    assert protocol.INVALID_ACTION == (
        "\nMy previous action is invalid. To search, I should put the query between <search> and </search>. "
        "To give the final answer, I should put it between <answer> and </answer>. Let me try again.\n")
    assert protocol.SEARCH_FAILED == "The search engine did not answer; no documents were retrieved."

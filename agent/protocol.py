"""Search-R1's protocol: the prompt, the turn parser, observations, the invalid-action message, the answer.

Tag names are Search-R1's exactly (`<think>`, `<search>`, `<information>`, `<answer>`), so checkpoints and data
made with it carry over. The instruction is in our words, with its meaning kept.

This module is the protocol's only text: every tag, the instructions, the stop strings, the observation text
(`format_hits` and its parser `shown_documents`), the failure and invalid-action messages, and the turn writers the
demonstration builders use, so that a change here reaches rollouts, evaluation and SFT alike
(tests/test_protocol_literals.py fails if a tag or observation literal appears in any other module). The retriever
returns structured hits and knows none of this text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from data.corpus import split_contents

if TYPE_CHECKING:  # an annotation only: the protocol stays importable with the standard library alone (a TRL env)
    from retriever.client import Hit

SEARCH_STOP = "</search>"
ANSWER_STOP = "</answer>"

INSTRUCTION = (
    "Answer the given question. Every time you get new information, first reason about it inside <think> and "
    "</think>. If you find you are missing some knowledge, you can call a search engine with <search> query "
    "</search>, and its top results will be returned between <information> and </information>. You may search "
    "as many times as you need. When no more outside knowledge is needed, give the answer inside <answer> and "
    "</answer> without a detailed explanation, for example <answer> Beijing </answer>. Question: {question}\n"
)

# Baselines of the Search-R1 paper: answer with no retrieval, or with the question's top passages in the prompt.
DIRECT_INSTRUCTION = (
    "Answer the given question. Give the answer inside <answer> and </answer> without a detailed explanation, "
    "for example <answer> Beijing </answer>. Question: {question}\n"
)
RAG_INSTRUCTION = (
    "Answer the given question using the passages below where they help. Give the answer inside <answer> and "
    "</answer> without a detailed explanation, for example <answer> Beijing </answer>.\n"
    "Passages:\n{passages}\nQuestion: {question}\n"
)

# One worked example of the protocol, put before the question for a model that does not follow it zero-shot
# (benchmarks/rollout.py: the packaged SmolLM2-135M then writes tags often enough to measure generation).
ONE_SHOT = (
    "Example:\nQuestion: who painted the mona lisa?\n<think> I should look this up. </think>\n"
    "<search> mona lisa painter </search>\n<information>Doc 1(Title: Mona Lisa) The Mona Lisa is a portrait "
    "painting by Leonardo da Vinci.</information>\n<think> The painter is Leonardo da Vinci. </think>\n"
    "<answer> Leonardo da Vinci </answer>\n\n"
)

INVALID_ACTION = (
    "\nMy previous action is invalid. To search, I should put the query between <search> and </search>. "
    "To give the final answer, I should put it between <answer> and </answer>. Let me try again.\n"
)

# A search's observation body when the retriever failed (the rollout goes on and shows the model this).
SEARCH_FAILED = "The search engine did not answer; no documents were retrieved."

# The first complete <search>...</search> or <answer>...</answer> block; tags are case-sensitive, as trained.
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class Action:
    kind: Literal["search", "answer", "invalid"]
    content: str = ""  # the query or the answer, whitespace-stripped


def prompt_text(question: str, mode: Literal["agent", "direct", "rag"] = "agent", passages: str = "") -> str:
    if mode == "agent":
        return INSTRUCTION.format(question=question)
    if mode == "direct":
        return DIRECT_INSTRUCTION.format(question=question)
    return RAG_INSTRUCTION.format(question=question, passages=passages)


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A user message through the tokenizer's chat template, ready for the assistant's first token."""
    messages = [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def parse_action(turn_text: str) -> Action:
    """What one generated turn asks for: the first search or answer block in it. An empty query is invalid."""
    m = _ACTION.search(turn_text)
    if m is None:
        return Action("invalid")
    kind, content = m.group(1), m.group(2).strip()
    if kind == "search" and not content:
        return Action("invalid")
    return Action(kind, content)  # type: ignore[arg-type]


def extract_answer(model_texts: list[str]) -> str | None:
    """The last <answer> the model wrote. Only the model's own turns are searched: never the prompt (its example
    answer "Beijing") nor a retrieved passage."""
    answers = [m.group(1).strip() for text in model_texts for m in _ANSWER.finditer(text)]
    return answers[-1] if answers else None


def think(thought: str) -> str:
    """A reasoning step as the instruction asks for it, ending its line."""
    return f"<think> {thought} </think>\n"


def search_turn(query: str) -> str:
    """The text of a turn that searches for `query`; generation stops right after it (SEARCH_STOP)."""
    return f"<search> {query} </search>"


def answer_turn(answer: str) -> str:
    """The text of a turn that answers `answer`; generation stops right after it (ANSWER_STOP)."""
    return f"<answer> {answer} </answer>"


def _doc_start(i: int) -> str:
    """How document i (1-based) of an observation begins: written by format_hits, found by shown_documents."""
    return f"Doc {i}(Title:"


def format_hits(hits: list[Hit]) -> str:
    """Search-R1's observation text: `Doc i(Title: <title>) <text>`, one hit per line."""
    lines = []
    for i, hit in enumerate(hits, 1):
        title, text = split_contents(hit.contents)
        lines.append(f"{_doc_start(i)} {title}) {text}")
    return "\n".join(lines)


def shown_documents(shown_text: str, count: int) -> list[str]:
    """format_hits' parser: the text of each of the first `count` documents present in `shown_text` (an observation
    as the model sees it, possibly truncated), from its `Doc i(Title:` to the next document's. It stops at the first
    document truncated away: every one after it is gone too."""
    documents = []
    for i in range(1, count + 1):
        start = shown_text.find(_doc_start(i))
        if start < 0:
            break
        end = shown_text.find(_doc_start(i + 1), start)
        documents.append(shown_text[start : end if end >= 0 else len(shown_text)])
    return documents


def encode(tokenizer, text: str) -> list[int]:
    """Ids of text appended mid-conversation (no BOS or other special tokens)."""
    return tokenizer.encode(text, add_special_tokens=False)


def observation_ids(tokenizer, formatted_hits: str, max_obs_tokens: int) -> list[int]:
    """`<information>` + the hits, truncated to max_obs_tokens, + `</information>`: the ids the model is shown.
    Only the body is truncated, so the closing tag is always there."""
    return (
        encode(tokenizer, "\n\n<information>")
        + encode(tokenizer, formatted_hits)[:max_obs_tokens]
        + encode(tokenizer, "</information>\n\n")
    )

"""Protocol demonstrations for the SFT warm start, made with the real retriever.

A demonstration is a `Trajectory` exactly like a rollout's, written by a template instead of sampled:

    <think> I need to look this up. </think>
    <search> QUERY </search>                                   (model tokens, loss_mask 1)
    <information>Doc 1(Title: ...) ...</information>           (the real server's answer, loss_mask 0)
    <think> Doc 2 has the answer. </think>
    <answer> GOLD </answer>                                    (model tokens, loss_mask 1)

It is kept only when the gold answer is in the information the model is shown (after truncation to
max_obs_tokens), so the model learns to read the answer off the documents, not to guess it. A two-search
demonstration starts with a keyword query whose documents miss the answer, says so, and searches again with
the question. Observations go through the same `observation_ids` as rollouts and are masked as in RL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.protocol import (
    answer_turn,
    encode,
    format_hits,
    observation_ids,
    prompt_ids,
    prompt_text,
    search_turn,
    shown_documents,
    think,
)
from agent.trajectory import Trajectory, Turn
from data.qa import QAExample
from data.qa import normalize_answer
from retriever.client import Hit

# The demonstrations' thoughts (agent.protocol.think wraps them in the protocol's tags).
FIRST_THOUGHT = "I need to look this up."
MISS_THOUGHT = "These documents do not give the answer. I will search again."
HIT_THOUGHT = "Doc {doc} has the answer."

# Words dropped to make the short first query of a two-search demonstration (it usually retrieves worse).
_QUERY_STOPWORDS = frozenset(
    "who what when where which why how whom whose is was are were the a an of in on at to for by with from did "
    "does do has have had be been as that this it its name and or".split()
)


def keyword_query(question: str) -> str:
    """The question without question words and function words: a plausible, weaker first query."""
    words = [w for w in question.rstrip("?").split() if w.lower() not in _QUERY_STOPWORDS]
    return " ".join(words)


def question_query(question: str) -> str:
    return question.strip().rstrip("?").strip()


def gold_in_hits(golden_answers: Sequence[str], hits: list[Hit], shown_text: str) -> tuple[int, str] | None:
    """(1-based doc number, gold answer) of the first document whose part of `shown_text` (the observation as the
    model sees it, possibly truncated) contains a normalised gold answer; None when no shown document does."""
    answers = [(normalize_answer(g), g) for g in golden_answers if normalize_answer(g)]
    for i, shown in enumerate(shown_documents(shown_text, len(hits)), 1):
        doc = normalize_answer(shown)
        for norm, gold in answers:
            if norm in doc:
                return i, gold
    return None


@dataclass(frozen=True)
class Observation:
    hits: list[Hit]
    ids: list[int]
    found: tuple[int, str] | None  # (doc number, gold answer) if the shown documents contain a gold answer


def observe(tokenizer, example: QAExample, hits: list[Hit], max_obs_tokens: int) -> Observation:
    ids = observation_ids(tokenizer, format_hits(hits), max_obs_tokens)
    return Observation(hits, ids, gold_in_hits(example.golden_answers, hits, tokenizer.decode(ids)))


def demonstration(tokenizer, example: QAExample, searches: list[tuple[str, Observation]]) -> Trajectory:
    """The trajectory for these searches (query, what it returned); the last one must have found the answer."""
    found = searches[-1][1].found
    assert found is not None, "the last search of a demonstration must show the gold answer"
    traj = Trajectory(
        uid=f"{example.id}#demo", group_id=example.id, question=example.question,
        golden_answers=list(example.golden_answers), prompt_ids=prompt_ids(tokenizer, prompt_text(example.question)),
    )
    thought = FIRST_THOUGHT
    for query, obs in searches:
        ids = encode(tokenizer, think(thought) + search_turn(query))
        # Demonstrations have no sampler: 0.0 stands in for the log-probs (SFT never reads them).
        start, end = traj.append(ids, model=True, logprobs=[0.0] * len(ids))
        turn = Turn(kind="search", start=start, end=end, finish_reason="stop", query=query,
                    doc_ids=[h.id for h in obs.hits])
        _, turn.observation_end = traj.append(obs.ids, model=False)
        traj.turns.append(turn)
        thought = MISS_THOUGHT
    doc, gold = found
    ids = encode(tokenizer, think(HIT_THOUGHT.format(doc=doc)) + answer_turn(gold))
    start, end = traj.append(ids, model=True, logprobs=[0.0] * len(ids))
    traj.turns.append(Turn(kind="answer", start=start, end=end, finish_reason="stop"))
    traj.answer, traj.done = gold, True
    return traj


def build_demonstrations(
    examples: Sequence[QAExample], retriever, tokenizer, *, topk: int, max_obs_tokens: int, limit: int | None = None,
    batch_size: int = 256,
) -> tuple[list[Trajectory], dict[str, int]]:
    """Demonstrations (at most `limit`, in example order) for the examples whose retrieved documents show a gold
    answer, and counts of what was kept and dropped. One search with the question when it shows the answer; when
    the keyword query's documents do not show it (about 6% of the packaged NQ/TriviaQA questions), the two-search
    form: keyword query, miss, the question, answer."""
    demos: list[Trajectory] = []
    seen, dropped = 0, 0
    for start in range(0, len(examples), batch_size):
        if limit is not None and len(demos) >= limit:
            break
        batch = examples[start : start + batch_size]
        seen += len(batch)
        questions = [question_query(ex.question) for ex in batch]
        keywords = [keyword_query(ex.question) or q for ex, q in zip(batch, questions, strict=True)]
        hits = retriever.search(questions + keywords, topk)
        for i, ex in enumerate(batch):
            full = observe(tokenizer, ex, hits[i], max_obs_tokens)
            if full.found is None:
                dropped += 1
                continue
            short = observe(tokenizer, ex, hits[len(batch) + i], max_obs_tokens)
            if short.found is None and keywords[i] != questions[i]:
                demos.append(demonstration(tokenizer, ex, [(keywords[i], short), (questions[i], full)]))
            else:
                demos.append(demonstration(tokenizer, ex, [(questions[i], full)]))
    demos = demos[:limit]
    two = sum(d.num_searches == 2 for d in demos)
    return demos, {"questions_seen": seen, "dropped_answer_not_shown": dropped, "demonstrations": len(demos),
                   "one_search": len(demos) - two, "two_search": two}

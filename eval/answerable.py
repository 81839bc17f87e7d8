"""The answerable subset: questions whose gold answer the corpus can supply (it is in their top-k passages).

The packaged Wikipedia holds the answer for only ~11% of NQ and ~16% of TriviaQA questions; training and the demo
use this subset (labelled as such), evaluation reports it beside the full set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from tqdm import tqdm

from data.qa import AnswerableSubset, QAExample
from data.qa import normalize_answer


def answer_in_passages(golden_answers: Iterable[str], passages: Sequence[str]) -> bool:
    """True if some normalised gold answer is a substring of some normalised passage. Answers that normalise to
    "" (e.g. "The") are skipped: the empty string is in every passage and would make every question answerable."""
    answers = [a for a in (normalize_answer(g) for g in golden_answers) if a]
    texts = [normalize_answer(p) for p in passages]
    return any(a in t for a in answers for t in texts)


def filter_answerable(
    examples: Sequence[QAExample],
    search: Callable[[list[str]], list[list[str]]],
    k: int,
    index_name: str,
    batch_size: int = 256,
    show_progress: bool = True,
) -> AnswerableSubset:
    """Keep the examples whose gold answer is in the contents of their top-k passages. `search` maps a batch of
    questions to each one's top-k passage contents (the caller wires it to the retriever, asking for k)."""
    if k < 1 or batch_size < 1:
        raise ValueError(f"k and batch_size must be >= 1, got k={k}, batch_size={batch_size}")
    kept: list[QAExample] = []
    with tqdm(total=len(examples), desc=f"answerable@{k}", unit="q", disable=not show_progress) as bar:
        for start in range(0, len(examples), batch_size):
            batch = examples[start : start + batch_size]
            results = search([ex.question for ex in batch])
            # A miswired search (wrong batch alignment, a different topk) would silently change the subset.
            if len(results) != len(batch):
                raise ValueError(f"search returned {len(results)} result lists for {len(batch)} questions")
            for ex, passages in zip(batch, results):
                if len(passages) > k:
                    raise ValueError(f"search returned {len(passages)} passages for k={k} ({ex.id})")
                if answer_in_passages(ex.golden_answers, passages):
                    kept.append(ex)
            bar.update(len(batch))
    return AnswerableSubset(examples=kept, index=index_name, k=k, count=len(kept), total=len(examples))


def cached_answerable_subset(
    examples: Sequence[QAExample],
    search: Callable[[list[str]], list[list[str]]],
    k: int,
    index_name: str,
    path: Path,
) -> AnswerableSubset:
    """The subset saved at `path` if it was made from the same index and k, else computed and saved there."""
    if path.exists() and AnswerableSubset.meta_path(path).exists():
        subset = AnswerableSubset.load(path)
        if (subset.index, subset.k, subset.total) == (index_name, k, len(examples)):
            return subset
    subset = filter_answerable(examples, search, k=k, index_name=index_name)
    subset.save(path)
    return subset

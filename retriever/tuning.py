"""Recall against exact search, and the search parameters that reach a target recall at the least cost.

Exact search is inner product over the same vectors, computed by streaming them past the queries (`ExactTopK`), so
it needs no copy of a 64 GB index. The parameters are FAISS's own (ParameterSpace): nprobe of IVF indexes, efSearch
of HNSW, k_factor_rf of a re-ranking stage (IVF-PQ followed by an exact or fp16 re-rank of k_factor x k candidates);
each is a list FAISS orders by cost, along which recall does not fall, so the cheapest value that reaches the target is
found by bisection (`first_reaching`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import faiss
import numpy as np

from retriever.manifest import SearchTuning

# Tuned one after another in this order, each with the ones not tuned yet at their most expensive: the coarse search
# first (how many lists or graph nodes are visited), then how many of its candidates the refine stage re-ranks.
TUNED_PARAMS = ("nprobe", "efSearch", "k_factor_rf")


def recall_at_k(found: np.ndarray, truth: np.ndarray, k: int) -> float:
    """Mean over queries of |found top-k ∩ exact top-k| / k; a row of -1 (no result) is a miss."""
    found, truth = np.asarray(found)[:, :k], np.asarray(truth)[:, :k]
    if found.shape[0] != truth.shape[0] or truth.shape[1] < k:
        raise ValueError(f"recall@{k}: {found.shape[0]} result rows for {truth.shape[0]} queries, exact top "
                         f"{truth.shape[1]}")
    hits = [len(np.intersect1d(f[f >= 0], t)) for f, t in zip(found, truth, strict=True)]
    return float(np.mean(hits) / k)


class ExactTopK:
    """The exact top-k rows by inner product of `queries`, over vectors seen chunk by chunk (row numbers follow the
    order they were added in)."""

    def __init__(self, queries: np.ndarray, k: int):
        self.queries = np.ascontiguousarray(queries, dtype=np.float32)
        self.k = k
        self.scores = np.full((len(queries), 0), -np.inf, dtype=np.float32)
        self.rows = np.zeros((len(queries), 0), dtype=np.int64)
        self.seen = 0

    def add(self, vectors: np.ndarray) -> None:
        scores = self.queries @ np.asarray(vectors, dtype=np.float32).T
        rows = np.broadcast_to(np.arange(self.seen, self.seen + len(vectors)), scores.shape)
        self.seen += len(vectors)
        if scores.shape[1] > self.k:  # the chunk's own top k first: sorting a 100k-row chunk whole is slow
            part = np.argpartition(-scores, self.k - 1, axis=1)[:, :self.k]
            scores, rows = np.take_along_axis(scores, part, 1), np.take_along_axis(rows, part, 1)
        scores, rows = np.hstack([self.scores, scores]), np.hstack([self.rows, rows])
        keep = min(self.k, scores.shape[1])
        # Best first; equal scores in row order, as FAISS's Flat search returns them.
        order = np.lexsort((rows, -scores), axis=1)[:, :keep]
        self.scores, self.rows = np.take_along_axis(scores, order, 1), np.take_along_axis(rows, order, 1)


def first_reaching(candidates: Sequence, measure: Callable[[object], float], target: float) -> tuple[int, float, bool]:
    """(index, value, reached): the first candidate whose measure reaches `target`, by bisection, assuming the
    measure does not fall along the list; the last candidate (reached False) when none does. Each candidate is
    measured at most once."""
    if not candidates:
        raise ValueError("no candidates to choose from")
    seen: dict[int, float] = {}

    def at(i: int) -> float:
        if i not in seen:
            seen[i] = measure(candidates[i])
        return seen[i]

    last = len(candidates) - 1
    if at(last) < target:
        return last, at(last), False
    lo, hi = 0, last  # at(hi) >= target
    while lo < hi:
        mid = (lo + hi) // 2
        if at(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    return hi, at(hi), True


def parameter_values(index: faiss.Index) -> dict[str, list[int]]:
    """{name: values by cost} of the tunable search parameters of this index (nothing for Flat or SQ)."""
    space = faiss.ParameterSpace()
    space.initialize(index)
    values = {}
    for i in range(space.parameter_ranges.size()):
        r = space.parameter_ranges.at(i)
        if r.name in TUNED_PARAMS:
            values[r.name] = sorted({int(v) for v in faiss.vector_to_array(r.values)})
    if "nprobe" in values:  # FAISS stops at nlist / 2; all lists is exact search over the (compressed) codes
        nlist = faiss.extract_index_ivf(index).nlist
        values["nprobe"] = sorted({v for v in values["nprobe"] if v <= nlist} | {nlist})
    return {name: values[name] for name in TUNED_PARAMS if name in values}


def params_string(params: dict[str, int]) -> str:
    return ",".join(f"{name}={value}" for name, value in params.items())


def tune_search(index: faiss.Index, queries: np.ndarray, truth: np.ndarray, k: int, target: float,
                query_source: str) -> SearchTuning:
    """The cheapest parameters (one at a time, in TUNED_PARAMS order) whose recall@k against `truth` (exact top-k
    rows of `queries`) reaches `target`; they are left set on `index`."""
    if not 0 < target <= 1:
        raise ValueError(f"target recall must be in (0, 1], got {target}")
    space = faiss.ParameterSpace()
    queries = np.ascontiguousarray(queries, dtype=np.float32)

    def recall(params: dict[str, int]) -> float:
        if params:
            space.set_index_parameters(index, params_string(params))
        return recall_at_k(index.search(queries, k)[1], truth, k)

    values = parameter_values(index)
    chosen = {name: vals[-1] for name, vals in values.items()}
    for name, vals in values.items():
        i, _, _ = first_reaching(vals, lambda v, name=name: recall({**chosen, name: v}), target)
        chosen[name] = vals[i]
    measured = recall(chosen)
    return SearchTuning(params=params_string(chosen), k=k, target_recall=target, recall=round(measured, 4),
                        reached=measured >= target, queries=len(queries), query_source=query_source)

"""Repeated searches: how often a trajectory searches for what it already searched for.

A search turn (kind "search") is repeated when, earlier in the same trajectory, a search turn had
    - the same normalised query (`normalize_query`: case folded, ASCII punctuation dropped, whitespace collapsed), or
    - the same set of returned document ids (the order the retriever ranked them in aside; a search that returned no
      documents, a failed one included, matches no other by its documents).
A repeated search shows the model nothing new: the mechanism behind EMA-PG's second search repeating its first (the
same documents in 1,176 of 1,185 held-out questions). Here, not in trainer/, so that eval/ can report it for held-out
trajectories too (eval/ does not import trainer/).
"""

from __future__ import annotations

import string
from collections.abc import Sequence

from agent.trajectory import Trajectory

_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_query(query: str) -> str:
    return " ".join(query.casefold().translate(_DROP_PUNCTUATION).split())


def repeated_searches(traj: Trajectory) -> int:
    """The trajectory's search turns that repeat an earlier one's normalised query or returned documents."""
    queries: set[str] = set()
    documents: set[frozenset[str]] = set()
    repeated = 0
    for turn in traj.turns:
        if turn.kind != "search":
            continue
        query, docs = normalize_query(turn.query or ""), frozenset(turn.doc_ids)
        repeated += query in queries or (bool(docs) and docs in documents)
        queries.add(query)
        if docs:
            documents.add(docs)
    return repeated


def repeated_search_rates(trajs: Sequence[Trajectory]) -> tuple[float, float]:
    """(repeated searches / all searches, share of trajectories with at least one repeated search) over `trajs`;
    0.0 for a batch with no search (or no trajectory)."""
    repeated = [repeated_searches(t) for t in trajs]
    searches = sum(t.num_searches for t in trajs)
    return sum(repeated) / max(1, searches), sum(r > 0 for r in repeated) / max(1, len(trajs))

"""Failed searches: search turns whose retrieval failed (the retriever down past the client's retries, or a refused
request). The rollout goes on (agent.rollout.RolloutSteps.observe shows the model SEARCH_FAILED and records the
error on the turn), so a failure is never a lost trajectory; this counts them, so that a retriever outage shows in
the iteration's metrics instead of only as a lower reward."""

from __future__ import annotations

from collections.abc import Sequence

from agent.trajectory import Trajectory


def failed_searches(trajs: Sequence[Trajectory]) -> int:
    """The search turns of `trajs` recorded with a `retrieval_error`."""
    return sum(turn.retrieval_error is not None for traj in trajs for turn in traj.turns)

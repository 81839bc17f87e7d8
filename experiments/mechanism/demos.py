"""The KB's search strategies through the real server: the check that the ideal one works, and SFT demonstrations
that show a weaker one, so that RL has room above SFT.

Ideal strategy: search each of the question's `queries` (one for a one-hop question, two for a two-hop one) and
answer from Doc 1 of the last search. Every question is checked against the served index: each hop's target (the
bridge city, then the gold answer) must be in Doc 1 of that hop's results as the model is shown them.

Demonstrations show the ideal strategy on one-hop questions, and on two-hop questions only with probability
`full_rate`; otherwise the weak strategy: one search, then the bridge city answered as if it were the answer (EM 0).
A policy that imitates them answers two-hop questions correctly about `full_rate` of the time; RL can learn to
search twice, which reaches reward 1. They are agent/demonstrations.py's trajectories (real observations, masked
as in RL) without its <think> sentences: a tiny model's cost is per model token (its 49k-wide output layer), and
the sentences would triple the model tokens of a trajectory while teaching nothing here.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from agent.protocol import answer_turn, encode, prompt_ids, prompt_text, search_turn
from agent.trajectory import Trajectory, Turn
from experiments.mechanism.kb import KBQuestion
from agent.demonstrations import Observation, observe


def hop_targets(q: KBQuestion) -> tuple[str, ...]:
    """What each search of the ideal strategy must show in Doc 1: the bridge city first on two-hop questions."""
    gold = q.example.golden_answers[0]
    return (q.bridge, gold) if q.bridge is not None else (gold,)


def ideal_observations(questions: list[KBQuestion], retriever, tokenizer, *, topk: int,
                       max_obs_tokens: int) -> list[list[Observation]]:
    """Per question, the observation of each ideal search (in one batched request), `found` set for its target."""
    flat = [(i, hop, query) for i, q in enumerate(questions) for hop, query in enumerate(q.queries)]
    hits = retriever.search([query for _, _, query in flat], topk)
    out: list[list[Observation]] = [[] for _ in questions]
    for (i, hop, _), hop_hits in zip(flat, hits, strict=True):
        target = replace(questions[i].example, golden_answers=(hop_targets(questions[i])[hop],))
        out[i].append(observe(tokenizer, target, hop_hits, max_obs_tokens))
    return out


def works(observations: list[Observation]) -> bool:
    """Every hop's target is in Doc 1 of its search."""
    return all(obs.found is not None and obs.found[0] == 1 for obs in observations)


def answerable(questions: list[KBQuestion], retriever, tokenizer, *, topk: int, max_obs_tokens: int) -> list[KBQuestion]:
    """The questions the ideal strategy answers through the served index."""
    observations = ideal_observations(questions, retriever, tokenizer, topk=topk, max_obs_tokens=max_obs_tokens)
    return [q for q, obs in zip(questions, observations, strict=True) if works(obs)]


def lean_demonstration(tokenizer, question: KBQuestion, searches: list[tuple[str, Observation]], answer: str) -> Trajectory:
    """`<search> query </search>` + the real observation per search, then `<answer> answer </answer>`."""
    example = question.example
    traj = Trajectory(uid=f"{example.id}#demo", group_id=example.id, question=example.question,
                      golden_answers=list(example.golden_answers),
                      prompt_ids=prompt_ids(tokenizer, prompt_text(example.question)))

    def model_turn(text: str) -> tuple[int, int]:
        ids = encode(tokenizer, text)
        return traj.append(ids, model=True, logprobs=[0.0] * len(ids))  # no sampler: SFT never reads them

    for query, obs in searches:
        turn = Turn(kind="search", start=0, end=0, finish_reason="stop", query=query, doc_ids=[h.id for h in obs.hits])
        turn.start, turn.end = model_turn(search_turn(query))
        _, turn.observation_end = traj.append(obs.ids, model=False)
        traj.turns.append(turn)
    start, end = model_turn(answer_turn(answer))
    traj.turns.append(Turn(kind="answer", start=start, end=end, finish_reason="stop"))
    traj.answer, traj.done = answer, True
    return traj


def build_demonstrations(questions: list[KBQuestion], retriever, tokenizer, *, topk: int, max_obs_tokens: int,
                         full_rate: float, seed: int) -> tuple[list[Trajectory], dict[str, int]]:
    """One demonstration per question the ideal strategy answers: ideal on one-hop questions; on two-hop questions
    ideal with probability `full_rate`, else one search and the bridge answered."""
    if not 0 <= full_rate <= 1:
        raise ValueError(f"full_rate must be in [0, 1], got {full_rate}")
    rng = np.random.default_rng(seed)
    observations = ideal_observations(questions, retriever, tokenizer, topk=topk, max_obs_tokens=max_obs_tokens)
    demos: list[Trajectory] = []
    counts = {"questions": len(questions), "dropped_not_answerable": 0, "one_hop": 0, "two_hop_full": 0,
              "two_hop_weak": 0}
    for q, obs in zip(questions, observations, strict=True):
        if not works(obs):
            counts["dropped_not_answerable"] += 1
            continue
        queries = list(zip(q.queries, obs, strict=True))
        if len(queries) == 1:
            counts["one_hop"] += 1
        elif rng.random() < full_rate:
            counts["two_hop_full"] += 1
        else:  # the first search's observation, whose `found` is the bridge: the demonstration answers it
            queries = queries[:1]
            counts["two_hop_weak"] += 1
        found = queries[-1][1].found
        assert found is not None  # works() checked every hop
        demos.append(lean_demonstration(tokenizer, q, queries, found[1]))
    return demos, counts

"""Both rollout schedulers (per-turn, continuous) with a scripted fake engine and a fake searcher: every branch,
token-exactness, masks, seeds, the concurrency cap, and a failing or slow search among others."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.backend import Generation, SamplingParams
from agent.continuous import ContinuousSearchAgent
from agent.protocol import INVALID_ACTION, extract_answer, parse_action
from agent.rollout import SEARCH_FAILED, SearchAgent
from agent.settings import RolloutSettings
from data.qa import QAExample
from retriever.client import Hit, RetrieverUnavailable


class FakeScriptedBackend:
    """Returns, for each prompt, the next scripted turn text of its question, tokenized; records what it saw."""

    def __init__(self, tokenizer, scripts: dict[str, list[tuple[str, str]]]):
        self.tokenizer = tokenizer
        self.scripts = scripts  # question -> [(turn text, finish reason), ...]
        self.calls: list[tuple[list[list[int]], list[str]]] = []
        self.returned: dict[str, list[int]] = {}  # question -> every id returned, in order
        self.turn_of: dict[str, int] = {}
        self.seeds: dict[str, list[tuple[int | None, int]]] = {}  # question -> (params.seed, row) of each turn

    def question_of(self, prompt: list[int]) -> str:
        text = self.tokenizer.decode(prompt)
        return next(q for q in self.scripts if q in text)

    def generate(self, prompts, params: SamplingParams, stop, rows=None):
        self.calls.append((prompts, stop))
        out = []
        for prompt, row in zip(prompts, rows or range(len(prompts)), strict=True):
            q = self.question_of(prompt)
            self.seeds.setdefault(q, []).append((params.seed, row))
            turn = self.turn_of.get(q, 0)
            self.turn_of[q] = turn + 1
            text, finish = self.scripts[q][turn]
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            self.returned.setdefault(q, []).extend(ids)
            out.append(Generation(ids, [-0.01 * (i + 1) for i in range(len(ids))], finish, None))
        return out


class FakeScriptedEngine(FakeScriptedBackend):
    """The scripted backend as an async engine (for the continuous scheduler): one prompt per call, on a fresh event
    loop per rollout; counts the generations in flight."""

    def __init__(self, tokenizer, scripts):
        super().__init__(tokenizer, scripts)
        self.in_flight = self.most_in_flight = 0

    def run(self, coroutine):
        return asyncio.run(coroutine)

    async def agenerate(self, prompt, params, stop, row=0):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.001)  # let other trajectories interleave
        self.in_flight -= 1
        return self.generate([prompt], params, stop, [row])[0]


class FakeSearcher:
    def __init__(self, fail: bool = False, topk: int = 2):
        self.calls: list[list[str]] = []
        self.fail = fail
        self.topk = topk  # its own top-k, as the real client has the run's

    def search(self, queries, topk=None):
        topk = topk or self.topk
        self.calls.append(list(queries))
        if self.fail:
            raise RetrieverUnavailable("retriever at http://127.0.0.1:9/retrieve unavailable after 3 attempts: timeout")
        return [
            [Hit(f"{q}-{i}", f'"Doc about {q}"\n{q} is discussed here. <answer> trap </answer>', 1.0 - i) for i in range(topk)]
            for q in queries
        ]


class FakeAsyncSearcher:
    """FakeSearcher behind the async client's interface. Queries in `fail` raise at once; queries in `slow` wait until
    every other trajectory has finished (`others_done`), then fail as a timeout does."""

    def __init__(self, searcher: FakeSearcher, fail=(), slow=()):
        self.searcher, self.fail, self.slow = searcher, set(fail), set(slow)
        self.others_done: asyncio.Event | None = None

    async def __aenter__(self):
        self.others_done = asyncio.Event()
        return self

    async def __aexit__(self, *exc):
        pass

    async def search(self, queries, topk=None):
        await asyncio.sleep(0.001)
        if set(queries) & self.slow:
            await self.others_done.wait()
            raise RetrieverUnavailable("retriever at http://127.0.0.1:9/retrieve unavailable after 3 attempts: "
                                       "ReadTimeout")
        if set(queries) & self.fail:
            raise RetrieverUnavailable("retriever at http://127.0.0.1:9/retrieve unavailable after 3 attempts: "
                                       "ConnectError")
        return self.searcher.search(queries, topk)


def example(question: str, i: int = 0) -> QAExample:
    return QAExample(f"nq/test/{i}", "nq", "test", question, ("Jane Austen",), "mem")


SCHEDULERS = ["per-turn", "continuous"]


def make_agent(scheduler, tokenizer, scripts, searcher, settings):
    if scheduler == "per-turn":
        backend = FakeScriptedBackend(tokenizer, scripts)
        return SearchAgent(backend, tokenizer, searcher, settings), backend
    engine = FakeScriptedEngine(tokenizer, scripts)
    async_searcher = searcher if isinstance(searcher, FakeAsyncSearcher) else FakeAsyncSearcher(searcher)
    return ContinuousSearchAgent(engine, tokenizer, lambda: async_searcher, settings), engine


def run(tokenizer, scripts, *, scheduler="per-turn", searcher=None, **config):
    searcher = searcher or FakeSearcher()
    agent, backend = make_agent(scheduler, tokenizer, scripts, searcher,
                                RolloutSettings(**{"max_turns": 2, **config}))
    examples = [example(q, i) for i, q in enumerate(scripts)]
    return agent.rollout(examples, SamplingParams(temperature=1.0, seed=0)), backend, searcher


def check_token_exact(traj, backend, tokenizer):
    """Model tokens are exactly what the backend returned, with its log-probs; everything else is masked; every
    generate call saw exactly prompt + response so far; decoding the ids is the text the model saw."""
    q = traj.question
    model_ids = [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
    assert model_ids == backend.returned[q]
    for turn in traj.turns:
        assert all(traj.loss_mask[turn.start : turn.end])
        if turn.observation_end is not None:
            assert not any(traj.loss_mask[turn.end : turn.observation_end])
    assert sum(traj.loss_mask) + sum(t.observation_end - t.end for t in traj.turns if t.observation_end) == len(
        traj.response_ids
    )
    seen = [p for prompts, _ in backend.calls for p in prompts if backend.question_of(p) == q]
    for turn, prompt in zip(traj.turns, seen, strict=True):
        assert prompt == traj.prompt_ids + traj.response_ids[: turn.start]
    lp = [l for l, m in zip(traj.sampler_logprobs, traj.loss_mask, strict=True) if m]
    assert len(lp) == len(model_ids) and all(l < 0 for l in lp)
    assert tokenizer.decode(traj.prompt_ids + traj.response_ids) == traj.render(tokenizer).replace("⟦", "").replace("⟧", "")


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_search_then_answer(tokenizer, scheduler):
    scripts = {
        "who wrote pride and prejudice?": [
            ("<think>I need to look it up.</think>\n<search> pride and prejudice author </search>", "stop"),
            ("<think>It says Jane Austen.</think>\n<answer> Jane Austen </answer>", "stop"),
        ]
    }
    (traj,), backend, searcher = run(tokenizer, scripts, scheduler=scheduler)
    check_token_exact(traj, backend, tokenizer)
    assert [t.kind for t in traj.turns] == ["search", "answer"]
    assert traj.turns[0].query == "pride and prejudice author"
    assert traj.turns[0].doc_ids == ["pride and prejudice author-0", "pride and prejudice author-1"]
    assert traj.answer == "Jane Austen"  # not the prompt's "Beijing", not the "trap" inside a retrieved passage
    obs = tokenizer.decode(traj.response_ids[traj.turns[0].end : traj.turns[0].observation_end])
    assert obs.startswith("\n\n<information>Doc 1(Title: Doc about pride and prejudice author)")
    assert obs.endswith("</information>\n\n")
    assert backend.calls[0][1] == ["</search>", "</answer>"]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_invalid_then_answer_and_how_searches_are_sent(tokenizer, scheduler):
    scripts = {
        "q one?": [("I think it is Paris.", "eos"), ("<answer> Paris </answer>", "stop")],
        "q two?": [("<search> two </search>", "stop"), ("<answer>2</answer>", "stop")],
        "q three?": [("<search> three </search>", "stop"), ("<search>   </search>", "stop"), ("no", "length")],
        "q four?": [("<search> four </search>", "stop"), ("<answer>4</answer>", "stop")],
    }
    trajs, backend, searcher = run(tokenizer, scripts, scheduler=scheduler)
    for t in trajs:
        check_token_exact(t, backend, tokenizer)
    one, two, three, four = trajs
    assert [t.kind for t in one.turns] == ["invalid", "answer"] and one.answer == "Paris"
    invalid = tokenizer.decode(one.response_ids[one.turns[0].end : one.turns[0].observation_end])
    assert invalid == INVALID_ACTION
    assert [t.kind for t in three.turns] == ["search", "invalid", "final"]  # empty query is invalid
    assert three.answer is None
    if scheduler == "per-turn":
        assert searcher.calls == [["two", "three", "four"]]  # one request for all trajectories searching this turn
    else:
        assert sorted(searcher.calls) == [["four"], ["three"], ["two"]]  # each trajectory its own, when it is ready


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_turn_limit_then_a_final_turn_without_search(tokenizer, scheduler):
    scripts = {"loop?": [("<search> a </search>", "stop"), ("<search> b </search>", "stop"),
                         ("<search> c </search> <answer> late </answer>", "stop")]}
    (traj,), backend, searcher = run(tokenizer, scripts, scheduler=scheduler, max_turns=2)
    check_token_exact(traj, backend, tokenizer)
    assert [t.kind for t in traj.turns] == ["search", "search", "final"]
    assert traj.num_searches == 2 and searcher.calls == [["a"], ["b"]]
    assert backend.calls[-1][1] == ["</answer>"]  # search disabled in the last turn
    assert traj.answer == "late"  # an answer written in the final turn still counts


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_final_turn_answer_is_an_answer(tokenizer, scheduler):
    scripts = {"q?": [("<search> a </search>", "stop"), ("<answer> x </answer>", "stop")]}
    (traj,), _, _ = run(tokenizer, scripts, scheduler=scheduler, max_turns=1)
    assert [t.kind for t in traj.turns] == ["search", "answer"] and traj.answer == "x"


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_retrieval_failure_is_shown_masked_and_recorded(tokenizer, scheduler):
    scripts = {"q?": [("<search> a </search>", "stop"), ("<answer> guess </answer>", "stop")]}
    (traj,), backend, _ = run(tokenizer, scripts, scheduler=scheduler, searcher=FakeSearcher(fail=True))
    check_token_exact(traj, backend, tokenizer)
    turn = traj.turns[0]
    assert "unavailable" in turn.retrieval_error and turn.doc_ids == []
    assert SEARCH_FAILED in tokenizer.decode(traj.response_ids[turn.end : turn.observation_end])
    assert traj.answer == "guess"


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_observation_is_truncated_to_max_obs_tokens(tokenizer, scheduler):
    scripts = {"q?": [("<search> a </search>", "stop"), ("<answer> x </answer>", "stop")]}
    (traj,), _, _ = run(tokenizer, scripts, scheduler=scheduler, max_obs_tokens=5)
    turn = traj.turns[0]
    wrapper = len(tokenizer.encode("\n\n<information>", add_special_tokens=False)) + len(
        tokenizer.encode("</information>\n\n", add_special_tokens=False)
    )
    assert turn.observation_end - turn.end == wrapper + 5


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_direct_and_rag_modes(tokenizer, scheduler):
    scripts = {"who wrote it?": [("<answer> Austen </answer>", "stop")]}
    (traj,), backend, searcher = run(tokenizer, scripts, scheduler=scheduler, mode="direct")
    assert searcher.calls == [] and [t.kind for t in traj.turns] == ["answer"]
    assert backend.calls[0][1] == ["</answer>"] and "<search>" not in tokenizer.decode(traj.prompt_ids)
    (traj,), backend, searcher = run(tokenizer, scripts, scheduler=scheduler, mode="rag")
    assert searcher.calls == [["who wrote it?"]]
    assert "Doc 1(Title: Doc about who wrote it?)" in tokenizer.decode(traj.prompt_ids)
    assert traj.answer == "Austen"


ALL_BRANCHES = {
    "q one?": [("I think it is Paris.", "eos"), ("<answer> Paris </answer>", "stop")],
    "q two?": [("<search> two </search>", "stop"), ("<answer>2</answer>", "stop")],
    "q three?": [("<search> three </search>", "stop"), ("<search>   </search>", "stop"), ("no", "length")],
    "q four?": [("<search> four </search>", "stop"), ("<search> more </search>", "stop"), ("<answer>4</answer>", "stop")],
    "q five?": [("<answer>5</answer>", "stop")],
}


def test_continuous_gives_the_per_turn_loops_trajectories_and_seeds(tokenizer):
    """Same scripts, same searcher: the same trajectories field by field, and every turn of trajectory i is seeded
    (params.seed + turn, row i) by both schedulers, whatever else shares its call."""
    per_turn, backend, _ = run(tokenizer, ALL_BRANCHES, scheduler="per-turn", max_obs_tokens=40)
    continuous, engine, _ = run(tokenizer, ALL_BRANCHES, scheduler="continuous", max_obs_tokens=40)
    assert [t.to_dict() for t in continuous] == [t.to_dict() for t in per_turn]
    for row, traj in enumerate(per_turn):
        expected = [(0 + turn, row) for turn in range(len(traj.turns))]
        assert backend.seeds[traj.question] == expected == engine.seeds[traj.question]


def test_a_failing_and_a_slow_search_are_recorded_while_the_others_finish(tokenizer):
    scripts = {f"q {name}?": [(f"<search> {name} </search>", "stop"), (f"<answer> {name} </answer>", "stop")]
               for name in ("ok", "broken", "slow", "fine")}
    searcher = FakeAsyncSearcher(FakeSearcher(), fail={"broken"}, slow={"slow"})
    agent, _ = make_agent("continuous", tokenizer, scripts, searcher, RolloutSettings(max_turns=2))
    finished: list[str] = []

    def on_done(traj):
        finished.append(traj.question)
        if len(finished) == 3:  # the slow search answers (with a timeout) only after the other three are done
            searcher.others_done.set()

    trajs = agent.rollout([example(q, i) for i, q in enumerate(scripts)], SamplingParams(seed=0), on_done=on_done)
    assert finished[-1] == "q slow?" and sorted(finished) == sorted(scripts)
    ok, broken, slow, fine = trajs
    for traj, error in ((broken, "ConnectError"), (slow, "ReadTimeout")):
        turn = traj.turns[0]
        assert error in turn.retrieval_error and turn.doc_ids == []  # recorded, not lost
        assert SEARCH_FAILED in tokenizer.decode(traj.response_ids[turn.end : turn.observation_end])
        assert [t.kind for t in traj.turns] == ["search", "answer"]  # and the trajectory went on to its answer
    for traj in (ok, fine):
        assert traj.turns[0].retrieval_error is None and len(traj.turns[0].doc_ids) == 2
    assert [t.answer for t in trajs] == ["ok", "broken", "slow", "fine"]


def test_the_concurrency_cap_bounds_trajectories_in_flight(tokenizer):
    scripts = {f"q {i}?": [(f"<search> {i} </search>", "stop"), (f"<answer> {i} </answer>", "stop")] for i in range(7)}
    agent, engine = make_agent("continuous", tokenizer, scripts, FakeSearcher(), RolloutSettings(max_turns=1, max_in_flight=3))
    trajs = agent.rollout([example(q, i) for i, q in enumerate(scripts)], SamplingParams(seed=0))
    assert engine.most_in_flight == 3 and [t.answer for t in trajs] == [str(i) for i in range(7)]
    with pytest.raises(ValueError, match="max_in_flight"):
        RolloutSettings(mode="direct", max_in_flight=0)


def test_group_ids_are_example_ids_and_samples_are_distinct(tokenizer):
    backend = FakeScriptedBackend(tokenizer, {"q?": [("<answer>a</answer>", "stop")] * 3})
    agent = SearchAgent(backend, tokenizer, FakeSearcher(), RolloutSettings())
    trajs = agent.rollout([QAExample("hotpotqa/dev/7", "hotpotqa", "dev", "q?", ("a",), "m")], SamplingParams(), 3)
    assert [t.group_id for t in trajs] == ["hotpotqa/dev/7"] * 3
    assert [t.uid for t in trajs] == ["hotpotqa/dev/7#0", "hotpotqa/dev/7#1", "hotpotqa/dev/7#2"]


def test_parser():
    assert parse_action("<think>x</think> <search>  who  </search>").content == "who"
    assert parse_action("<answer>\n Paris \n</answer> <search> x </search>").kind == "answer"  # the first block
    assert parse_action("<search> x </search> <answer> y </answer>").kind == "search"
    assert parse_action("<SEARCH> x </SEARCH>").kind == "invalid"  # tags are case-sensitive
    assert parse_action("<search> unclosed").kind == "invalid"
    assert extract_answer(["<answer> a </answer>", "<answer> b </answer>"]) == "b"
    assert extract_answer(["no tags"]) is None


PIECES = st.sampled_from(list("<>/ searchnwx\n") + ["<search>", "</search>", "<answer>", "</answer>", "é", "\x00"])


@given(st.one_of(st.text(), st.lists(PIECES, max_size=40).map("".join)))
def test_parser_survives_fuzzed_output(text):
    action = parse_action(text)
    assert action.kind in ("search", "answer", "invalid")
    if action.kind != "invalid":
        assert f"<{action.kind}>" in text and action.content == action.content.strip()
    answer = extract_answer([text])
    assert answer is None or "<answer>" in text

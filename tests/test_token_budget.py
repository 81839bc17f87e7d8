"""Micro-batches cut by tokens (train.micro_batch_tokens): the same pi_old, anchor values, losses and gradient as
micro-batches of a fixed number of rows, every pass within the budget (or a single over-long row), and less padding
on a ragged mix of search trajectories."""

from __future__ import annotations

import copy

import pytest
import torch

from agent.trajectory import Trajectory
from trainer.config import load_config
from trainer.ema import EmaAnchor
from trainer.learner.batch import (
    collate, length_prefix_order, pass_tokens, prefix_micro_batches, prefix_order, split_for_ranks,
    token_budget_micro_batches,
)
from trainer.learner.learner import Learner, enable_gradient_checkpointing

PROMPTS, ROLLOUTS = 3, 4


def search_trajectories(vocab: int, prompts: int = PROMPTS, rollouts: int = ROLLOUTS, seed: int = 0,
                        prompt: int = 6) -> list[Trajectory]:
    """Groups of rollouts of one prompt (prompt, + 3 or + 6 tokens), 1-3 searches each: model turns of 2-12 tokens,
    observations of 2-4 'documents' of 3 tokens, an answer of 1-8. The first two rollouts of a group make the same
    first search and so read the same documents (a prefix deeper than the prompt)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    def between(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=g))

    out = []
    for q in range(prompts):
        prompt_ids, search, documents = ids(prompt + 3 * (q % 3)), ids(4), ids(9)
        for r in range(rollouts):
            traj = Trajectory(uid=f"q{q}#{r}", group_id=f"q{q}", question="q", golden_answers=["a"],
                              prompt_ids=prompt_ids)
            for s in range(between(1, 3)):
                alike = s == 0 and r < 2
                turn = search if alike else ids(between(2, 12))
                traj.append(turn, model=True, logprobs=[-1.0] * len(turn))
                traj.append(documents if alike else ids(3 * between(2, 4)), model=False)
            answer = ids(between(1, 8))
            traj.append(answer, model=True, logprobs=[-1.0] * len(answer))
            out.append(traj)
    return out


def make_learner(model, *overrides: str, prompts: int = PROMPTS, rollouts: int = ROLLOUTS) -> Learner:
    cfg = load_config(overrides=[
        f"train.prompts_per_iteration={prompts}", f"train.rollouts_per_prompt={rollouts}",
        f"train.mini_batch_size={prompts * rollouts}", "train.micro_batch_size=4", "train.grad_clip=1e9",
        "kl.estimator=topk", "kl.topk=4", "kl.beta=0.5", *overrides,
    ])
    anchor_model = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():  # an anchor that differs from the policy, so the KL term has a gradient
        for p in anchor_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the update leaves the gradient to inspect
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Learner(model, EmaAnchor(anchor_model), optimizer, scheduler, cfg.train, cfg.kl)


def padding_share(batch, runs, share_prefix: bool) -> float:
    tokens, padding = map(sum, zip(*(pass_tokens(batch.select(r), share_prefix) for r in runs), strict=True))
    return padding / tokens


@pytest.fixture(scope="module")
def batch(tokenizer):
    trajs = search_trajectories(len(tokenizer))
    return collate(trajs, torch.randn(len(trajs), generator=torch.Generator().manual_seed(1)), tokenizer.pad_token_id)


@pytest.mark.parametrize("share_prefix", [False, True])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_token_budget_gives_the_row_count_values_losses_and_gradient(tiny_model, batch, aggregation, share_prefix):
    """Against micro-batches of 4 rows: a budget just under the longest row's (which then runs alone, over it;
    the others one to three to a pass), and one of about four mean rows."""
    widths = batch.prompt_width + batch.response_lengths()
    budgets = (int(widths.max()) - 1, int(4 * widths.float().mean()))
    results = {}
    for name, extra in (("rows", []), *((b, [f"train.micro_batch_tokens={b}"]) for b in budgets)):
        model = copy.deepcopy(tiny_model)
        learner = make_learner(model, f"train.aggregation={aggregation}", f"train.share_prefix={share_prefix}", *extra)
        prepared = learner.prepare(batch)
        runs = learner.micro_rows(prepared)
        stats = learner.update(prepared, torch.Generator().manual_seed(0))
        assert stats["optimizer_steps"] == 1
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        values = (prepared.old_logprobs, prepared.ref_token_logprob, prepared.topk_ids, prepared.ref_topk_logprobs)
        results[name] = (runs, values, stats, grad)
    row_runs, row_values, row_stats, row_grad = results.pop("rows")
    assert row_grad.abs().sum() > 0
    for budget, (runs, values, stats, grad) in results.items():
        assert sorted(map(len, runs)) != sorted(map(len, row_runs))  # grouped otherwise: the check is not vacuous
        assert sorted(torch.cat(runs).tolist()) == list(range(len(batch)))
        if budget == budgets[0]:
            assert [len(r) for r in runs if pass_tokens(batch.select(r), share_prefix)[0] > budget] == [1]
        for a, b in zip(values, row_values, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm"):
            assert stats[key] == pytest.approx(row_stats[key], rel=1e-5, abs=1e-5), key
        torch.testing.assert_close(grad, row_grad, rtol=1e-5, atol=1e-5 * float(row_grad.abs().max()))


@pytest.mark.parametrize("share_prefix", [False, True])
def test_every_pass_within_the_budget_unless_one_row_and_the_cheapest_split(batch, share_prefix):
    """For budgets from below the shortest row to the whole batch: every row once, each micro-batch within the
    budget or a single row; and (on the first 8 rows) the cheapest of every split of the candidate orders into runs
    within the budget, each run priced from the micro-batch itself: `pass_tokens` plus one mean row per pass."""
    whole, _ = pass_tokens(batch, share_prefix)
    shortest = int((batch.prompt_width + batch.response_lengths()).min())
    small = batch.select(torch.arange(8))
    overhead = small.prompt_width + float(small.response_lengths().float().mean())
    orders = [small.response_lengths().argsort(stable=True), *([length_prefix_order(small)] if share_prefix else [])]

    def tokens(rows) -> int:
        return pass_tokens(small.select(rows), share_prefix)[0]

    def cost(runs) -> float:
        return sum(tokens(r) + overhead for r in runs)

    def splits(rows):
        if not len(rows):
            yield []
        for k in range(1, len(rows) + 1):
            for rest in splits(rows[k:]):
                yield [rows[:k], *rest]

    for budget in (shortest - 1, shortest, 2 * shortest, 150, 300, whole):
        runs = token_budget_micro_batches(batch, budget, share_prefix)
        assert sorted(torch.cat(runs).tolist()) == list(range(len(batch)))
        for rows in runs:
            assert len(rows) == 1 or pass_tokens(batch.select(rows), share_prefix)[0] <= budget
        if budget == shortest - 1:
            assert len(runs) == len(batch)  # every row over the budget: each alone
        best = token_budget_micro_batches(small, budget, share_prefix)
        fits = [s for order in orders for s in splits(order) if all(len(r) == 1 or tokens(r) <= budget for r in s)]
        assert cost(best) == pytest.approx(min(map(cost, fits)))


def test_length_prefix_order_keeps_prefixes_together_and_sorts_branches_by_length(batch):
    order = length_prefix_order(batch).tolist()
    assert sorted(order) == sorted(prefix_order(batch).tolist())
    groups = [set(range(q * ROLLOUTS, (q + 1) * ROLLOUTS)) for q in range(PROMPTS)]
    for rows in [*groups, *({q * ROLLOUTS, q * ROLLOUTS + 1} for q in range(PROMPTS))]:  # prompt; prompt + search
        positions = sorted(order.index(r) for r in rows)
        assert positions[-1] - positions[0] == len(rows) - 1
    lengths = batch.response_lengths()
    longest = [max(int(lengths[order[i]]) for i in range(len(order)) if order[i] in g) for g in groups]
    first = [min(order.index(r) for r in g) for g in groups]
    assert [longest[i] for i in sorted(range(PROMPTS), key=first.__getitem__)] == sorted(longest)


def test_the_learners_micro_batches_are_priced_as_its_pass_runs_and_split_for_the_ranks(tiny_model, tokenizer):
    """The policy decoder's first layer sees exactly the tokens `pass_tokens` counts (prepare's pi_old passes);
    a training pass under activation checkpointing shares no prefix, so its micro-batches are priced whole; with
    several ranks their number is a multiple of the world size. Prompts of 40 tokens: sharing them pays."""
    trajs = search_trajectories(len(tokenizer), prompt=40)
    batch = collate(trajs, torch.zeros(len(trajs)), tokenizer.pad_token_id)
    budget = 200
    model = copy.deepcopy(tiny_model)
    learner = make_learner(model, f"train.micro_batch_tokens={budget}")
    seen, mlp = [], model.get_decoder().layers[0].mlp
    forward = mlp.forward
    mlp.forward = lambda x: seen.append(x.shape[0] * x.shape[1]) or forward(x)
    try:
        learner.prepare(batch)
    finally:
        del mlp.forward
    runs = learner.micro_rows(batch)
    assert sum(seen) == sum(pass_tokens(batch.select(r), True)[0] for r in runs)  # pi_old's passes
    enable_gradient_checkpointing(model)
    model.train()
    whole = learner.micro_rows(batch)
    model.eval()
    assert any(len(r) > 1 and pass_tokens(batch.select(r))[0] > budget for r in runs)  # fits only when shared
    assert all(len(r) == 1 or pass_tokens(batch.select(r))[0] <= budget for r in whole)
    for world in (2, 3, 5):
        split = split_for_ranks(runs, world)
        assert len(split) % world == 0 and sorted(torch.cat(split).tolist()) == list(range(len(batch)))
        assert all(len(r) == 1 or pass_tokens(batch.select(r), True)[0] <= budget for r in split)
    assert split_for_ranks(runs, 1) == runs


def test_token_budget_pads_less_than_row_count_micro_batches(tiny_model, tokenizer):
    """A ragged mix of 8 groups of 5: with a budget of the row-count micro-batches' mean pass, the token-budget ones
    run a smaller share of padding, with prefix sharing on and off; 0 keeps the row-count ones."""
    trajs = search_trajectories(len(tokenizer), prompts=8, rollouts=5, seed=2)
    mix = collate(trajs, torch.zeros(len(trajs)), tokenizer.pad_token_id)
    for share in (False, True):
        rows = make_learner(tiny_model, "train.micro_batch_size=8", f"train.share_prefix={share}", prompts=8,
                            rollouts=5)
        row_runs = rows.micro_rows(mix)
        assert max(map(len, row_runs)) <= 8
        mean = sum(pass_tokens(mix.select(r), share)[0] for r in row_runs) / len(row_runs)
        tokens = make_learner(tiny_model, f"train.micro_batch_tokens={int(mean)}", f"train.share_prefix={share}",
                              prompts=8, rollouts=5)
        runs = tokens.micro_rows(mix)
        assert padding_share(mix, runs, share) < padding_share(mix, row_runs, share)
        assert all(len(r) == 1 or pass_tokens(mix.select(r), share)[0] <= mean for r in runs)
    off = make_learner(tiny_model, "train.micro_batch_size=8", "train.micro_batch_tokens=0", prompts=8, rollouts=5)
    assert [r.tolist() for r in off.micro_rows(mix)] == [r.tolist() for r in prefix_micro_batches(mix, 8)]


def test_micro_batch_tokens_is_checked():
    from trainer.config import ConfigError

    assert load_config().train.micro_batch_tokens == 0
    with pytest.raises(ConfigError, match="micro_batch_tokens"):
        load_config(overrides=["train.micro_batch_tokens=-1"])
    with pytest.raises(ValueError, match="budget"):
        token_budget_micro_batches(None, 0)
    assert split_for_ranks([], 2) == []

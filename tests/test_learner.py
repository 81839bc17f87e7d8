"""The learner's batching is exact: micro-batching (with each micro-batch cut to its longest response) changes
neither pi_old / anchor values nor the accumulated gradient, against the whole batch in one pass."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from agent.trajectory import Trajectory
from trainer.learner.batch import PreparedBatch, collate
from trainer.learner.logprobs import response_logits
from trainer.config import load_config
from trainer.ema import EmaAnchor
from trainer.kl import gather_logprobs
from trainer.learner.learner import Learner, enable_gradient_checkpointing


def ragged_trajectories(vocab: int, n: int = 6) -> list[Trajectory]:
    """Prompts and responses of different lengths; responses interleave model tokens and masked spans."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(0, vocab, (3 + i % 3,), generator=g).tolist()
        traj = Trajectory(uid=f"g{i // 2}#{i % 2}", group_id=f"g{i // 2}", question="q", golden_answers=["a"],
                          prompt_ids=prompt)
        for span in range(1 + i % 3):
            ids = torch.randint(0, vocab, (2 + (i + span) % 4,), generator=g).tolist()
            traj.append(ids, model=True, logprobs=[-1.0] * len(ids))
            if span < i % 3:
                traj.append(torch.randint(0, vocab, (3,), generator=g).tolist(), model=False)
        out.append(traj)
    return out


def make_learner(model, micro: int, aggregation: str, estimator: str = "topk", *overrides: str,
                 temperature: float = 1.0) -> Learner:
    cfg = load_config(overrides=[
        "train.prompts_per_iteration=3", "train.rollouts_per_prompt=2", "train.mini_batch_size=6",
        f"train.micro_batch_size={micro}", f"train.aggregation={aggregation}", "train.grad_clip=1e9",
        f"kl.estimator={estimator}", "kl.topk=4", "kl.beta=0.5", *overrides,
    ])
    anchor_model = copy.deepcopy(model)
    with torch.no_grad():  # an anchor that differs from the policy, so the KL term has a gradient
        for p in anchor_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    anchor = EmaAnchor(anchor_model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the update leaves the gradient to inspect
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Learner(model, anchor, optimizer, scheduler, cfg.train, cfg.kl, temperature)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("estimator", ["topk", "k3"])
def test_micro_batching_gives_the_whole_batch_gradient(tiny_model, tokenizer, aggregation, estimator):
    trajs = ragged_trajectories(len(tokenizer))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    grads, prepared = [], []
    for micro in (6, 1, 3):
        model = copy.deepcopy(tiny_model)
        torch.manual_seed(0)
        learner = make_learner(model, micro, aggregation, estimator)
        batch = collate(trajs, advantages, tokenizer.pad_token_id)
        batch = learner.prepare(batch)
        stats = learner.update(batch, torch.Generator().manual_seed(0))
        assert stats["optimizer_steps"] == 1
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        prepared.append((batch.old_logprobs, batch.ref_token_logprob, batch.topk_ids, batch.ref_topk_logprobs))
    for other in grads[1:]:
        torch.testing.assert_close(other, grads[0], rtol=1e-4, atol=1e-5 * float(grads[0].abs().max()))
    assert grads[0].abs().sum() > 0
    for other in prepared[1:]:
        for a, b in zip(other, prepared[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_gradient(tiny_model, tokenizer):
    trajs = ragged_trajectories(len(tokenizer))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    grads, layer_calls = [], []
    for checkpointing in (False, True):
        model = copy.deepcopy(tiny_model)
        if checkpointing:
            enable_gradient_checkpointing(model)
        torch.manual_seed(0)
        # Length-sorted micro-batches (no prefix sharing: its splits are tested below), so 2 of 3 rows.
        learner = make_learner(model, 3, "token-mean", "topk", "train.share_prefix=false")
        batch = collate(trajs, advantages, tokenizer.pad_token_id)
        batch = learner.prepare(batch)
        calls, mlp = [], model.get_decoder().layers[0].mlp
        forward = mlp.forward  # counted by wrapping: torch's checkpoint recompute does not fire module hooks
        mlp.forward = lambda x, calls=calls, forward=forward: calls.append(1) or forward(x)
        learner.update(batch, torch.Generator().manual_seed(0))
        del mlp.forward
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        layer_calls.append(len(calls))
    # 2 micro-batches; checkpointed, each layer runs again in the backward pass (no gradient probe: iteration 0)
    assert layer_calls == [2, 4]
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-7 * float(grads[0].abs().max()))
    assert grads[0].abs().sum() > 0


def test_prepare_matches_one_uncut_forward_pass(tiny_model, tokenizer):
    trajs = ragged_trajectories(len(tokenizer))
    model = copy.deepcopy(tiny_model)
    learner = make_learner(model, 2, "token-mean")
    rollout = collate(trajs, torch.zeros(len(trajs)), tokenizer.pad_token_id)
    with pytest.raises(TypeError, match="takes the PreparedBatch that prepare"):
        learner.update(rollout)
    batch = learner.prepare(rollout)
    assert isinstance(batch, PreparedBatch) and not isinstance(rollout, PreparedBatch)
    assert batch.input_ids is rollout.input_ids  # the rollout's tensors, not copies
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.old_logprobs = None
    with torch.no_grad():
        full = gather_logprobs(response_logits(model, batch), batch.response_ids[..., None])[..., 0]
    mask = batch.loss_mask
    torch.testing.assert_close(batch.old_logprobs[mask], full[mask], rtol=1e-5, atol=1e-5)
    assert torch.all(batch.old_logprobs[~mask] == 0)  # observations and padding: nothing computed there


def test_packed_update_equals_the_full_logits_reference(tiny_model, tokenizer):
    """The learner runs per-token math at model tokens only (packed); a straightforward (N, T, V) computation of
    the same loss must give the same gradient."""
    from trainer.advantages import broadcast_to_tokens
    from trainer.kl import topk_kl
    from trainer.policy_loss import masked_mean, ppo_clip_loss

    trajs = ragged_trajectories(len(tokenizer))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    model = copy.deepcopy(tiny_model)
    learner = make_learner(model, 6, "token-mean")
    batch = collate(trajs, advantages, tokenizer.pad_token_id)
    batch = learner.prepare(batch)
    learner.update(batch, torch.Generator().manual_seed(0))
    packed_grad = torch.cat([p.grad.flatten() for p in model.parameters()])

    reference = copy.deepcopy(tiny_model)
    mask, ids = batch.loss_mask, batch.response_ids
    with torch.no_grad():
        old = gather_logprobs(response_logits(reference, batch), ids[..., None])[..., 0]
        top = response_logits(reference, batch).topk(4, dim=-1).indices
        anchor = gather_logprobs(response_logits(learner.anchor_logits.model, batch), torch.cat([top, ids[..., None]], -1))
    torch.testing.assert_close(batch.old_logprobs[mask], old[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch.ref_token_logprob[mask], anchor[..., -1][mask], rtol=1e-5, atol=1e-5)
    assert torch.equal(batch.topk_ids[mask], top[mask])
    logits = response_logits(reference, batch)
    logprob = gather_logprobs(logits, ids[..., None])[..., 0]
    pg, _ = ppo_clip_loss(logprob, old, broadcast_to_tokens(advantages, mask), mask)
    kl = topk_kl(logits, anchor[..., :-1], anchor[..., -1], top, ids, direction="reverse", old_token_logprob=old)
    (pg + 0.5 * masked_mean(kl, mask)).backward()
    full_grad = torch.cat([p.grad.flatten() for p in reference.parameters()])
    torch.testing.assert_close(packed_grad, full_grad, rtol=1e-4, atol=1e-5 * float(full_grad.abs().max()))


ESTIMATORS = [("topk", "reverse"), ("topk", "forward"), ("exact", "reverse"), ("exact", "forward"),
              *((kind, "reverse") for kind in ("k1", "k2", "k3", "k3pp", "k4", "k5")), ("none", "reverse")]


def full_logits_loss(policy, anchor, batch, estimator: str, direction: str, entropy_coef: float):
    """Today's learner loss written the straightforward way, from the whole (N, T, V) logits of both models: the
    reference the chunked path must reproduce."""
    from trainer.advantages import broadcast_to_tokens
    from trainer.kl import exact_kl, sampled_kl, topk_kl
    from trainer.policy_loss import masked_mean, ppo_clip_loss

    mask, ids = batch.loss_mask, batch.response_ids
    logits = response_logits(policy, batch, temperature=0.8)
    with torch.no_grad():
        anchor_logits = response_logits(anchor, batch, temperature=0.8)
        old = gather_logprobs(logits, ids[..., None])[..., 0]
        top = (logits if direction == "reverse" else anchor_logits).topk(4, dim=-1).indices
        anchor_values = gather_logprobs(anchor_logits, torch.cat([top, ids[..., None]], -1))
    logprob = gather_logprobs(logits, ids[..., None])[..., 0]
    loss, _ = ppo_clip_loss(logprob, old, broadcast_to_tokens(batch.advantages, mask), mask)
    if estimator == "topk":
        kl = topk_kl(logits, anchor_values[..., :-1], anchor_values[..., -1], top, ids, direction=direction,
                     old_token_logprob=old)
    elif estimator == "exact":
        kl = exact_kl(logits, anchor_logits, direction)
    elif estimator != "none":
        kl = sampled_kl(logprob, anchor_values[..., -1], estimator, old_logprob=old)
    if estimator != "none":
        loss = loss + 0.5 * masked_mean(kl, mask)
    logp = torch.log_softmax(logits, -1)
    return loss - entropy_coef * masked_mean(-(logp.exp() * logp).sum(-1), mask)


@pytest.mark.parametrize(("estimator", "direction"), ESTIMATORS)
def test_chunked_logprobs_give_the_full_logits_losses_and_gradients(tiny_model, tokenizer, estimator, direction):
    """Chunks of 3 model tokens (the ragged batch has 6-13 per micro-batch: uneven last chunks) and no chunking give
    the same pi_old / anchor values, losses and gradients as the full-logits reference, for every KL estimator; with
    an entropy bonus and a sampling temperature, so every term of the head's backward pass is exercised."""
    trajs = ragged_trajectories(len(tokenizer))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    entropy_coef = 0.1 if estimator in ("topk", "exact") else 0.0
    results = {}
    for chunk in (3, 0):
        model = copy.deepcopy(tiny_model)
        torch.manual_seed(0)
        learner = make_learner(model, 3, "token-mean", estimator, f"kl.direction={direction}",
                               f"train.logprob_chunk_tokens={chunk}", f"train.entropy_coef={entropy_coef}",
                               temperature=0.8)
        batch = collate(trajs, advantages, tokenizer.pad_token_id)
        batch = learner.prepare(batch)
        stats = learner.update(batch, torch.Generator().manual_seed(0))
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        results[chunk] = (stats, grad, batch, learner.anchor_logits.model)
    (chunked, grad, batch, anchor), (unchunked, unchunked_grad, unchunked_batch, _) = results[3], results[0]
    for a, b in zip((batch.old_logprobs, batch.ref_token_logprob, batch.ref_topk_logprobs),
                    (unchunked_batch.old_logprobs, unchunked_batch.ref_token_logprob,
                     unchunked_batch.ref_topk_logprobs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert batch.topk_ids is unchunked_batch.topk_ids is None or torch.equal(batch.topk_ids, unchunked_batch.topk_ids)
    for key in ("loss", "policy_loss", "entropy", *(("kl",) if estimator != "none" else ())):
        assert chunked[key] == pytest.approx(unchunked[key], rel=1e-5, abs=1e-6), key

    reference = copy.deepcopy(tiny_model)
    full_logits_loss(reference, anchor, batch, estimator, direction, entropy_coef).backward()
    full_grad = torch.cat([p.grad.flatten() for p in reference.parameters()])
    assert full_grad.abs().sum() > 0
    for g in (grad, unchunked_grad):
        torch.testing.assert_close(g, full_grad, rtol=1e-4, atol=1e-5 * float(full_grad.abs().max()))


def grouped_trajectories(vocab: int) -> list[Trajectory]:
    """Two questions, three rollouts each: a group's rows share their prompt; two of each group's rows also begin
    their response alike (the same search and documents), then part; lengths differ."""
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    out = []
    for q, prompt_len in enumerate((5, 8)):
        prompt, search, documents = ids(prompt_len), ids(3), ids(4)
        for r in range(3):
            traj = Trajectory(uid=f"q{q}#{r}", group_id=f"q{q}", question="q", golden_answers=["a"],
                              prompt_ids=prompt)
            first = search if r < 2 else ids(3)
            traj.append(first, model=True, logprobs=[-1.0] * len(first))
            traj.append(documents if r < 2 else ids(4), model=False)
            answer = ids(2 + r + q)
            traj.append(answer, model=True, logprobs=[-1.0] * len(answer))
            out.append(traj)
    return out


def test_shared_prefix_width_and_order(tokenizer):
    from trainer.learner.batch import prefix_order, shared_prefix_width

    trajs = grouped_trajectories(len(tokenizer))
    batch = collate(trajs, torch.zeros(len(trajs)), tokenizer.pad_token_id)
    width = batch.prompt_width  # 8: the longer prompt; the first group's is left-padded by 3
    assert shared_prefix_width(batch) == 0  # left padding differs between the groups
    assert shared_prefix_width(batch.select(torch.tensor([0, 1, 2]))) == width  # the prompt, padding included
    assert shared_prefix_width(batch.select(torch.tensor([3, 4]))) == width + 3 + 4  # + the same search, documents
    one = batch.select(torch.tensor([4]))
    assert shared_prefix_width(one) == one.input_ids.shape[1] - 1  # a row alone: all but its last column
    order = prefix_order(batch).tolist()
    assert sorted(order) == list(range(6))
    for group in ({0, 1}, {3, 4}, {0, 1, 2}, {3, 4, 5}):  # rows that share most are neighbours
        positions = sorted(order.index(r) for r in group)
        assert positions[-1] - positions[0] == len(group) - 1


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_prefix_micro_batches_are_the_cheapest_runs_of_the_prefix_order(tokenizer, size):
    """Against every split of the prefix order into runs of at most `size` rows, each priced from the micro-batch
    itself (shared_prefix_width and the width select() cuts it to)."""
    from trainer.learner.batch import pass_cost, prefix_micro_batches, prefix_order, shared_prefix_width

    trajs = grouped_trajectories(len(tokenizer)) + ragged_trajectories(len(tokenizer), n=3)
    batch = collate(trajs, torch.zeros(len(trajs)), tokenizer.pad_token_id)
    order = prefix_order(batch)
    overhead = batch.prompt_width + float(batch.response_lengths().float().mean())

    def cost(runs) -> float:
        total = 0.0
        for rows in runs:
            mb = batch.select(rows)
            shared = shared_prefix_width(mb) if len(rows) > 1 else 0
            total += pass_cost(len(rows), mb.input_ids.shape[1], shared, overhead)
        return total

    def splits(rows):
        if not len(rows):
            yield []
        for k in range(1, min(size, len(rows)) + 1):
            for rest in splits(rows[k:]):
                yield [rows[:k], *rest]

    runs = prefix_micro_batches(batch, size)
    assert sorted(torch.cat(runs).tolist()) == list(range(len(trajs))) and max(map(len, runs)) <= size
    assert cost(runs) == pytest.approx(min(cost(split) for split in splits(order)))
    if size >= 3:  # a question's three rollouts share their prompt: one micro-batch each
        assert {frozenset(r.tolist()) for r in runs} >= {frozenset({0, 1, 2}), frozenset({3, 4, 5})}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prefix_passes_give_the_whole_rows_values_and_gradient(tiny_model, tokenizer, checkpointing):
    """share_prefix runs the rows' common columns once; pi_old, the anchor's values and the gradient must equal the
    whole-rows passes', while the decoder sees fewer token rows (counted at layer 0's MLP). Under activation
    checkpointing the training pass runs whole rows (transformers drops the cache there), prepare still shares."""
    trajs = grouped_trajectories(len(tokenizer))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    grads, prepared, tokens = [], [], []
    for share in (False, True):
        model = copy.deepcopy(tiny_model)
        if checkpointing:
            enable_gradient_checkpointing(model)
        torch.manual_seed(0)
        learner = make_learner(model, 3, "token-mean", "topk", f"train.share_prefix={share}")
        seen, mlp = [], model.get_decoder().layers[0].mlp
        forward = mlp.forward
        mlp.forward = lambda x, seen=seen, forward=forward: seen.append(x.shape[0] * x.shape[1]) or forward(x)
        batch = learner.prepare(collate(trajs, advantages, tokenizer.pad_token_id))
        prepare_tokens = sum(seen)
        learner.update(batch, torch.Generator().manual_seed(0))
        del mlp.forward
        # Whole-rows passes over this learner's micro-batches: what the update costs without sharing (x 2: the
        # checkpointed backward runs each layer again; no gradient probe at iteration 0).
        whole_rows = sum(len(r) * batch.select(r).input_ids.shape[1] for r in learner.micro_rows(batch))
        tokens.append((prepare_tokens, sum(seen) - prepare_tokens, whole_rows * (2 if checkpointing else 1)))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        prepared.append((batch.old_logprobs, batch.ref_token_logprob, batch.topk_ids, batch.ref_topk_logprobs))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5 * float(grads[0].abs().max()))
    assert grads[0].abs().sum() > 0
    for a, b in zip(prepared[1], prepared[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    (whole_prepare, whole_update, whole_rows), (shared_prepare, shared_update, shared_whole_rows) = tokens
    assert whole_update == whole_rows
    assert shared_prepare < whole_prepare
    assert shared_update == shared_whole_rows if checkpointing else shared_update < shared_whole_rows


PASS_ESTIMATORS = [("topk", "reverse", 1, "policy"), ("topk", "forward", 1, "anchor"),
                   ("topk_released", "reverse", 1, "policy"), ("exact", "reverse", 0, None),
                   *((kind, "reverse", 1, None) for kind in ("k1", "k2", "k3", "k3pp", "k4", "k5", "k3_clamped")),
                   ("none", "reverse", 0, None)]


@pytest.mark.parametrize(("estimator", "direction", "anchor_passes", "topk_of"), PASS_ESTIMATORS)
def test_prepare_runs_only_the_passes_its_estimator_reads(tiny_model, tokenizer, monkeypatch, estimator, direction,
                                                          anchor_passes, topk_of):
    """Per micro-batch: one policy pass (none when the update is strictly on-policy and the estimator needs no
    pi_old top-k: the update's own forward is pi_old), one anchor pass only where the estimator reads the anchor in
    prepare (not the exact KL, whose update pass reads it, nor with the KL off), and Top-k only for the Top-k
    estimators; the PreparedBatch holds nothing else. Counted by forward hooks on each decoder and a spy on the
    LM-head statistics."""
    import trainer.learner.logprobs

    model = copy.deepcopy(tiny_model)
    learner = make_learner(model, 2, "token-mean", estimator, f"kl.direction={direction}", "train.share_prefix=false")
    passes, topk_requests = [], []
    model.get_decoder().register_forward_hook(lambda *_: passes.append("policy"))
    learner.anchor_logits.model.get_decoder().register_forward_hook(lambda *_: passes.append("anchor"))
    token_logprobs = trainer.learner.logprobs.token_logprobs

    def spy(hidden, head, ids, **options):
        if options.get("topk") is not None:
            topk_requests.append("policy" if head is model.get_output_embeddings() else "anchor")
        return token_logprobs(hidden, head, ids, **options)

    monkeypatch.setattr(trainer.learner.logprobs, "token_logprobs", spy)
    batch = learner.prepare(collate(ragged_trajectories(len(tokenizer)), torch.zeros(6), tokenizer.pad_token_id))
    micro = 3  # 6 rows, 2 per micro-batch
    policy_passes = 0 if learner.pi_old_from_update(batch) else micro  # one mini-batch of 6, one epoch: on-policy
    assert policy_passes == (micro if topk_of == "policy" else 0)
    assert passes.count("policy") == policy_passes and passes.count("anchor") == anchor_passes * micro
    assert topk_requests == ([topk_of] * micro if topk_of else [])
    assert (batch.topk_ids is None) == (batch.ref_topk_logprobs is None) == (topk_of is None)
    assert (batch.ref_token_logprob is None) == (anchor_passes == 0)
    learner.update(batch, torch.Generator().manual_seed(0))  # and the update runs on what prepare gathered


# Stats of one update (make_learner: micro-batches of 2, beta 0.5, k = 4; lr 0) on the ragged batch, recorded from
# the learner before issue 31 (de7d891: prepare always ran pi_old's top-k and the anchor) with this CPU's torch;
# grad_sum is the sum of the gradient over every parameter.
BEFORE_ISSUE_31 = {
    "topk/reverse/true": {
        "loss": 0.39471038927634566, "policy_loss": 0.3809523743887743, "kl": 0.027516055275641736,
        "entropy": 10.789871987842378, "grad_norm": 3.030194044113159, "grad_sum": -3.488790273666382
    },
    "topk/forward/true": {
        "loss": 0.4355875294478167, "policy_loss": 0.3809523743887743, "kl": 0.1092703470161983,
        "entropy": 10.789871987842378, "grad_norm": 3.0332605838775635, "grad_sum": -3.625509262084961
    },
    "exact/reverse/true": {
        "loss": 0.4332344296077888, "policy_loss": 0.3809523743887743, "kl": 0.10456411664684614,
        "entropy": 10.789871987842378, "grad_norm": 3.0434634685516357, "grad_sum": -2.6353964805603027
    },
    "k1/reverse/true": {
        "loss": 0.39467567985966096, "policy_loss": 0.3809523743887743, "kl": 0.02744663360395602,
        "entropy": 10.789871987842378, "grad_norm": 3.448291063308716, "grad_sum": -0.15041017532348633
    },
    "k3/reverse/true": {
        "loss": 0.41483775526285177, "policy_loss": 0.3809523743887743, "kl": 0.06777077327881541,
        "entropy": 10.789871987842378, "grad_norm": 3.0332541465759277, "grad_sum": -3.625181198120117
    },
    "k3/reverse/false": {
        "loss": 0.41483775526285177, "policy_loss": 0.3809523743887743, "kl": 0.06777077327881541,
        "entropy": 10.789871987842378, "grad_norm": 3.0332541465759277, "grad_sum": -3.625181198120117
    },
    "none/reverse/true": {
        "loss": 0.3809523743887743, "policy_loss": 0.3809523743887743, "entropy": 10.789871987842378,
        "grad_norm": 3.0378880500793457, "grad_sum": -2.6893084049224854
    },
}


@pytest.mark.parametrize("case", sorted(BEFORE_ISSUE_31))
def test_the_same_losses_as_before_the_learner_read_only_what_its_estimator_reads(tiny_model, tokenizer, case):
    estimator, direction, importance_weight = case.split("/")
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    learner = make_learner(model, 2, "token-mean", estimator, f"kl.direction={direction}",
                           f"kl.importance_weight={importance_weight}")
    batch = collate(ragged_trajectories(len(tokenizer)), torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]),
                    tokenizer.pad_token_id)
    stats = learner.update(learner.prepare(batch), torch.Generator().manual_seed(0))
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    now = {**{k: stats[k] for k in ("loss", "policy_loss", "kl", "entropy") if k in stats},
           "grad_norm": float(grad.norm()), "grad_sum": float(grad.sum())}
    assert now.keys() == BEFORE_ISSUE_31[case].keys()
    for key, value in BEFORE_ISSUE_31[case].items():
        assert now[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize(("estimator", "entropy_coef"), [("k3", 0.0), ("topk", 0.1)])
def test_gradient_probe_splits_the_first_steps_gradient_into_the_kl_terms_and_the_rest(tiny_model, tokenizer, estimator,
                                                                                     entropy_coef):
    """grad/* against the two gradients taken apart with torch.autograd.grad from the whole logits, over a step of two
    micro-batches (the probe sums the KL term's part across them); beta 0 gives kl_norm 0 and a NaN cosine, the KL
    off gives kl_norm 0, equal rewards give pg_norm 0 and a NaN (not inf) ratio, and off the period nothing."""
    from trainer.advantages import broadcast_to_tokens
    from trainer.kl import sampled_kl, topk_kl
    from trainer.policy_loss import masked_mean, ppo_clip_loss

    trajs = ragged_trajectories(len(tokenizer))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    learner = make_learner(model, 3, "token-mean", estimator, f"train.entropy_coef={entropy_coef}",
                           "train.share_prefix=false", "train.grad_probe_every=1")
    batch = learner.prepare(collate(trajs, advantages, tokenizer.pad_token_id))
    stats = learner.update(batch, torch.Generator().manual_seed(0), iteration=1)

    reference = copy.deepcopy(tiny_model)
    params = list(reference.parameters())
    mask, ids = batch.loss_mask, batch.response_ids
    logits = response_logits(reference, batch)
    logprob = gather_logprobs(logits, ids[..., None])[..., 0]
    pg, _ = ppo_clip_loss(logprob, batch.old_logprobs, broadcast_to_tokens(advantages, mask), mask)
    logp = torch.log_softmax(logits, -1)
    rest = pg - entropy_coef * masked_mean(-(logp.exp() * logp).sum(-1), mask)
    if estimator == "k3":
        kl = sampled_kl(logprob, batch.ref_token_logprob, "k3", old_logprob=batch.old_logprobs)
    else:
        kl = topk_kl(logits, batch.ref_topk_logprobs, batch.ref_token_logprob, batch.topk_ids, ids,
                     direction="reverse", old_token_logprob=batch.old_logprobs)
    kl_grad = torch.cat([g.flatten() for g in torch.autograd.grad(0.5 * masked_mean(kl, mask), params,
                                                                  retain_graph=True)]).double()
    pg_grad = torch.cat([g.flatten() for g in torch.autograd.grad(rest, params)]).double()
    assert float(kl_grad.norm()) > 1e-4 and float(pg_grad.norm()) > 1e-4
    assert stats["grad/kl_norm"] == pytest.approx(float(kl_grad.norm()), rel=1e-3)
    assert stats["grad/pg_norm"] == pytest.approx(float(pg_grad.norm()), rel=1e-3)
    assert stats["grad/kl_pg_ratio"] == pytest.approx(float(kl_grad.norm() / pg_grad.norm()), rel=1e-3)
    cosine = float(kl_grad @ pg_grad / (kl_grad.norm() * pg_grad.norm()))
    assert stats["grad/kl_pg_cosine"] == pytest.approx(cosine, rel=1e-3, abs=1e-4)

    def probed(advantages, *overrides, iteration=1):
        learner = make_learner(copy.deepcopy(tiny_model), 3, "token-mean", estimator, "train.grad_probe_every=2",
                               *overrides)
        return learner.update(learner.prepare(collate(trajs, advantages, tokenizer.pad_token_id)),
                              iteration=iteration)

    for override in ("kl.beta=0", "kl.estimator=none"):
        off = probed(advantages, override)
        assert off["grad/kl_norm"] == 0.0 and off["grad/pg_norm"] > 0 and math.isnan(off["grad/kl_pg_cosine"])
        assert off["grad/kl_pg_ratio"] == 0.0
    flat = probed(torch.zeros(6))  # every group with equal rewards: no policy gradient, only the KL's
    assert flat["grad/pg_norm"] == pytest.approx(0.0, abs=1e-9) and flat["grad/kl_norm"] > 0
    assert math.isnan(flat["grad/kl_pg_ratio"]) and math.isnan(flat["grad/kl_pg_cosine"])
    assert not any(key.startswith("grad/") for key in probed(advantages, iteration=2))  # 2 is off the period
    assert "grad/pg_norm" in probed(advantages, iteration=3)


def test_zero_advantage_groups_counts_the_groups_with_every_advantage_zero():
    from trainer.advantages import zero_advantage_groups

    advantages = torch.tensor([0.0, 0.0, 1.0, -1.0, 0.0, 0.0, 0.0])
    assert zero_advantage_groups(advantages, ["a", "a", "b", "b", "c", "c", "d"]) == 3  # a, c and d (a group of one)
    assert zero_advantage_groups(advantages, ["a", "a", "a", "a", "a", "a", "a"]) == 0


@pytest.mark.parametrize("estimator", ["k3", "k1", "topk"])
def test_iw_clip_clamps_the_importance_weight_of_every_estimator_that_applies_one(tiny_model, tokenizer, estimator):
    """At the first step pi_theta = pi_old, so s = 1 on every token: kl.iw_clip=0.5 halves the sampled estimators'
    KL, and changes the Top-k estimator's (its tail only)."""
    trajs = ragged_trajectories(len(tokenizer))
    kls = {}
    for clip in ("null", "0.5"):
        torch.manual_seed(0)  # the same anchor for both (make_learner perturbs it at random)
        learner = make_learner(copy.deepcopy(tiny_model), 2, "token-mean", estimator, f"kl.iw_clip={clip}")
        batch = learner.prepare(collate(trajs, torch.zeros(6), tokenizer.pad_token_id))
        kls[clip] = learner.update(batch, torch.Generator().manual_seed(0))["kl"]
    if estimator == "topk":
        assert kls["0.5"] != pytest.approx(kls["null"], rel=1e-4)
    else:
        assert kls["0.5"] == pytest.approx(0.5 * kls["null"], rel=1e-5)

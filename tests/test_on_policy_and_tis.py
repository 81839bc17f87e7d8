"""Two changes to what the learner reads as pi_old (issue 45):

- On a strictly on-policy update (one epoch, one mini-batch, one process) prepare runs no policy pass and the update
  reads pi_old off its own forward: losses, stats and gradients equal the two-pass path's, bit for bit where both
  paths group the rows alike; the sampler-gap metric still sees pi_old.
- Truncated importance sampling (trainer/rollout_correction.py): against exact enumeration over a small vocabulary,
  the TIS-weighted policy-gradient under the sampler q equals sum_a q(a) min(p(a)/q(a), C) A(a) grad log pi(a), which
  is the on-policy gradient under p = pi_old when the cap is not reached.
"""

from __future__ import annotations

import copy

import pytest
import torch

from test_learner import make_learner, ragged_trajectories
from trainer.learner.batch import collate
from trainer.policy_loss import ppo_clip_loss
from trainer.rollout_correction import truncated_is_weights

ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])


def one_update(tiny_model, tokenizer, estimator: str, shortcut: bool, *overrides: str):
    """(stats, gradient, decoder passes in prepare) of one update from the same weights and batch."""
    model = copy.deepcopy(tiny_model)
    torch.manual_seed(0)
    learner = make_learner(model, 6, "token-mean", estimator, "train.share_prefix=false", *overrides)
    if not shortcut:  # today's two-pass path, forced
        learner.pi_old_from_update = lambda batch: False
    passes = []
    hook = model.get_decoder().register_forward_hook(lambda *_: passes.append(1))
    batch = learner.prepare(collate(ragged_trajectories(len(tokenizer)), ADVANTAGES, tokenizer.pad_token_id))
    prepare_passes = len(passes)
    hook.remove()
    stats = learner.update(batch, torch.Generator().manual_seed(0))
    gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
    return stats, gradient, prepare_passes, batch


@pytest.mark.parametrize("estimator", ["k3", "k3_clamped", "none"])
def test_the_on_policy_update_reads_pi_old_off_its_own_forward_with_the_same_loss_and_gradient(
        tiny_model, tokenizer, estimator):
    new_stats, new_grad, new_passes, new_batch = one_update(tiny_model, tokenizer, estimator, True)
    old_stats, old_grad, old_passes, old_batch = one_update(tiny_model, tokenizer, estimator, False)
    assert new_passes == 0 and old_passes == 1  # the policy's prepare pass is gone (the anchor's is not the policy's)
    for key in ("loss", "policy_loss", "entropy", "kl", "clip_fraction", "ratio_mean", "grad_norm"):
        if key in old_stats:
            assert new_stats[key] == old_stats[key], key
    assert new_stats["ratio_mean"] == 1.0
    assert torch.equal(new_grad, old_grad)
    assert torch.equal(new_batch.old_logprobs, old_batch.old_logprobs)  # written back: the gap metric reads it
    assert new_stats["sampler_trainer_logprob_gap_max"] == old_stats["sampler_trainer_logprob_gap_max"]


def test_the_shortcut_is_off_where_pi_old_and_the_update_differ_or_prepare_needs_pi_olds_top_k(tiny_model, tokenizer):
    batch = collate(ragged_trajectories(len(tokenizer)), ADVANTAGES, tokenizer.pad_token_id)
    for estimator, overrides, expected in (
            ("k3", (), True), ("k3", ("train.ppo_epochs=2",), False),
            ("k3", ("train.micro_batch_size=3", "train.mini_batch_size=3"), False),
            ("topk", (), False), ("topk", ("kl.direction=forward",), True)):
        learner = make_learner(copy.deepcopy(tiny_model), 6, "token-mean", estimator, *overrides)
        assert learner.pi_old_from_update(batch) is expected, (estimator, overrides)


def test_truncated_importance_sampling_matches_exact_enumeration():
    """One-token trajectories over a vocabulary of 6: the expected PG gradient when tokens are drawn from the
    sampler q and weighted by min(p / q, C), against the closed form, for caps above and below max p / q."""
    torch.manual_seed(0)
    vocab = 6
    theta = torch.randn(vocab, dtype=torch.float64, requires_grad=True)  # the policy's logits; pi_old = pi_theta
    p = torch.softmax(theta.detach(), -1)
    q = torch.softmax(theta.detach() + 0.7 * torch.randn(vocab, dtype=torch.float64), -1)  # the mismatched sampler
    advantage = torch.randn(vocab, dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    for cap in (float((p / q).max()) + 1.0, float((p / q).median())):
        expected = torch.zeros(vocab, dtype=torch.float64)
        estimate = torch.zeros(vocab, dtype=torch.float64)
        for a in range(vocab):
            logprob = torch.log_softmax(theta, -1)[a].reshape(1, 1)
            old, sampler = logprob.detach(), torch.log(q[a]).reshape(1, 1)
            weights = truncated_is_weights(old, sampler, mask, cap)
            loss, _ = ppo_clip_loss(logprob, old, advantage[a].reshape(1, 1), mask, token_weights=weights)
            grad, = torch.autograd.grad(loss, theta)
            estimate += q[a] * grad  # drawn from q
            grad_log, = torch.autograd.grad(torch.log_softmax(theta, -1)[a], theta)
            expected += q[a] * min(float(p[a] / q[a]), cap) * (-advantage[a]) * grad_log
        # ppo_clip_loss computes in float32 whatever its inputs (exp of a log-ratio near 0): 1e-6, not 1e-12.
        torch.testing.assert_close(estimate, expected, rtol=1e-6, atol=1e-7)
    # Uncapped, the estimate is the on-policy gradient under p: E_p[-A grad log pi].
    on_policy = sum(p[a] * (-advantage[a]) * torch.autograd.grad(torch.log_softmax(theta, -1)[a], theta)[0]
                    for a in range(vocab))
    uncapped = sum(q[a] * min(float(p[a] / q[a]), 1e9) * (-advantage[a])
                   * torch.autograd.grad(torch.log_softmax(theta, -1)[a], theta)[0] for a in range(vocab))
    torch.testing.assert_close(uncapped, on_policy, rtol=1e-12, atol=1e-12)


def test_sequence_level_weights_use_the_product_over_a_trajectorys_model_tokens():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    sampler = torch.tensor([[-1.5, -2.0, -9.0], [-0.5, -1.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])  # the last column: an observation or padding
    token = truncated_is_weights(old, sampler, mask, cap=1.5)
    torch.testing.assert_close(token, torch.tensor([[1.5, 1.0, 1.0], [torch.exp(torch.tensor(-0.5)), 1.0, 1.0]]))
    sequence = truncated_is_weights(old, sampler, mask, cap=1.5, level="sequence")
    expected_first = min(float(torch.exp(torch.tensor(0.5))), 1.5)
    expected_second = float(torch.exp(torch.tensor(-0.5)))
    torch.testing.assert_close(sequence, torch.tensor([[expected_first, expected_first, 1.0],
                                                       [expected_second, expected_second, 1.0]]))


def test_tis_in_the_learner_logs_its_weights_and_leaves_the_loss_alone_when_sampler_and_pi_old_agree(
        tiny_model, tokenizer):
    stats, grad, _, batch = one_update(tiny_model, tokenizer, "k3", True, "train.tis_cap=2.0")
    plain_stats, plain_grad, _, _ = one_update(tiny_model, tokenizer, "k3", True)
    gap = stats["sampler_trainer_logprob_gap_max"]
    assert 0 < stats["loss/tis_weight_mean"] <= 2.0 and 0 <= stats["loss/tis_capped_fraction"] <= 1
    if gap == 0:  # ragged_trajectories' sampler log-probs equal pi_old's: weights 1, the same update
        assert stats["loss/tis_weight_mean"] == 1.0 and torch.equal(grad, plain_grad)
    else:
        assert stats["policy_loss"] != plain_stats["policy_loss"]

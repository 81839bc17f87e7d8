"""The KL-gradient diagnostic against exact enumeration over a small vocabulary.

The reference enumerates the sampled token p one at a time: the estimator (trainer/kl.py, on the full logits, as the
learner calls it) at token p, its gradient by autograd, then mean and variance over p weighted by the sampling
distribution, all in float64. The diagnostic must agree with it (it evaluates the same estimators on a reduced
vocabulary, to stay exact at V = 49,152), and its mean must be the gradient docs/algorithm.md §4 says the estimator
follows: k3's is the forward KL's, Top-k's the reverse KL's (at any k), k1's is zero. k3's variance is also checked
against its closed form g(p) = s (1 - w(p)) (e_p - pi), which uses no code of the project.
"""

from __future__ import annotations

import pytest
import torch

from experiments.mechanism.kl_gradient_variance import kl_gradient_moments, true_kl_gradient
from trainer.kl import sampled_kl, topk_kl

V = 7
STATES = 3


def states(seed: int, spread: float = 1.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits (STATES, V) of the policy, the anchor and the sampling policy (a few updates from the policy)."""
    gen = torch.Generator().manual_seed(seed)
    logits = spread * torch.randn(STATES, V, generator=gen)
    ref = spread * torch.randn(STATES, V, generator=gen)
    old = logits + 0.5 * torch.randn(STATES, V, generator=gen)
    return logits, ref, old


def enumerated_moments(logits, ref, old, estimator: str, k: int, direction: str, importance_weight: bool):
    """Mean (STATES, V) and variance (STATES,) of grad_z f(p), one token p and one backward pass at a time."""
    means, variances = [], []
    for z0, r, o in zip(logits, ref, old, strict=True):
        q = torch.softmax(o.double(), -1)
        head = (o if direction == "reverse" else r).topk(k).indices
        ref_logp, old_logp = torch.log_softmax(r, -1), torch.log_softmax(o, -1)
        grads = []
        for p in range(V):
            z = z0.clone().requires_grad_()
            old_token = old_logp[p].reshape(1, 1) if importance_weight else None
            if estimator == "topk":
                value = topk_kl(z.reshape(1, 1, V), ref_logp[head].reshape(1, 1, k), ref_logp[p].reshape(1, 1),
                                head.reshape(1, 1, k), torch.tensor([[p]]), direction=direction,
                                old_token_logprob=old_token)
            else:
                value = sampled_kl(torch.log_softmax(z, -1)[p].reshape(1, 1), ref_logp[p].reshape(1, 1), estimator,
                                   old_logprob=old_token)
            (grad,) = torch.autograd.grad(value.sum(), z)
            grads.append(grad.double())
        g = torch.stack(grads)  # (V sampled tokens, V logits)
        mean = (q[:, None] * g).sum(0)
        means.append(mean)
        variances.append((q * (g - mean).square().sum(-1)).sum())
    return torch.stack(means), torch.stack(variances)


def close(actual, expected, what: str, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


CASES = [("k3", 0, "reverse"), ("k1", 0, "reverse"), ("k3pp", 0, "reverse"), ("k4", 0, "reverse"),
         ("k5", 0, "forward"), ("topk", 0, "reverse"), ("topk", 3, "reverse"), ("topk", V, "reverse"),
         ("topk", 3, "forward"), ("topk", V - 1, "forward")]


@pytest.mark.parametrize("importance_weight", [False, True], ids=["p~pi", "p~pi_old"])
@pytest.mark.parametrize(("estimator", "k", "direction"), CASES)
def test_moments_equal_one_token_at_a_time_enumeration(estimator, k, direction, importance_weight):
    for seed in range(3):
        logits, ref, old = states(seed)
        sampling = old if importance_weight else logits
        got = kl_gradient_moments(logits, ref, estimator, old_logits=sampling, topk=k, direction=direction,
                                  importance_weight=importance_weight)
        mean, variance = enumerated_moments(logits, ref, sampling, estimator, k, direction, importance_weight)
        close(got.mean, mean, f"{estimator} k={k} {direction} mean (seed {seed})")
        close(got.variance, variance, f"{estimator} k={k} {direction} variance (seed {seed})")


# What docs/algorithm.md §4's table says each estimator's gradient follows, in expectation.
FOLLOWS = {"k1": "zero", "k3": "forward", "k3pp": "reverse", "k4": "reverse", "k5": "forward"}


@pytest.mark.parametrize("importance_weight", [False, True], ids=["p~pi", "p~pi_old"])
@pytest.mark.parametrize("estimator", sorted(FOLLOWS))
def test_mean_gradient_of_sampled_estimators_is_the_tables(estimator, importance_weight):
    logits, ref, old = states(0)
    sampling = old if importance_weight else logits
    got = kl_gradient_moments(logits, ref, estimator, old_logits=sampling, importance_weight=importance_weight)
    target = FOLLOWS[estimator]
    expected = torch.zeros(STATES, V, dtype=torch.float64) if target == "zero" else true_kl_gradient(logits, ref, target)
    close(got.mean, expected, f"{estimator} mean gradient vs {target}")
    if target != "reverse":  # and it is materially not the reverse KL's gradient
        assert (got.mean - true_kl_gradient(logits, ref, "reverse")).abs().max() > 1e-2


@pytest.mark.parametrize("importance_weight", [False, True], ids=["p~pi", "p~pi_old"])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("k", [0, 2, 4, V])
def test_topk_mean_gradient_is_the_true_kl_gradient_and_bias_is_zero(k, direction, importance_weight):
    logits, ref, old = states(1)
    sampling = old if importance_weight else logits
    got = kl_gradient_moments(logits, ref, "topk", old_logits=sampling, topk=k, direction=direction,
                              importance_weight=importance_weight)
    close(got.mean, true_kl_gradient(logits, ref, direction), f"top-{k} {direction} mean gradient")
    assert got.bias.max() < 1e-5


def test_k3_variance_equals_its_closed_form():
    """g(p) = s(p) (1 - w(p)) (e_p - pi) with w = pi_ref(p) / pi(p), s = pi(p) / pi_old(p): no project code."""
    logits, ref, old = states(2)
    got = kl_gradient_moments(logits, ref, "k3", old_logits=old)
    for i in range(STATES):
        logp = torch.log_softmax(logits[i].double(), -1)
        pi, q = logp.exp(), torch.softmax(old[i].double(), -1)
        w = torch.exp(torch.log_softmax(ref[i].double(), -1) - logp)
        g = ((pi / q) * (1 - w))[:, None] * (torch.eye(V, dtype=torch.float64) - pi)  # row p: g(p)
        mean = (q[:, None] * g).sum(0)
        close(got.variance[i], (q * (g - mean).square().sum(-1)).sum(), f"k3 variance, state {i}")


def test_topk_with_the_whole_vocabulary_is_exact_so_its_variance_is_zero_and_k3s_is_not():
    logits, ref, _ = states(3)
    exact = kl_gradient_moments(logits, ref, "topk", topk=V)
    assert exact.variance.abs().max() < 1e-10
    assert kl_gradient_moments(logits, ref, "k3").variance.min() > 1e-3


def test_at_the_anchor_every_gradient_is_zero():
    logits, _, _ = states(4)
    for estimator, k in (("k3", 0), ("topk", 3)):
        got = kl_gradient_moments(logits, logits.clone(), estimator, topk=k)
        assert got.mean.abs().max() < 1e-6 and got.variance.max() < 1e-10


def test_larger_head_lowers_the_variance_here():
    """Not a theorem, a property of these states: more exact head mass, less of the gradient left to sampling."""
    logits, ref, _ = states(5, spread=3.0)
    variances = [float(kl_gradient_moments(logits, ref, "topk", topk=k).variance.sum()) for k in (0, 2, 5)]
    assert variances[0] > variances[1] > variances[2]


def test_exact_at_a_real_vocabulary_size_matches_enumeration_on_a_few_tokens_mass():
    """At V = 2,000 with the mass on a few tokens the diagnostic still runs per state in one pass; its Top-k mean is
    the true gradient and k3's is the forward KL's."""
    gen = torch.Generator().manual_seed(6)
    logits, ref = 4 * torch.randn(2, 2000, generator=gen), 4 * torch.randn(2, 2000, generator=gen)
    topk = kl_gradient_moments(logits, ref, "topk", topk=32)
    close(topk.mean, true_kl_gradient(logits, ref, "reverse"), "top-32 mean at V=2000", atol=1e-5)
    k3 = kl_gradient_moments(logits, ref, "k3")
    close(k3.mean, true_kl_gradient(logits, ref, "forward"), "k3 mean at V=2000", atol=1e-5)
    assert (topk.variance < k3.variance).all()


def test_bad_input_is_refused_with_the_field_named():
    logits, ref, _ = states(0)
    with pytest.raises(ValueError, match="estimator"):
        kl_gradient_moments(logits, ref, "k9")
    with pytest.raises(ValueError, match="ref_logits"):
        kl_gradient_moments(logits, ref[:, :3], "k3")
    with pytest.raises(ValueError, match="topk"):
        kl_gradient_moments(logits, ref, "topk", topk=V + 1)
    with pytest.raises(ValueError, match=r"\(N, V\)"):
        kl_gradient_moments(logits[0], ref[0], "k3")

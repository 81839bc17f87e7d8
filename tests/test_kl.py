"""KL estimators checked by exact enumeration over a small vocabulary (docs/algorithm.md §4), not by sampling.

Setup: V = 6 tokens, a few independent positions, each with its own random pi_theta (leaf logits that require
grad), pi_ref and pi_old. For every position we evaluate an estimator at every possible sampled token p at once
(row p of a (V, positions) batch) and take

    expected value    E[f]      = sum_p sg(q(p)) f(p)            q = the sampling distribution
    expected gradient E[grad f] = grad sum_p sg(q(p)) f(p)

Why the weights are stop-gradient, even when q = pi_theta: in training a sampled token is a constant and
autograd differentiates only the estimator f(p; theta). The average gradient it produces over many samples is
sum_p q(p) grad f(p; theta), with no score-function term sum_p grad q(p) f(p) -- sampling is not differentiated.
That is exactly grad of sum_p sg(q(p)) f(p; theta), and it is what the table's "gradient" column is about: the
estimators put the missing score-function term back through r = pi / sg(pi). Weighting with a differentiable
pi_theta would instead compute grad E[f] = grad of the expected value, which equals grad KL for every estimator
with an unbiased value (k1 included) and would test nothing.

The references (true KLs and their gradients) are computed independently in float64; the code under test runs
in float32, hence tolerances of 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.kl import (SAMPLED_KL_KINDS, KLInputs, exact_kl, gather_logprobs, importance_weight, sampled_kl, topk_kl,
                       topk_kl_from_logprobs)
from trainer.registry import KL_ESTIMATORS

V = 6
POSITIONS = 3
ATOL = 1e-5


def make_distributions(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits (POSITIONS, V) of pi_theta (a leaf with grad), pi_ref and pi_old: distinct, far from uniform."""
    gen = torch.Generator().manual_seed(seed)
    theta = (1.5 * torch.randn(POSITIONS, V, generator=gen)).requires_grad_()
    ref_logits = 1.5 * torch.randn(POSITIONS, V, generator=gen)
    old_logits = theta.detach() + 0.5 * torch.randn(POSITIONS, V, generator=gen)  # a few updates away from pi_theta
    return theta, ref_logits, old_logits


def reference_kl(theta: torch.Tensor, ref_logits: torch.Tensor, direction: str) -> tuple[torch.Tensor, torch.Tensor]:
    """True KL per position (POSITIONS,) and its gradient w.r.t. theta (POSITIONS, V), in float64."""
    theta64 = theta.detach().double().requires_grad_()
    logp = torch.log_softmax(theta64, -1)
    ref_logp = torch.log_softmax(ref_logits.double(), -1)
    if direction == "reverse":
        kl = (logp.exp() * (logp - ref_logp)).sum(-1)
    else:
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
    (grad,) = torch.autograd.grad(kl.sum(), theta64)
    return kl.detach(), grad


def reference_head_mass_grad(theta: torch.Tensor, head_ids: torch.Tensor) -> torch.Tensor:
    """grad of P_q = sum_{j in q} pi_theta(j) w.r.t. theta, float64, (POSITIONS, V)."""
    theta64 = theta.detach().double().requires_grad_()
    mass = torch.softmax(theta64, -1).gather(-1, head_ids).sum()
    (grad,) = torch.autograd.grad(mass, theta64)
    return grad


def enumerate_expectation(
    per_token_values: torch.Tensor, theta: torch.Tensor, sampling_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E_p[f], E_p[grad f]) with p ~ softmax(sampling_logits) as constant weights; f is (V, POSITIONS)."""
    weights = torch.softmax(sampling_logits.detach().double(), -1).T  # (V, POSITIONS), no gradient
    expected = (weights * per_token_values.double()).sum(0)  # (POSITIONS,)
    (grad,) = torch.autograd.grad(expected.sum(), theta)  # positions are independent: row t is position t's
    return expected.detach(), grad.double()


def logprob_of_every_token(logits: torch.Tensor) -> torch.Tensor:
    """(POSITIONS, V) logits -> (V, POSITIONS): row p holds log pi(p) at each position (keeps the graph)."""
    return torch.log_softmax(logits, -1).T


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=ATOL, rtol=1e-5, msg=lambda m: f"{what}: {m}")


def assert_far(actual: torch.Tensor, other: torch.Tensor, what: str, margin: float = 1e-2) -> None:
    gap = (actual.double() - other.double()).abs().max().item()
    assert gap > margin, f"{what}: expected a material difference, got max |diff| = {gap:.2e}"


# ---------------------------------------------------------------------------------------------------------------
# Sampled estimators: the table in docs/algorithm.md §4.

EXPECTED_VALUE = {"k1": "reverse", "k2": None, "k3": "reverse", "k3pp": "reverse", "k4": "reverse", "k5": "forward"}
EXPECTED_GRADIENT = {"k1": "zero", "k2": "reverse", "k3": "forward", "k3pp": "reverse", "k4": "reverse", "k5": "forward"}
# k3_clamped is k3 where its clamps do not bind; it has its own test against a float64 reference below.
UNCLAMPED_KINDS = tuple(kind for kind in SAMPLED_KL_KINDS if kind != "k3_clamped")


def test_every_sampled_kind_is_in_the_table_or_tested_apart() -> None:
    assert set(UNCLAMPED_KINDS) == set(EXPECTED_VALUE) == set(EXPECTED_GRADIENT)


@pytest.mark.parametrize("importance_weighted", [False, True], ids=["p~pi", "p~pi_old"])
@pytest.mark.parametrize("kind", UNCLAMPED_KINDS)
def test_sampled_kl_expected_value_and_gradient_match_the_table(kind: str, importance_weighted: bool) -> None:
    for seed in range(3):
        theta, ref_logits, old_logits = make_distributions(seed)
        logprob = logprob_of_every_token(theta)
        ref_logprob = logprob_of_every_token(ref_logits)
        if importance_weighted:  # p drawn from pi_old, reweighted by s = sg(pi / pi_old)
            values = sampled_kl(logprob, ref_logprob, kind, old_logprob=logprob_of_every_token(old_logits))
            sampling_logits = old_logits
        else:
            values = sampled_kl(logprob, ref_logprob, kind)
            sampling_logits = theta
        expected_value, expected_grad = enumerate_expectation(values, theta, sampling_logits)

        reverse_value, reverse_grad = reference_kl(theta, ref_logits, "reverse")
        forward_value, forward_grad = reference_kl(theta, ref_logits, "forward")
        true_value = {"reverse": reverse_value, "forward": forward_value}
        true_grad = {"reverse": reverse_grad, "forward": forward_grad, "zero": torch.zeros_like(reverse_grad)}

        if EXPECTED_VALUE[kind] is None:  # k2 is biased: its mean is E[(log w)^2] / 2, not the KL
            assert_far(expected_value, reverse_value, f"{kind} value vs reverse KL")
        else:
            assert_close(expected_value, true_value[EXPECTED_VALUE[kind]], f"{kind} value (seed {seed})")
        assert_close(expected_grad, true_grad[EXPECTED_GRADIENT[kind]], f"{kind} gradient (seed {seed})")

        # And where the table says "not reverse" / "zero", it really is not the reverse KL's gradient.
        if EXPECTED_GRADIENT[kind] != "reverse":
            assert_far(expected_grad, reverse_grad, f"{kind} gradient vs the reverse KL's")


def test_clamped_k3_value_and_gradient_match_a_float64_reference() -> None:
    """kl.estimator=k3_clamped (the authors' GRPO baseline's low_var_kl) at log w on both sides of both clamps,
    against the float64 formula written out: value min(10, e^c - 1 - c) with c = clamp(log w, -20, 20) (k3 >= 0,
    so the -10 bound never binds), gradient w.r.t. log pi_theta(p) = -(w - 1) where nothing binds, 0 where the
    value clamp binds (at log w > 2.611 or < -11.0)."""
    log_w = torch.tensor([-30.0, -15.0, -11.5, -10.5, -3.0, -0.25, 0.0, 0.25, 1.5, 2.55, 2.7, 5.0, 25.0],
                         dtype=torch.float64)
    ref_logprob = torch.full_like(log_w, -2.0)
    logprob = (ref_logprob - log_w).float().requires_grad_()
    value = sampled_kl(logprob, ref_logprob.float(), "k3_clamped")
    (grad,) = torch.autograd.grad(value.sum(), logprob)

    clamped_log_w = log_w.clamp(-20.0, 20.0)
    raw = clamped_log_w.exp() - 1.0 - clamped_log_w
    expected_value = raw.clamp(-10.0, 10.0)
    binds = raw > 10.0
    expected_grad = torch.where(binds, torch.zeros_like(log_w), -(log_w.exp() - 1.0))
    assert binds.tolist() == [True, True, True, False, False, False, False, False, False, False, True, True, True]
    torch.testing.assert_close(value.double(), expected_value, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-6)
    # Where nothing binds it is plain k3, value and gradient.
    plain = sampled_kl(logprob, ref_logprob.float(), "k3")
    (plain_grad,) = torch.autograd.grad(plain.sum(), logprob)
    torch.testing.assert_close(value[~binds], plain[~binds])
    torch.testing.assert_close(grad[~binds], plain_grad[~binds])
    # The recipe runs it without the importance weight; with one it is s times the same (our weight, unclamped).
    old_logprob = logprob.detach() + 0.3
    weighted = sampled_kl(logprob, ref_logprob.float(), "k3_clamped", old_logprob=old_logprob)
    torch.testing.assert_close(weighted, math.exp(-0.3) * value, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Top-k estimator.


def topk_inputs(
    theta: torch.Tensor, ref_logits: torch.Tensor, old_logits: torch.Tensor, k: int, direction: str, importance_weighted: bool
) -> dict:
    """topk_kl's arguments for the (V, POSITIONS) enumeration batch: row p samples token p at every position."""
    sampling_logits = old_logits if importance_weighted else theta.detach()
    # q: the sampling policy's top-k for reverse, the anchor's for forward (docs/algorithm.md §4).
    head_source = sampling_logits if direction == "reverse" else ref_logits
    head_ids = head_source.topk(k, dim=-1).indices  # (POSITIONS, k)
    ref_logp = torch.log_softmax(ref_logits, -1)
    tokens = torch.arange(V).unsqueeze(1).expand(V, POSITIONS)
    return dict(
        logits=theta.unsqueeze(0).expand(V, POSITIONS, V),
        ref_topk_logprobs=ref_logp.gather(-1, head_ids).unsqueeze(0).expand(V, POSITIONS, k),
        ref_token_logprob=ref_logp.T,
        topk_ids=head_ids.unsqueeze(0).expand(V, POSITIONS, k),
        tokens=tokens,
        direction=direction,
        old_token_logprob=logprob_of_every_token(old_logits) if importance_weighted else None,
        _head_ids=head_ids,
        _sampling_logits=sampling_logits,
    )


def call_topk_kl(inputs: dict) -> torch.Tensor:
    return topk_kl(**{name: value for name, value in inputs.items() if not name.startswith("_")})


@pytest.mark.parametrize("importance_weighted", [False, True], ids=["p~pi", "p~pi_old"])
@pytest.mark.parametrize("k", [0, 3, V])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_kl_is_unbiased_in_value_and_gradient(direction: str, k: int, importance_weighted: bool) -> None:
    for seed in range(3):
        theta, ref_logits, old_logits = make_distributions(seed)
        inputs = topk_inputs(theta, ref_logits, old_logits, k, direction, importance_weighted)
        expected_value, expected_grad = enumerate_expectation(call_topk_kl(inputs), theta, inputs["_sampling_logits"])
        true_value, true_grad = reference_kl(theta, ref_logits, direction)
        assert_close(expected_value, true_value, f"top-{k} {direction} value (seed {seed})")
        assert_close(expected_grad, true_grad, f"top-{k} {direction} gradient (seed {seed})")


def registered_topk(name: str, inputs: dict) -> torch.Tensor:
    """The registered estimator `name` (what kl.estimator=name runs) on topk_inputs' enumeration batch."""
    logprobs = torch.log_softmax(inputs["logits"], -1)
    return KL_ESTIMATORS.get(name).fn(KLInputs(
        token_logprob=logprobs.gather(-1, inputs["tokens"].unsqueeze(-1)).squeeze(-1),
        ref_token_logprob=inputs["ref_token_logprob"], tokens=inputs["tokens"], direction=inputs["direction"],
        old_token_logprob=inputs["old_token_logprob"], head_logprobs=logprobs.gather(-1, inputs["topk_ids"]),
        topk_ids=inputs["topk_ids"], ref_topk_logprobs=inputs["ref_topk_logprobs"],
    ))


@pytest.mark.parametrize("importance_weighted", [False, True], ids=["p~pi", "p~pi_old"])
@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_released_topk_gradient_is_off_by_beta_grad_head_mass(direction: str, importance_weighted: bool) -> None:
    """kl.estimator=topk_released (the authors' estimator, no head-mass correction) against ours (topk), by
    enumeration: the same expected value, and expected gradients that differ by exactly grad P_q for reverse
    (-grad P_q for forward), P_q the policy's mass on the top-k ids. Times beta in the loss, that is the released
    recipe's bias; ours equals grad KL (the test above)."""
    k = 3
    for seed in range(3):
        theta, ref_logits, old_logits = make_distributions(seed)
        inputs = topk_inputs(theta, ref_logits, old_logits, k, direction, importance_weighted)
        sampling_logits = inputs["_sampling_logits"]
        released_value, released_grad = enumerate_expectation(registered_topk("topk_released", inputs), theta,
                                                              sampling_logits)
        unbiased_value, unbiased_grad = enumerate_expectation(registered_topk("topk", inputs), theta, sampling_logits)

        true_value, true_grad = reference_kl(theta, ref_logits, direction)
        mass_grad = reference_head_mass_grad(theta, inputs["_head_ids"])
        sign = 1.0 if direction == "reverse" else -1.0
        assert_close(released_value, unbiased_value, "released and unbiased have the same value")
        assert_close(released_value, true_value, f"released {direction} value (seed {seed})")
        assert_close(unbiased_grad, true_grad, f"unbiased {direction} gradient (seed {seed})")
        assert_close(released_grad - unbiased_grad, sign * mass_grad, f"released - unbiased (seed {seed})")
        assert_far(released_grad, true_grad, f"released {direction} gradient vs grad KL")


def test_released_topk_clamps_log_ratios_at_20_as_the_authors_code_does() -> None:
    """Their guards: the importance weight's log-ratio and the forward tail's log w clamped to [-20, 20]."""
    token_logprob = torch.tensor([-1.0, -30.0], requires_grad=True)
    old_token_logprob = torch.tensor([-26.0, -2.0])  # log s = 25 (clamped to 20) and -28 (clamped to -20)
    s = importance_weight(token_logprob, old_token_logprob, log_ratio_clamp=20.0)
    torch.testing.assert_close(s, torch.tensor([20.0, -20.0]).exp())
    torch.testing.assert_close(importance_weight(token_logprob, old_token_logprob), torch.tensor([25.0, -28.0]).exp())

    ref_token_logprob = torch.tensor([-0.5, -0.1])  # log w = 0.5 (free) and 29.9 (clamped to 20)
    empty = dict(head_logprobs=torch.empty(2, 0), ref_topk_logprobs=torch.empty(2, 0),
                 topk_ids=torch.empty(2, 0, dtype=torch.long), tokens=torch.tensor([0, 1]), direction="forward")
    released = topk_kl_from_logprobs(token_logprob=token_logprob, ref_token_logprob=ref_token_logprob,
                                     gradient="released", **empty)
    (grad,) = torch.autograd.grad(released.sum(), token_logprob)
    log_w = torch.tensor([0.5, 20.0])
    torch.testing.assert_close(released.detach(), log_w.exp() * log_w)  # sg(w) log w + log r, log r = 0
    # d/d logprob of sg(w) log w + log r: -w + 1 where log w is free; 1 (log r alone) where it is clamped
    torch.testing.assert_close(grad, torch.tensor([1.0 - math.exp(0.5), 1.0]))


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_kl_at_k_equal_v_is_exact_kl_per_token(direction: str) -> None:
    """Deterministic, token by token: the head covers the vocabulary, the tail is empty, grad P_q = grad 1 = 0."""
    gen = torch.Generator().manual_seed(7)
    batch, time = 2, 4
    logits = (1.5 * torch.randn(batch, time, V, generator=gen)).requires_grad_()
    ref_logits = 1.5 * torch.randn(batch, time, V, generator=gen)
    old_logits = logits.detach() + 0.5 * torch.randn(batch, time, V, generator=gen)
    topk_ids = torch.rand(batch, time, V, generator=gen).argsort(-1)  # every id, in a random order
    tokens = torch.randint(V, (batch, time), generator=gen)
    ref_logp = torch.log_softmax(ref_logits, -1)
    old_token_logprob = torch.log_softmax(old_logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    topk = topk_kl(
        logits, ref_logp.gather(-1, topk_ids), ref_logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), topk_ids, tokens,
        direction=direction, old_token_logprob=old_token_logprob, iw_clip=2.0,
    )
    (topk_grad,) = torch.autograd.grad(topk.sum(), logits)  # tokens are independent: per-token gradients
    exact = exact_kl(logits, ref_logits, direction)
    (exact_grad,) = torch.autograd.grad(exact.sum(), logits)
    assert topk.shape == exact.shape == (batch, time)
    assert_close(topk, exact, "value")
    assert_close(topk_grad, exact_grad, "gradient")


@pytest.mark.parametrize("direction, kind", [("reverse", "k4"), ("forward", "k5")])
def test_topk_kl_at_k_zero_is_the_sampled_estimator(direction: str, kind: str) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, V, generator=gen).requires_grad_()
    ref_logits = torch.randn(2, 4, V, generator=gen)
    old_logits = torch.randn(2, 4, V, generator=gen)
    tokens = torch.randint(V, (2, 4), generator=gen)
    ref_token_logprob = gather_logprobs(ref_logits, tokens.unsqueeze(-1)).squeeze(-1)
    old_token_logprob = gather_logprobs(old_logits, tokens.unsqueeze(-1)).squeeze(-1)
    empty_ids = torch.empty(2, 4, 0, dtype=torch.long)

    topk = topk_kl(logits, torch.empty(2, 4, 0), ref_token_logprob, empty_ids, tokens,
                   direction=direction, old_token_logprob=old_token_logprob)
    token_logprob = gather_logprobs(logits, tokens.unsqueeze(-1)).squeeze(-1)
    sampled = sampled_kl(token_logprob, ref_token_logprob, kind, old_logprob=old_token_logprob)
    assert_close(topk, sampled, "value")
    assert_close(torch.autograd.grad(topk.sum(), logits)[0], torch.autograd.grad(sampled.sum(), logits)[0], "gradient")


def test_iw_clip_caps_the_tail_importance_weight() -> None:
    theta, ref_logits, old_logits = make_distributions(0)
    inputs = topk_inputs(theta, ref_logits, old_logits, 0, "reverse", importance_weighted=True)
    logprob, old_logprob = logprob_of_every_token(theta), inputs["old_token_logprob"]
    s = torch.exp(logprob - old_logprob).detach()
    clip = s.median().item()  # about half the weights get clamped
    clipped = call_topk_kl({**inputs, "iw_clip": clip})
    expected = s.clamp(max=clip) * sampled_kl(logprob, inputs["ref_token_logprob"], "k4")
    assert_close(clipped, expected, "clipped tail")
    assert_far(clipped, call_topk_kl(inputs), "clipping changed nothing", margin=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# exact_kl, dtypes, detachment, validation.


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_exact_kl_matches_the_float64_reference(direction: str) -> None:
    theta, ref_logits, _ = make_distributions(1)
    value = exact_kl(theta, ref_logits, direction)
    (grad,) = torch.autograd.grad(value.sum(), theta)
    true_value, true_grad = reference_kl(theta, ref_logits, direction)
    assert_close(value, true_value, "value")
    assert_close(grad, true_grad, "gradient")


def test_no_gradient_reaches_the_anchor_or_pi_old() -> None:
    logits = torch.randn(1, 2, V, requires_grad=True)
    ref_logits = torch.randn(1, 2, V, requires_grad=True)
    old_logprob = torch.randn(1, 2, requires_grad=True)
    ref_topk = torch.randn(1, 2, 3, requires_grad=True)
    ref_token = torch.randn(1, 2, requires_grad=True)
    tokens = torch.tensor([[0, 5]])
    topk_ids = torch.tensor([[[0, 1, 2], [0, 1, 2]]])
    token_logprob = gather_logprobs(logits, tokens.unsqueeze(-1)).squeeze(-1)
    total = exact_kl(logits, ref_logits, "forward").sum()
    total = total + sum(sampled_kl(token_logprob, ref_token, kind, old_logprob=old_logprob).sum() for kind in SAMPLED_KL_KINDS)
    for direction in ("reverse", "forward"):
        total = total + topk_kl(logits, ref_topk, ref_token, topk_ids, tokens, direction=direction,
                                old_token_logprob=old_logprob).sum()
    total.backward()
    assert logits.grad is not None
    assert all(t.grad is None for t in (ref_logits, old_logprob, ref_topk, ref_token))


def test_math_is_float32_for_bfloat16_inputs() -> None:
    logits = torch.randn(1, 2, V).bfloat16()
    tokens = torch.tensor([[1, 2]])
    token_logprob = gather_logprobs(logits, tokens.unsqueeze(-1)).squeeze(-1)
    assert token_logprob.dtype == torch.float32
    assert sampled_kl(token_logprob.bfloat16(), token_logprob.bfloat16(), "k3").dtype == torch.float32
    assert exact_kl(logits, logits, "reverse").dtype == torch.float32
    ids = torch.zeros(1, 2, 1, dtype=torch.long)
    assert topk_kl(logits, torch.zeros(1, 2, 1).bfloat16(), token_logprob.bfloat16(), ids, tokens,
                   direction="reverse").dtype == torch.float32


def test_bad_arguments_are_refused_with_clear_messages() -> None:
    x = torch.zeros(2, 3)
    logits = torch.zeros(2, 3, V)
    ids = torch.zeros(2, 3, 2, dtype=torch.long)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    good = dict(logits=logits, ref_topk_logprobs=torch.zeros(2, 3, 2), ref_token_logprob=x, topk_ids=ids, tokens=tokens,
                direction="reverse")
    with pytest.raises(ValueError, match="kind must be one of"):
        sampled_kl(x, x, "k6")
    with pytest.raises(ValueError, match="ref_logprob has shape"):
        sampled_kl(x, torch.zeros(3, 2), "k1")
    with pytest.raises(ValueError, match="old_logprob has shape"):
        sampled_kl(x, x, "k1", old_logprob=torch.zeros(2))
    with pytest.raises(ValueError, match="direction must be one of"):
        exact_kl(logits, logits, "both")
    with pytest.raises(ValueError, match="ref_logits has shape"):
        exact_kl(logits, torch.zeros(2, 3, V + 1), "reverse")
    with pytest.raises(ValueError, match="direction must be one of"):
        topk_kl(**{**good, "direction": "sideways"})
    with pytest.raises(ValueError, match="gradient must be one of"):
        topk_kl(**{**good, "gradient": "biased"})
    with pytest.raises(ValueError, match=r"logits must be \(B, T, V\)"):
        topk_kl(**{**good, "logits": torch.zeros(6, V)})
    with pytest.raises(ValueError, match="topk_ids must be"):
        topk_kl(**{**good, "topk_ids": torch.zeros(2, 4, 2, dtype=torch.long)})
    with pytest.raises(ValueError, match="int64"):
        topk_kl(**{**good, "topk_ids": ids.int()})
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        topk_kl(**{**good, "topk_ids": torch.zeros(2, 3, V + 1, dtype=torch.long),
                   "ref_topk_logprobs": torch.zeros(2, 3, V + 1)})
    with pytest.raises(ValueError, match="ref_topk_logprobs has shape"):
        topk_kl(**{**good, "ref_topk_logprobs": torch.zeros(2, 3, 3)})
    with pytest.raises(ValueError, match="tokens has shape"):
        topk_kl(**{**good, "tokens": torch.zeros(2, dtype=torch.long)})
    with pytest.raises(ValueError, match="ref_token_logprob has shape"):
        topk_kl(**{**good, "ref_token_logprob": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="old_token_logprob has shape"):
        topk_kl(**good, old_token_logprob=torch.zeros(2, 3, 1))
    with pytest.raises(ValueError, match="needs old_token_logprob"):
        topk_kl(**good, iw_clip=2.0)
    with pytest.raises(ValueError, match="iw_clip must be positive"):
        topk_kl(**good, old_token_logprob=x, iw_clip=0.0)

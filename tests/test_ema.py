"""EMA anchor: closed form after n updates, tau = 1 bit for bit, fp32 vs bf16 accumulation, checkpoints, forward."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainer.ema import EmaAnchor, ema_closed_form, should_update_ema


def tiny_policy(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


@torch.no_grad()
def take_step(policy: nn.Module, scale: float = 0.1) -> None:
    """Stand-in for an optimizer step: move every weight by a random amount."""
    for param in policy.parameters():
        param.add_(torch.randn_like(param) * scale)


def test_n_updates_equal_the_closed_form():
    tau = 0.9
    policy = tiny_policy()
    ema_anchor = EmaAnchor(policy)
    theta_0 = {name: p.detach().clone() for name, p in policy.named_parameters()}
    history = {name: [] for name in theta_0}
    for _ in range(12):
        take_step(policy)
        ema_anchor.update(policy, tau)
        for name, p in policy.named_parameters():
            history[name].append(p.detach().clone())

    anchor = ema_anchor.state_dict()
    for name in theta_0:
        assert anchor[name].dtype == torch.float32
        want = ema_closed_form(theta_0[name], history[name], tau)
        torch.testing.assert_close(anchor[name].double(), want, rtol=1e-6, atol=1e-6)


def test_closed_form_by_hand():
    # tau^2 * 0 + 0.5 * 0.5 * 2 + 0.5 * 4 = 2.5
    assert ema_closed_form(torch.tensor(0.0), [torch.tensor(2.0), torch.tensor(4.0)], 0.5).item() == 2.5


def test_tau_one_is_a_fixed_reference_bit_for_bit():
    policy = tiny_policy()
    ema_anchor = EmaAnchor(policy)
    before = {name: t.clone() for name, t in ema_anchor.state_dict().items()}
    for _ in range(3):
        take_step(policy, scale=1.0)
        ema_anchor.update(policy, tau=1.0)
    for name, t in ema_anchor.state_dict().items():
        assert torch.equal(t, before[name])
        assert t.view(torch.int32).equal(before[name].view(torch.int32))


def test_tau_zero_copies_the_policy_and_bad_tau_is_refused():
    policy = tiny_policy()
    ema_anchor = EmaAnchor(policy)
    take_step(policy)
    ema_anchor.update(policy, tau=0.0)
    assert ema_anchor.distance(policy) == 0.0
    for tau in (-0.1, 1.5):
        with pytest.raises(ValueError):
            ema_anchor.update(policy, tau)


def test_fp32_anchor_keeps_increments_that_a_bf16_anchor_loses():
    # A bf16 policy whose only weight steps from 1.0 to 1.0 + one bf16 ulp (2^-7). With tau = 0.9 each update
    # moves the anchor by 0.1 * (policy - anchor) <= 2^-7 / 10: below half an ulp, so bf16 rounds it away.
    policy = nn.Linear(1, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        policy.weight.fill_(1.0)
    fp32_anchor = EmaAnchor(policy)  # default dtype
    bf16_anchor = EmaAnchor(policy, dtype=torch.bfloat16)
    with torch.no_grad():
        policy.weight.fill_(1.0 + 2**-7)
    assert policy.weight.item() == 1.0 + 2**-7  # exactly representable in bf16

    for _ in range(20):
        fp32_anchor.update(policy, tau=0.9)
        bf16_anchor.update(policy, tau=0.9)

    assert bf16_anchor.state_dict()["weight"].item() == 1.0  # frozen: every increment vanished
    fp32_weight = fp32_anchor.state_dict()["weight"]
    assert fp32_weight.dtype == torch.float32
    want = 1.0 + 2**-7 * (1 - 0.9**20)  # closed form with theta_i = 1 + 2^-7 for all i
    assert fp32_weight.item() == pytest.approx(want, rel=1e-6)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each value of x (8 significant bits: 2^(e - 8) for x = m 2^e, m in [0.5, 1)), float64."""
    _, exponent = torch.frexp(x.double())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - 8)


def bf16_policy_and_anchor(seed: int = 0) -> tuple[nn.Module, EmaAnchor]:
    """An fp32 policy with Qwen-like weights (std 0.02) and its bf16 anchor (ema.dtype=bfloat16, the authors')."""
    torch.manual_seed(seed)
    policy = nn.Linear(256, 256, bias=False)
    with torch.no_grad():
        policy.weight.normal_(0, 0.02)
    return policy, EmaAnchor(policy, dtype=torch.bfloat16)


def test_bf16_anchor_update_is_the_exact_average_rounded_once_to_bf16():
    """ema.dtype=bfloat16: each update is the float64 average of the bf16 anchor and the policy cast to bf16, rounded
    once to bf16: within half a bf16 ulp of it, plus the fp32 arithmetic inside lerp (a couple of fp32 ulps of the
    operands: it shows where the average cancels to ~0), and equal to its round-to-nearest almost everywhere."""
    tau = 0.9
    policy, anchor = bf16_policy_and_anchor()
    for step in range(5):
        take_step(policy, scale=1e-3)  # ~5% of a weight: increments of many ulps, not only sub-ulp ones
        before = anchor.state_dict()["weight"].double()
        target = policy.weight.detach().bfloat16().double()  # the anchor's dtype, as the update casts it
        exact = before + (1 - tau) * (target - before)
        anchor.update(policy, tau)
        after = anchor.state_dict()["weight"]
        assert after.dtype == torch.bfloat16
        fp32_slack = 2**-22 * torch.maximum(before.abs(), target.abs())
        assert ((after.double() - exact).abs() <= 0.5 * bf16_ulp(after) + fp32_slack).all(), f"update {step}"
        assert (after == exact.bfloat16()).double().mean() > 0.999


def test_the_authors_bf16_update_rounds_twice_and_moves_a_still_anchor():
    """The released update is ref.mul_(tau) then .add_(actor in bf16, alpha=1 - tau) on bf16 tensors: two roundings
    where ours (lerp) has one. Per update the two differ by at most 1.5 ulps of the largest of anchor and result (half
    an ulp per rounding); and with the policy equal to the anchor ours stays bit for bit while theirs moves some
    weights by an ulp (docs/fidelity.md gives the measured share)."""
    tau = 0.9
    policy, anchor = bf16_policy_and_anchor(seed=1)
    take_step(policy, scale=1e-3)
    before = anchor.state_dict()["weight"].clone()
    theirs = before.clone().mul_(tau).add_(policy.weight.detach().bfloat16(), alpha=1 - tau)
    anchor.update(policy, tau)
    ours = anchor.state_dict()["weight"]
    largest = torch.maximum(torch.maximum(before.abs(), ours.abs()), theirs.abs())
    assert ((ours.double() - theirs.double()).abs() <= 1.5 * bf16_ulp(largest)).all()
    assert (ours != theirs).any()  # the rounding order is visible

    with torch.no_grad():  # a policy equal to the anchor: the exact average is the anchor itself
        policy.weight.copy_(ours.float())
    still = ours.clone()
    anchor.update(policy, tau)
    assert torch.equal(anchor.state_dict()["weight"], still)
    theirs_still = still.clone().mul_(tau).add_(policy.weight.detach().bfloat16(), alpha=1 - tau)
    moved = (theirs_still != still).double().mean().item()
    assert 0.01 < moved < 0.1, moved  # ~4% of the weights, each by one ulp
    assert ((theirs_still.double() - still.double()).abs() <= bf16_ulp(still)).all()


def test_state_dict_round_trip_restores_the_anchor_exactly():
    policy = tiny_policy()
    ema_anchor = EmaAnchor(policy)
    for _ in range(3):
        take_step(policy)
        ema_anchor.update(policy, 0.9)
    saved = {name: t.clone() for name, t in ema_anchor.state_dict().items()}

    restored = EmaAnchor(tiny_policy(seed=1))  # different weights, same architecture
    restored.load_state_dict(saved)
    for name, t in restored.state_dict().items():
        assert torch.equal(t, saved[name])
    # The restored anchor goes on exactly like the original.
    take_step(policy)
    ema_anchor.update(policy, 0.9)
    restored.update(policy, 0.9)
    for name, t in restored.state_dict().items():
        assert torch.equal(t, ema_anchor.state_dict()[name])


def test_mismatched_state_is_refused():
    ema_anchor = EmaAnchor(tiny_policy())
    state = {name: t.clone() for name, t in ema_anchor.state_dict().items()}
    with pytest.raises(ValueError, match="missing"):
        ema_anchor.load_state_dict({k: v for k, v in state.items() if k != "0.weight"})
    with pytest.raises(ValueError, match="0.weight"):
        ema_anchor.load_state_dict({**state, "0.weight": state["0.weight"].bfloat16()})
    with pytest.raises(ValueError, match="0.weight"):
        ema_anchor.load_state_dict({**state, "0.weight": torch.zeros(2, 2)})


def test_distance_is_the_l2_norm_of_the_parameter_difference():
    policy = tiny_policy()
    ema_anchor = EmaAnchor(policy)
    assert ema_anchor.distance(policy) == 0.0
    take_step(policy)
    anchor = ema_anchor.state_dict()
    sum_sq = 0.0
    for name, p in policy.named_parameters():
        for a, b in zip(anchor[name].flatten().tolist(), p.detach().flatten().tolist()):
            sum_sq += (a - b) ** 2
    assert ema_anchor.distance(policy) == pytest.approx(math.sqrt(sum_sq), rel=1e-6)


def test_anchor_module_forward_equals_a_model_with_those_weights():
    policy = tiny_policy()
    ema_anchor = EmaAnchor(policy)
    for _ in range(2):
        take_step(policy)
        ema_anchor.update(policy, 0.8)

    assert not ema_anchor.module.training
    assert all(not p.requires_grad for p in ema_anchor.module.parameters())
    # The module's parameters ARE the anchor tensors, not copies.
    anchor = ema_anchor.state_dict()
    for name, p in ema_anchor.module.named_parameters():
        assert p.data_ptr() == anchor[name].data_ptr()

    reference = tiny_policy(seed=5)
    reference.load_state_dict(anchor)
    x = torch.randn(6, 4)
    with torch.no_grad():
        assert torch.equal(ema_anchor.module(x), reference(x))
        assert not torch.equal(ema_anchor.module(x), policy(x))


def test_anchor_is_independent_of_later_policy_changes_and_gradients():
    policy = tiny_policy()
    policy(torch.randn(2, 4)).sum().backward()  # the policy has .grad: the copy must not
    ema_anchor = EmaAnchor(policy)
    before = {name: t.clone() for name, t in ema_anchor.state_dict().items()}
    take_step(policy)
    assert all(p.grad is None for p in ema_anchor.module.parameters())
    for name, t in ema_anchor.state_dict().items():
        assert torch.equal(t, before[name])
    assert policy.training  # building the anchor did not switch the policy to eval


def test_bf16_policy_fp32_anchor_update_and_tied_weights():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(5, 4)
            self.head = nn.Linear(4, 5, bias=False)
            self.head.weight = self.embed.weight

    policy = Tied().to(torch.bfloat16)
    ema_anchor = EmaAnchor(policy)
    assert list(ema_anchor.state_dict()) == ["embed.weight"]  # shared tensor saved once (safetensors refuses twins)
    assert ema_anchor.module.head.weight is ema_anchor.module.embed.weight
    assert ema_anchor.module.embed.weight.dtype == torch.float32
    theta_0 = policy.embed.weight.detach().clone()
    take_step(policy)
    ema_anchor.update(policy, 0.9)
    want = ema_closed_form(theta_0, [policy.embed.weight.detach()], 0.9)
    torch.testing.assert_close(ema_anchor.state_dict()["embed.weight"].double(), want, rtol=1e-6, atol=1e-7)


def test_update_refuses_a_different_architecture():
    ema_anchor = EmaAnchor(tiny_policy())
    with pytest.raises(ValueError):
        ema_anchor.update(nn.Linear(4, 3), 0.9)


@pytest.mark.parametrize(
    ("iteration", "period", "expected"),
    [(1, 10, False), (9, 10, False), (10, 10, True), (11, 10, False), (20, 10, True), (1, 1, True), (3, 1, True)],
)
def test_should_update_ema_every_period_th_iteration(iteration, period, expected):
    assert should_update_ema(iteration, period) is expected


def test_should_update_ema_counts_from_one():
    assert [i for i in range(1, 31) if should_update_ema(i, 10)] == [10, 20, 30]
    with pytest.raises(ValueError):
        should_update_ema(0, 10)
    with pytest.raises(ValueError):
        should_update_ema(5, 0)


def test_bucketed_update_equals_one_fused_update(monkeypatch):
    import trainer.ema

    policy = tiny_policy(dtype=torch.bfloat16)
    whole, bucketed = EmaAnchor(policy), EmaAnchor(policy)
    take_step(policy)
    whole.update(policy, 0.9)
    monkeypatch.setattr(trainer.ema, "_BUCKET_NUMEL", 10)  # several tensors per bucket, some alone
    bucketed.update(policy, 0.9)
    for name, t in bucketed.state_dict().items():
        assert torch.equal(t, whole.state_dict()[name])

"""The EMA anchor: the KL reference that slowly follows the policy instead of staying at the initial weights.

    theta_ema <- tau * theta_ema + (1 - tau) * theta        (= lerp(theta_ema, theta, 1 - tau))

applied after the actor update of every `period`-th iteration. tau = 1 is plain GRPO's fixed reference.
After n updates with policy weights theta_1..theta_n the anchor is (see `ema_closed_form`)

    theta_n = tau^n theta_0 + sum_{i=1..n} (1 - tau) tau^(n-i) theta_i.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor, nn

# Cast-and-lerp at most this many elements at once: casting a whole bf16 policy to fp32 in one go would cost a
# transient fp32 copy of the model (12 GB for 3B parameters); one bucket is ~1 GB of fp32.
_BUCKET_NUMEL = 1 << 28


def _local(t: Tensor) -> Tensor:
    """This rank's shard of a sharded (FSDP DTensor) parameter; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def should_update_ema(iteration: int, period: int) -> bool:
    """True after the actor update of iterations period, 2 * period, ... (iterations counted from 1)."""
    if iteration < 1 or period < 1:
        raise ValueError(f"iteration and period count from 1; got iteration={iteration}, period={period}")
    return iteration % period == 0


def ema_closed_form(theta_0: Tensor, thetas: list[Tensor], tau: float) -> Tensor:
    """The anchor after len(thetas) updates from theta_0, in float64 (a reference for tests)."""
    n = len(thetas)
    anchor = tau**n * theta_0.double()
    for i, theta_i in enumerate(thetas, start=1):
        anchor = anchor + (1 - tau) * tau ** (n - i) * theta_i.double()
    return anchor


class EmaAnchor:
    """A separate copy of the policy's parameters, updated as an exponential moving average of the policy.

    `ema_anchor.module` is a deep copy of the policy whose parameters ARE the anchor tensors (eval mode,
    requires_grad False): run it for the anchor's forward passes. Buffers (e.g. rotary frequencies) are copied
    once and never averaged.

    dtype: fp32 by default, even for a bf16 policy. Why: bf16 keeps 8 significant bits (one ulp at 1.0 is 2^-7),
    and an update adds (1 - tau) * (theta - theta_ema) to each weight; whenever that increment is below half an
    ulp of theta_ema it rounds away and the weight does not move. With tau = 0.9 that is every weight within
    ~5 ulps (~4% relative) of the policy, i.e. nearly all of them at lr 1e-6: a bf16 anchor freezes while the
    policy drifts (the paper's released code keeps it in bf16). fp32 accumulates those increments. bf16 is
    offered to halve the memory.
    """

    def __init__(self, policy: nn.Module, *, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.module = copy.deepcopy(policy)
        self.module.eval()
        for param in self.module.parameters():  # deduplicated: tied weights are cast once and stay tied
            param.grad = None
            param.requires_grad_(False)
            if param.is_floating_point():
                param.data = param.data.to(dtype)
        # named_parameters() drops duplicates of tied weights, in the same order for the policy and its copy.
        self._names = [name for name, _ in self.module.named_parameters()]

    @property
    def _params(self) -> list[Tensor]:
        # Read each time: FSDP replaces the module's parameters with sharded ones after this anchor is made.
        return [param for _, param in self.module.named_parameters()]

    def _policy_params(self, policy: nn.Module) -> list[Tensor]:
        named = list(policy.named_parameters())
        if [name for name, _ in named] != self._names:
            raise ValueError("the policy's parameters do not match the anchor's (names or order differ)")
        return [param.detach() for _, param in named]

    def _buckets(self, policy: nn.Module) -> Iterator[tuple[list[Tensor], list[Tensor]]]:
        """(anchor params, policy params cast to the anchor's dtype and device), a bounded bucket at a time."""
        anchor_bucket: list[Tensor] = []
        policy_bucket: list[Tensor] = []
        numel = 0
        for anchor_param, policy_param in zip(self._params, self._policy_params(policy), strict=True):
            if not anchor_param.is_floating_point():
                continue
            # Sharded (FSDP) policy and anchor are sharded alike: each rank averages its own shards.
            anchor_param, policy_param = _local(anchor_param), _local(policy_param)
            anchor_bucket.append(anchor_param)
            policy_bucket.append(policy_param.to(device=anchor_param.device, dtype=anchor_param.dtype))
            numel += anchor_param.numel()
            if numel >= _BUCKET_NUMEL:
                yield anchor_bucket, policy_bucket
                anchor_bucket, policy_bucket, numel = [], [], 0
        if anchor_bucket:
            yield anchor_bucket, policy_bucket

    @torch.no_grad()
    def update(self, policy: nn.Module, tau: float) -> None:
        """theta_ema <- tau * theta_ema + (1 - tau) * theta, in place, with one fused lerp per bucket."""
        if not 0.0 <= tau <= 1.0:
            raise ValueError(f"tau must be in [0, 1]; got {tau}")
        if tau == 1.0:
            return  # a fixed reference: leave it bit for bit (lerp with weight 0 could still round)
        for anchor_bucket, policy_bucket in self._buckets(policy):
            torch._foreach_lerp_(anchor_bucket, policy_bucket, 1.0 - tau)  # a + w (b - a), w = 1 - tau

    @torch.no_grad()
    def reset_to(self, policy: nn.Module) -> None:
        """theta_ema <- theta (cast to the anchor's dtype), in place: e.g. when RL starts from an SFT checkpoint."""
        for anchor_param, policy_param in zip(self._params, self._policy_params(policy), strict=True):
            _local(anchor_param).copy_(_local(policy_param).to(dtype=anchor_param.dtype))

    @torch.no_grad()
    def distance(self, policy: nn.Module) -> float:
        """L2 norm of (theta_ema - theta) over all parameters, computed in fp32 (for logging). Sharded (FSDP)
        parameters: each rank sums the squares of its own shards, then the ranks' sums are added."""
        sharded = False
        sum_sq = torch.zeros((), dtype=torch.float64, device=self._params[0].device)
        for anchor_param, policy_param in zip(self._params, self._policy_params(policy), strict=True):
            sharded = sharded or hasattr(anchor_param, "to_local")
            anchor_param, policy_param = _local(anchor_param), _local(policy_param)
            diff = anchor_param.float() - policy_param.to(device=anchor_param.device, dtype=torch.float32)
            sum_sq += diff.square().sum().double()
        if sharded:
            torch.distributed.all_reduce(sum_sq)
        return float(sum_sq.sqrt())

    def state_dict(self) -> dict[str, Tensor]:
        """The anchor's parameters by name (tied weights once; references, not copies): safetensors-ready."""
        return {name: param.detach() for name, param in zip(self._names, self._params, strict=True)}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore from `state_dict()`; refuses missing, extra, reshaped or re-typed tensors."""
        missing = sorted(set(self._names) - set(state))
        unexpected = sorted(set(state) - set(self._names))
        if missing or unexpected:
            raise ValueError(f"EMA anchor state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, param in zip(self._names, self._params, strict=True):
            saved = state[name]
            if saved.shape != param.shape or saved.dtype != param.dtype:
                raise ValueError(
                    f"EMA anchor state mismatch at {name}: saved {tuple(saved.shape)} {saved.dtype}, "
                    f"anchor {tuple(param.shape)} {param.dtype}"
                )
            param.copy_(saved)

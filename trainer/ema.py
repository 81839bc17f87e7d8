"""The EMA anchor: the KL reference that slowly follows the policy instead of staying at the initial weights.

    theta_ema <- tau * theta_ema + (1 - tau) * theta        (= lerp(theta_ema, theta, 1 - tau))

applied after the actor update of every `period`-th iteration. tau = 1 is plain GRPO's fixed reference.
After n updates with policy weights theta_1..theta_n the anchor is (see `ema_closed_form`)

    theta_n = tau^n theta_0 + sum_{i=1..n} (1 - tau) tau^(n-i) theta_i.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

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
    def copy_to(self, policy: nn.Module) -> None:
        """theta <- theta_ema (cast to the policy's dtype), in place: the reverse of reset_to."""
        for anchor_param, policy_param in zip(self._params, self._policy_params(policy), strict=True):
            _local(policy_param).copy_(_local(anchor_param).to(dtype=policy_param.dtype))

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


class DeltaLinear(nn.Module):
    """An adapted Linear in the LoRA anchor: (W0 + D) x = base(x) + D x, W0 the policy's frozen base layer (shared,
    not copied) and D a dense buffer. D x runs in D's dtype, as peft runs the adapters' B A x in theirs: added to W0
    in bf16, a delta a few hundred times smaller than the weight would round away."""

    def __init__(self, base_layer: nn.Linear, delta: Tensor) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.register_buffer("delta", delta)

    def forward(self, x: Tensor) -> Tensor:
        result = self.base_layer(x)
        return result + torch.nn.functional.linear(x.to(self.delta.dtype), self.delta).to(result.dtype)


class LoraEmaAnchor:
    """The EMA anchor of a LoRA policy, exactly the EMA of its effective weights (docs/algorithm.md §6).

    The policy's adapted weight is W = W0 + s B A with W0 frozen; the anchor's is W0 + D, and every update is
    D <- tau D + (1 - tau) s B A (the EMA of W, since W0 never moves). D is dense: after n updates it is a sum of n
    rank-r terms, so no pair of factors can hold it (averaging A and B separately averages neither W nor B A).
    Parameters outside the adapted modules are frozen and equal in policy and anchor: the anchor shares them.

    Memory: one dense D per adapted module, i.e. the adapted matrices once in `dtype` (fp32 by default). D starts
    from the policy's s B A (zero for fresh adapters) and its increments are relative to D, not to W0: a bf16 D
    keeps 8 bits of the delta, where a bf16 full anchor (EmaAnchor) loses increments below an ulp of the weight.
    Forward cost: one more matmul per adapted module (D x).
    """

    def __init__(self, policy: nn.Module, *, dtype: torch.dtype = torch.float32) -> None:
        from trainer.lora import delta_weight, lora_layers

        self.dtype = dtype
        layers = lora_layers(policy)
        adapter_params = {id(p) for _, layer in layers for p in layer.parameters() if p.requires_grad}
        trained = [name for name, p in policy.named_parameters() if p.requires_grad and id(p) not in adapter_params]
        if trained:  # they would need averaging too: this anchor shares everything outside the adapters
            raise ValueError(f"a LoRA policy must train only its adapters; also trainable: {trained[:3]}")
        # A structural copy sharing every parameter and buffer (the memo maps each to itself), whose adapted layers
        # are then replaced: the frozen base exists once.
        shared = {id(t): t for t in (*policy.parameters(), *policy.buffers())}
        self.module = copy.deepcopy(policy, memo=shared)
        self._names = [name for name, _ in layers]
        with torch.no_grad():
            for name, layer in layers:
                copied = self.module.get_submodule(name)
                self.module.set_submodule(name, DeltaLinear(copied.base_layer, delta_weight(layer).to(dtype)))
        self.module.eval()

    @property
    def _deltas(self) -> list[Tensor]:
        return [self.module.get_submodule(name).delta for name in self._names]

    def _policy_deltas(self, policy: nn.Module) -> Iterator[Tensor]:
        """s B A of each of the policy's adapted modules (fp32), one at a time: at most one dense matrix transient."""
        from trainer.lora import delta_weight, lora_layers

        layers = lora_layers(policy)
        if [name for name, _ in layers] != self._names:
            raise ValueError("the policy's LoRA layers do not match the anchor's (names or order differ)")
        return (delta_weight(layer) for _, layer in layers)

    @torch.no_grad()
    def update(self, policy: nn.Module, tau: float) -> None:
        """D <- tau D + (1 - tau) s B A for every adapted module, in place."""
        if not 0.0 <= tau <= 1.0:
            raise ValueError(f"tau must be in [0, 1]; got {tau}")
        if tau == 1.0:
            return  # a fixed reference, bit for bit
        for delta, target in zip(self._deltas, self._policy_deltas(policy), strict=True):
            delta.lerp_(target.to(device=delta.device, dtype=delta.dtype), 1.0 - tau)

    @torch.no_grad()
    def reset_to(self, policy: nn.Module) -> None:
        """D <- s B A: the anchor equals the policy."""
        for delta, target in zip(self._deltas, self._policy_deltas(policy), strict=True):
            delta.copy_(target)

    @torch.no_grad()
    def distance(self, policy: nn.Module) -> float:
        """L2 norm of (anchor - policy) effective weights = of (D - s B A) over the adapted modules (the rest is
        shared)."""
        sum_sq = torch.zeros((), dtype=torch.float64)
        for delta, target in zip(self._deltas, self._policy_deltas(policy), strict=True):
            sum_sq += (delta.float() - target.to(delta.device)).square().sum().double().cpu()
        return float(sum_sq.sqrt())

    def state_dict(self) -> dict[str, Tensor]:
        """Each adapted module's D by `<module>.delta` (references, not copies): safetensors-ready."""
        return {f"{name}.delta": delta.detach() for name, delta in zip(self._names, self._deltas, strict=True)}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore from `state_dict()`; refuses missing, extra, reshaped or re-typed tensors (e.g. a full-weight
        anchor's state, or one over other target modules)."""
        own = self.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ValueError(f"LoRA EMA anchor state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        for name, delta in own.items():
            saved = state[name]
            if saved.shape != delta.shape or saved.dtype != delta.dtype:
                raise ValueError(f"LoRA EMA anchor state mismatch at {name}: saved {tuple(saved.shape)} {saved.dtype},"
                                 f" anchor {tuple(delta.shape)} {delta.dtype}")
            delta.copy_(saved)


@contextmanager
def anchor_weights_in(policy: nn.Module, anchor: EmaAnchor | LoraEmaAnchor) -> Iterator[nn.Module]:
    """`policy` holding the anchor's weights (cast to the policy's dtype) for the duration, its own weights put back
    bit for bit afterwards, also on error. Why through the policy: the anchor is then evaluated on exactly the
    policy's path (the same module class, dtype and rollout engine), at the cost of one copy of the weights.

    A LoRA anchor is refused: its weights are W0 + D with D dense, which no rank-r adapters on the policy can hold.
    """
    if not isinstance(anchor, EmaAnchor):
        raise TypeError(f"only a full-weight EmaAnchor can be swapped into the policy, not a {type(anchor).__name__} "
                        "(a LoRA anchor's W0 + D has no adapter form)")
    own = [param.detach().clone() for param in policy.parameters()]  # tied weights once, as the anchor holds them
    try:  # a copy that fails half way (or a policy that does not match the anchor) is undone too
        anchor.copy_to(policy)
        yield policy
    finally:
        with torch.no_grad():
            for param, saved in zip(policy.parameters(), own, strict=True):
                param.copy_(saved)


def ema_anchor(policy: nn.Module, *, dtype: torch.dtype = torch.float32) -> EmaAnchor | LoraEmaAnchor:
    """The policy's EMA anchor: over its adapters' effective weights under LoRA, else a full copy."""
    from trainer.lora import uses_lora

    return LoraEmaAnchor(policy, dtype=dtype) if uses_lora(policy) else EmaAnchor(policy, dtype=dtype)

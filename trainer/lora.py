"""LoRA on the policy (peft): W = W0 + s B A in every targeted Linear (s = alpha / rank), W0 frozen, only the adapters
A and B trained; what a rollout engine must be sent; what a checkpoint must hold.

- The adapters are injected in place (`peft.inject_adapter_in_model`): the policy stays the same transformers model
  (`get_decoder`, `get_output_embeddings`), so the learner, the transformers rollout engine and DDP see no
  difference; every base parameter has requires_grad False, and the optimizer gets the adapters alone.
- Engines hold plain models: they are sent merged weights W0 + s B A under the base model's own parameter names
  (one dense matrix per adapted module at sync time). vLLM's own LoRA path would send only the adapters, but it
  computes B A x separately on every token of every rollout; the merged matrices are what sampling needs.
- Checkpoints hold the adapters, not the frozen base (it is reloaded from `model`, or from `--init`'s full-weight
  checkpoint such as SFT's), and a fingerprint of that base: adapters are refused on any other base. The EMA anchor's
  state is the dense deltas of trainer.ema.LoraEmaAnchor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn

ADAPTER = "default"  # peft's name for a model's single adapter
BASE_FINGERPRINT = "lora_base_fingerprint"  # the checkpoint entry naming the base the adapters were trained on


def apply_lora(model: nn.Module, rank: int, alpha: float, target_modules: list[str], dropout: float) -> nn.Module:
    """Inject LoRA adapters into `model` in place and freeze everything else; returns the same model. B starts at
    zero (peft's default), so the adapted policy starts equal to the base; A is drawn from torch's global RNG."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=dropout,
                        bias="none")
    try:
        model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:  # peft's message when no module matches
        raise ValueError(f"lora.target_modules {target_modules}: {e}") from e
    # Adapters in fp32 whatever the base's dtype (a frozen base may well be bf16): AdamW's small steps would round
    # away in bf16 adapters. peft runs B A x in the adapters' dtype.
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return model


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, peft LoRA layer) for every adapted module, in module order."""
    from peft.tuners.lora import LoraLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def uses_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


def delta_weight(layer: nn.Module) -> Tensor:
    """s B A of one adapted module, in its base weight's layout (peft's own arithmetic), in float32."""
    return layer.get_delta_weight(ADAPTER).float()


def merged_weights(model: nn.Module, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) pairs of a LoRA model (its `state_dict().items()` or `named_parameters()`) as the plain base
    model's: adapters dropped, `x.base_layer.weight` -> `x.weight` = W0 + s B A (computed in fp32, returned in W0's
    dtype). A model without LoRA passes through unchanged."""
    adapted = lora_layers(model)
    layers = {f"{name}.base_layer.weight": layer for name, layer in adapted}
    adapter_prefixes = tuple(f"{name}.lora_" for name, _ in adapted)  # lora_A.default.weight, lora_B...
    for name, tensor in named:
        if adapter_prefixes and name.startswith(adapter_prefixes):
            continue
        if name in layers:
            tensor = (tensor.detach().float() + delta_weight(layers[name])).to(tensor.dtype)
        yield name.replace(".base_layer.", "."), tensor


def engine_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """What an in-process rollout engine (vLLM's `load_weights`) is sent: the parameters, merged under LoRA."""
    return merged_weights(model, model.named_parameters())


def base_fingerprint(model: nn.Module) -> Tensor:
    """(frozen parameters, 2) float64: each frozen parameter's sum and L2 norm. Cheap (no copy of a weight), and any
    other base (another model, the base model instead of the SFT checkpoint the run started from) differs by far more
    than summation order could."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return torch.stack([torch.stack([p.detach().sum(dtype=torch.float64),
                                     torch.linalg.vector_norm(p.detach(), dtype=torch.float64)]) for p in frozen]).cpu()


def load_base_weights(model: nn.Module, weights: Mapping[str, Tensor]) -> None:
    """Full weights under the plain model's names (e.g. an SFT checkpoint) into a LoRA model's frozen base, in place
    (the LoRA anchor shares that base, so it follows). The adapters are left as they are."""
    if any(".lora_" in name for name in weights):
        raise ValueError("--init under lora.rank > 0 takes a full-weight checkpoint (e.g. SFT's): this one holds LoRA "
                         "adapters")
    adapted = tuple(f"{name}." for name, _ in lora_layers(model))
    own = {name: t for name, t in model.state_dict(keep_vars=True).items() if ".lora_" not in name}

    def lora_name(name: str) -> str:  # x.q_proj.weight -> x.q_proj.base_layer.weight where q_proj is adapted
        for prefix in adapted:
            if name.startswith(prefix):
                return f"{prefix}base_layer.{name[len(prefix):]}"
        return name

    mapped = {lora_name(name): t for name, t in weights.items()}
    missing, unexpected = sorted(set(own) - set(mapped)), sorted(set(mapped) - set(own))
    if missing or unexpected:
        raise ValueError(f"--init: the checkpoint does not fit `model` (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]})")
    with torch.no_grad():
        for name, param in own.items():
            if mapped[name].shape != param.shape:
                raise ValueError(f"--init: {name} is {tuple(mapped[name].shape)} in the checkpoint, "
                                 f"{tuple(param.shape)} in `model`")
            param.copy_(mapped[name])


def policy_checkpoint_state(model: nn.Module) -> dict[str, Tensor]:
    """What a checkpoint holds of the policy: under LoRA the adapters and the base's fingerprint (the base is frozen
    and comes from `model` or `--init`), else the whole state dict."""
    if not uses_lora(model):
        return model.state_dict()
    adapters = {name: param.detach() for name, param in model.named_parameters() if param.requires_grad}
    return {**adapters, BASE_FINGERPRINT: base_fingerprint(model)}


@torch.no_grad()
def load_policy_checkpoint_state(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """The inverse of `policy_checkpoint_state`, refusing a state made with or without LoRA (or other adapters) than
    this model has, with the names that differ."""
    if not uses_lora(model):
        if any(".lora_" in name for name in state):
            raise ValueError("the checkpoint holds LoRA adapters but this run has lora.rank=0")
        model.load_state_dict(state)
        return
    expected = policy_checkpoint_state(model)
    fingerprint = expected.pop(BASE_FINGERPRINT)
    state = dict(state)
    saved = state.pop(BASE_FINGERPRINT, None)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"LoRA checkpoint mismatch (a full-weight checkpoint, or another lora.rank / "
                         f"target_modules?): missing {missing[:3]}, unexpected {unexpected[:3]}")
    if saved is None or saved.shape != fingerprint.shape or not torch.allclose(saved, fingerprint, rtol=1e-9, atol=1e-9):
        raise ValueError("these LoRA adapters were trained on another base than this run's frozen weights: resume "
                         "with the same `model` and the same --init the run started from")
    for name, param in expected.items():
        if state[name].shape != param.shape:
            raise ValueError(f"LoRA checkpoint mismatch at {name}: saved {tuple(state[name].shape)}, "
                             f"model {tuple(param.shape)} (another lora.rank?)")
        param.copy_(state[name])

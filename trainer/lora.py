"""LoRA on the policy (peft): W = W0 + s B A in every targeted Linear (s = alpha / rank), W0 frozen, only the adapters
A and B trained; what a rollout engine must be sent; what a checkpoint must hold.

- The adapters are injected in place (`peft.inject_adapter_in_model`): the policy stays the same transformers model
  (`get_decoder`, `get_output_embeddings`), so the learner, the transformers rollout engine and DDP see no
  difference; every base parameter has requires_grad False, and the optimizer gets the adapters alone.
- Engines hold plain models: they are sent merged weights W0 + s B A under the base model's own parameter names
  (one dense matrix per adapted module at sync time). vLLM's own LoRA path would send only the adapters, but it
  computes B A x separately on every token of every rollout; the merged matrices are what sampling needs.
- Checkpoints hold the adapters, not the frozen base (it is reloaded from `model`); the EMA anchor's state is the
  dense deltas of trainer.ema.LoraEmaAnchor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn

ADAPTER = "default"  # peft's name for a model's single adapter


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


def policy_checkpoint_state(model: nn.Module) -> dict[str, Tensor]:
    """What a checkpoint holds of the policy: the adapters under LoRA (the base is frozen and comes from `model`),
    else the whole state dict."""
    if not uses_lora(model):
        return model.state_dict()
    return {name: param.detach() for name, param in model.named_parameters() if param.requires_grad}


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
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"LoRA checkpoint mismatch (a full-weight checkpoint, or another lora.rank / "
                         f"target_modules?): missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, param in expected.items():
        if state[name].shape != param.shape:
            raise ValueError(f"LoRA checkpoint mismatch at {name}: saved {tuple(state[name].shape)}, "
                             f"model {tuple(param.shape)} (another lora.rank?)")
        param.copy_(state[name])

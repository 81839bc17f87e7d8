"""LoRA (trainer/lora.py, trainer.ema.LoraEmaAnchor): the anchor is exactly the EMA of the policy's effective weights
W0 + s B A (against a full-weight EMA reference, where averaging A and B separately is not); only the adapters train;
engines get merged weights; checkpoints hold the adapters and the anchor's deltas and restore a run exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from test_learner import ragged_trajectories
from transformers import set_seed

from trainer.learner.batch import collate
from trainer.run.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from trainer.config import ConfigError, load_config
from trainer.ema import EmaAnchor, LoraEmaAnchor, ema_anchor
from trainer.run.workers import PolicyTrainer
from trainer.lora import BASE_FINGERPRINT, apply_lora, lora_layers, merged_weights

TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora_policy(model, rank: int = 4, alpha: float = 8.0):
    return apply_lora(copy.deepcopy(model), rank, alpha, TARGETS, 0.0)


def move_adapters(policy, generator: torch.Generator, scale: float = 0.3) -> None:
    """What an optimizer step does to a LoRA policy: its A and B change (randomly here), the base does not."""
    with torch.no_grad():
        for _, layer in lora_layers(policy):
            for param in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
                param.add_(scale * torch.randn(param.shape, generator=generator))


def plain_copy(base, policy):
    """The base architecture holding the LoRA policy's merged (effective) weights."""
    plain = copy.deepcopy(base)
    plain.load_state_dict(dict(merged_weights(policy, policy.state_dict().items())))
    return plain


def test_lora_anchor_is_the_ema_of_the_effective_weights_and_factor_averaging_is_not(tiny_model):
    policy = lora_policy(tiny_model)
    anchor = ema_anchor(policy)
    assert isinstance(anchor, LoraEmaAnchor)
    reference = EmaAnchor(plain_copy(tiny_model, policy))  # full-weight EMA of W0 + s B A
    naive = {name: (layer.lora_A["default"].weight.detach().clone(),  # the wrong way: EMA of A and of B
                    layer.lora_B["default"].weight.detach().clone()) for name, layer in lora_layers(policy)}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 9), generator=g)
    tau = 0.7
    for _ in range(5):
        move_adapters(policy, g)
        anchor.update(policy, tau)
        reference.update(plain_copy(tiny_model, policy), tau)
        for name, layer in lora_layers(policy):
            a, b = naive[name]
            a.lerp_(layer.lora_A["default"].weight.detach(), 1 - tau)
            b.lerp_(layer.lora_B["default"].weight.detach(), 1 - tau)
        # Every adapted weight: W0 + D equals the reference's EMA of the effective weights.
        expected = reference.state_dict()
        for name, layer in lora_layers(policy):
            effective = layer.base_layer.weight + anchor.module.get_submodule(name).delta
            torch.testing.assert_close(effective, expected[f"{name}.weight"], rtol=1e-6, atol=1e-6)
        with torch.no_grad():  # and so does the anchor's forward pass
            torch.testing.assert_close(anchor.module(ids).logits, reference.module(ids).logits, rtol=1e-5, atol=1e-5)
    assert anchor.distance(policy) == pytest.approx(reference.distance(plain_copy(tiny_model, policy)), rel=1e-5)
    # Averaging the factors gives another matrix altogether (the EMA of a product is not the product of EMAs).
    gaps = []
    for name, layer in lora_layers(policy):
        a, b = naive[name]
        naive_weight = layer.base_layer.weight + layer.scaling["default"] * (b @ a)
        gaps.append(float((naive_weight - expected[f"{name}.weight"]).abs().max()))
    assert max(gaps) > 0.05


def test_lora_anchor_shares_the_frozen_base_and_stores_one_delta_per_adapted_module(tiny_model):
    policy = lora_policy(tiny_model)
    anchor = ema_anchor(policy)
    policy_storage = {p.data_ptr() for p in policy.parameters()}
    assert all(p.data_ptr() in policy_storage for p in anchor.module.parameters())  # no copy of the base
    state = anchor.state_dict()
    assert sorted(state) == sorted(f"{name}.delta" for name, _ in lora_layers(policy))
    assert all(state[f"{name}.delta"].shape == layer.base_layer.weight.shape for name, layer in lora_layers(policy))
    assert all(d.dtype == torch.float32 and d.abs().max() == 0 for d in state.values())  # fresh adapters: B = 0
    # The anchor is detached from the policy: moving the adapters leaves it, tau = 1 leaves it bit for bit.
    move_adapters(policy, torch.Generator().manual_seed(1))
    before = {k: v.clone() for k, v in state.items()}
    anchor.update(policy, 1.0)
    assert all(torch.equal(before[k], v) for k, v in anchor.state_dict().items())
    anchor.reset_to(policy)
    assert anchor.distance(policy) == 0.0


def test_lora_anchor_state_round_trip_and_mismatches_are_refused(tiny_model):
    policy = lora_policy(tiny_model)
    move_adapters(policy, torch.Generator().manual_seed(2))
    anchor = ema_anchor(policy)
    other = ema_anchor(lora_policy(tiny_model))
    other.load_state_dict({k: v.clone() for k, v in anchor.state_dict().items()})
    assert all(torch.equal(v, anchor.state_dict()[k]) for k, v in other.state_dict().items())
    with pytest.raises(ValueError, match="LoRA EMA anchor state mismatch"):
        other.load_state_dict(EmaAnchor(tiny_model).state_dict())  # a full-weight anchor's state
    with pytest.raises(ValueError, match="at .*delta"):
        other.load_state_dict({k: v.double() for k, v in anchor.state_dict().items()})
    with pytest.raises(ValueError, match="only its adapters"):
        unfrozen = lora_policy(tiny_model)
        unfrozen.model.norm.weight.requires_grad_(True)
        LoraEmaAnchor(unfrozen)


def lora_trainer(tiny_model_dir, tmp_path, *overrides):
    from agent.policy import load_policy

    cfg = load_config(overrides=[
        f"out_dir={tmp_path}", "train.prompts_per_iteration=3", "train.rollouts_per_prompt=2",
        "train.mini_batch_size=3", "train.micro_batch_size=3", "train.lr=1e-2", "train.warmup_steps=0",
        "kl.topk=4", "kl.beta=0.5", "ema.period=1", "ema.tau=0.5", "lora.rank=4", "lora.alpha=8",
        f"lora.target_modules={TARGETS}", *overrides,
    ])
    set_seed(cfg.seed)
    return PolicyTrainer(cfg, load_policy(str(tiny_model_dir)))


def scored_batch(tokenizer):
    return collate(ragged_trajectories(len(tokenizer)), torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]), pad_id=0)


def test_only_the_adapters_train_and_engines_get_the_merged_weights(tiny_model, tiny_model_dir, tokenizer, tmp_path):
    trainer = lora_trainer(tiny_model_dir, tmp_path)
    policy = trainer.policy
    base = {name: p.detach().clone() for name, p in policy.named_parameters() if not p.requires_grad}
    adapters = {name: p.detach().clone() for name, p in policy.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in name for name in adapters)
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in policy.parameters() if p.requires_grad}  # AdamW holds the adapters alone
    stats = trainer.train_step(scored_batch(tokenizer), iteration=1)
    assert stats["optimizer_steps"] == 2 and stats["anchor_distance"] > 0
    for name, p in policy.named_parameters():
        if p.requires_grad:
            assert not torch.equal(p, adapters[name]), name  # lr 1e-2: every adapter moved (B from 0)
        else:
            assert torch.equal(p, base[name]), name  # the base never moves

    # What an engine gets: the base model's own names, W0 + s B A; a plain model holding them computes the same.
    merged = trainer.policy_state()
    assert set(merged) == set(tiny_model.state_dict())
    plain = copy.deepcopy(tiny_model)
    plain.load_state_dict(merged)
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, policy(ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(tiny_model(ids).logits, policy(ids).logits, atol=1e-3)  # the adapters count
    from trainer.lora import engine_weights

    assert dict(engine_weights(policy)).keys() == dict(plain.named_parameters()).keys()  # vLLM's in-process sync


def test_lora_with_activation_checkpointing_takes_the_same_step(tiny_model_dir, tokenizer, tmp_path):
    """The LoRA recipe checkpoints activations: with a frozen base no layer input needs a gradient, which the
    non-reentrant recompute handles."""
    steps = []
    for checkpointing in (False, True):
        trainer = lora_trainer(tiny_model_dir, tmp_path, f"train.gradient_checkpointing={checkpointing}")
        stats = trainer.train_step(scored_batch(tokenizer), iteration=1)
        steps.append((stats, trainer.state()["policy"]))
    (plain, plain_adapters), (checkpointed, checkpointed_adapters) = steps
    assert checkpointed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)
    for name, value in plain_adapters.items():
        torch.testing.assert_close(checkpointed_adapters[name], value, rtol=1e-5, atol=1e-6)


def save(state: dict, folder, iteration: int = 2):
    return save_checkpoint(Checkpoint(iteration, **state, rng={"python": [3, [0], None], "numpy": ["MT19937", [0] * 624,
                           0, 0, 0.0], "torch": torch.get_rng_state()}, data_cursor={}, config={}), folder)


def learner_state(loaded: Checkpoint) -> dict:
    return {"policy": loaded.policy, "anchor": loaded.anchor, "optimizer": loaded.optimizer,
            "scheduler": loaded.scheduler}


def test_lora_checkpoint_round_trip_is_exact(tiny_model_dir, tokenizer, tmp_path):
    first = lora_trainer(tiny_model_dir, tmp_path)
    batch = scored_batch(tokenizer)
    for iteration in (1, 2):
        first.train_step(batch, iteration)
    state = first.state()
    adapters = {name for name in state["policy"] if name != BASE_FINGERPRINT}
    assert adapters and all(".lora_" in name for name in adapters)  # the adapters, not the frozen base
    path = save(state, tmp_path / "run")
    adapters_bytes = (path / "policy.safetensors").stat().st_size
    assert adapters_bytes < sum(p.numel() * 4 for p in first.policy.parameters()) / 20
    loaded = load_checkpoint(path)

    second = lora_trainer(tiny_model_dir, tmp_path)
    move_adapters(second.policy, torch.Generator().manual_seed(3))  # other adapters, then the checkpoint's
    second.load_state(learner_state(loaded))
    for part in ("policy", "anchor"):
        for name, value in state[part].items():
            assert torch.equal(second.state()[part][name], value), name
    torch.testing.assert_close(second.state()["optimizer"]["state"], state["optimizer"]["state"], rtol=0, atol=0)
    # The next step from the restored run is the next step of the original, bit for bit.
    a, b = first.train_step(batch, 3), second.train_step(batch, 3)
    for key in ("loss", "kl", "grad_norm", "anchor_distance"):
        assert a[key] == b[key], key
    for part in ("policy", "anchor"):
        for name, value in first.state()[part].items():
            assert torch.equal(second.state()[part][name], value), name


def test_lora_and_full_checkpoints_are_not_interchangeable(tiny_model_dir, tokenizer, tmp_path):
    lora = lora_trainer(tiny_model_dir, tmp_path)
    full = lora_trainer(tiny_model_dir, tmp_path, "lora.rank=0")
    with pytest.raises(ValueError, match="LoRA checkpoint mismatch"):
        lora.load_state(full.state())
    with pytest.raises(ValueError, match="holds LoRA adapters but this run has lora.rank=0"):
        full.load_state(lora.state())


def test_lora_starts_from_a_full_checkpoint_and_resumes_on_that_base_only(tiny_model_dir, tokenizer, tmp_path):
    """`--init` under LoRA (e.g. from SFT): the checkpoint's weights become the frozen base and the anchor starts
    there; the run's checkpoints (adapters) are refused on any other base, e.g. `model` itself."""
    from trainer.run.checkpoint import load_policy_weights

    full = lora_trainer(tiny_model_dir, tmp_path, "lora.rank=0")
    batch = scored_batch(tokenizer)
    full.train_step(batch, iteration=1)  # "SFT": weights away from `model`'s
    sft = save(full.state(), tmp_path / "sft", iteration=1)

    lora = lora_trainer(tiny_model_dir, tmp_path)
    lora.init_from(sft)
    sft_weights = load_policy_weights(sft)
    merged = lora.policy_state()  # fresh adapters (B = 0): exactly the SFT weights
    assert merged.keys() == sft_weights.keys()
    assert all(torch.equal(merged[name], sft_weights[name]) for name in merged)
    ids = torch.randint(0, len(tokenizer), (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lora.anchor.module(ids).logits, lora.policy(ids).logits)  # the anchor starts at SFT
    assert all(not p.requires_grad for name, p in lora.policy.named_parameters() if ".lora_" not in name)

    lora.train_step(batch, iteration=1)
    run = save(lora.state(), tmp_path / "run", iteration=1)
    on_model = lora_trainer(tiny_model_dir, tmp_path)  # resumed without --init: the base would be `model`
    with pytest.raises(ValueError, match="trained on another base"):
        on_model.load_state(learner_state(load_checkpoint(run)))
    resumed = lora_trainer(tiny_model_dir, tmp_path)
    resumed.init_from(sft)  # what `emapg train --init sft --resume` does first
    resumed.load_state(learner_state(load_checkpoint(run)))
    for name, value in lora.policy_state().items():
        assert torch.equal(resumed.policy_state()[name], value), name
    with pytest.raises(ValueError, match="holds LoRA adapters"):
        resumed.init_from(run)  # a base must be full weights


def test_adapters_are_fp32_on_a_bf16_base(tiny_model):
    policy = apply_lora(copy.deepcopy(tiny_model).to(torch.bfloat16), 4, 8.0, TARGETS, 0.0)
    dtypes = {p.dtype for p in policy.parameters() if p.requires_grad}
    assert dtypes == {torch.float32} and {p.dtype for p in policy.parameters() if not p.requires_grad} == {
        torch.bfloat16}
    move_adapters(policy, torch.Generator().manual_seed(4))
    anchor = ema_anchor(policy)
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 5))
    with torch.no_grad():  # the anchor's D x also runs in fp32 beside the bf16 base, like the adapters' B A x
        torch.testing.assert_close(anchor.module(ids).logits, policy(ids).logits, rtol=0, atol=1e-2)


def test_lora_config_is_checked(tiny_model_dir, tmp_path):
    assert load_config().lora.rank == 0  # off by default: full fine-tuning as before
    with pytest.raises(ConfigError, match="lora.rank"):
        load_config(overrides=["lora.rank=-1"])
    with pytest.raises(ConfigError, match="lora.target_modules"):
        load_config(overrides=["lora.target_modules=[]"])
    with pytest.raises(ConfigError, match="strategy=fsdp is not supported"):
        load_config(overrides=["lora.rank=8", "distributed.strategy=fsdp"])
    with pytest.raises(ValueError, match=r"lora.target_modules \['no_such_proj'\]"):
        lora_trainer(tiny_model_dir, tmp_path, "lora.target_modules=[no_such_proj]")

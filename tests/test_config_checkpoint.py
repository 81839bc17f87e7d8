"""The typed training config (YAML + overrides, errors name the field) and checkpoint integrity."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.run.checkpoint import (
    Checkpoint,
    CheckpointError,
    check_compatible,
    latest_checkpoint,
    load_checkpoint,
    optimizer_state_by_index,
    optimizer_state_by_name,
    optimizer_state_for,
    portable_optimizer_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainer.config import ConfigError, load_config


def test_overrides_and_errors_name_the_field(tmp_path):
    cfg = load_config(overrides=["kl.beta=0.01", "train.betas=[0.9, 0.99]", "ema.tau=1"])
    assert cfg.kl.beta == 0.01 and cfg.train.betas == (0.9, 0.99) and cfg.ema.tau == 1.0
    for override, field in [("kl.bta=1", "kl.bta"), ("kl.estimator=k9", "kl.estimator"), ("ema.tau=1.5", "ema.tau"),
                            ("train.lr=fast", "train.lr"), ("train.mini_batch_size=7", "train.mini_batch_size")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(overrides=[override])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(overrides=["kl.beta"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("kl: [1, 2]\n")
    with pytest.raises(ConfigError, match="kl"):
        load_config(bad)


def test_a_renamed_key_is_refused_with_its_new_name():
    """rollout.batch_size became rollout.max_in_flight: an old config fails naming the new key (never a silent
    default), and the agent's settings are the config's rollout section itself."""
    from agent.settings import RolloutSettings

    with pytest.raises(ConfigError, match=r"rollout\.batch_size was renamed rollout\.max_in_flight"):
        load_config(overrides=["rollout.batch_size=16"])
    cfg = load_config(overrides=["rollout.max_in_flight=16"])
    assert isinstance(cfg.rollout, RolloutSettings) and cfg.rollout.max_in_flight == 16
    assert RolloutSettings().max_in_flight == 32  # one default, for training and evaluation alike


def tiny_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def make_ckpt(iteration=7):
    model, opt, sched = tiny_state()
    anchor = {k: v * 0.5 for k, v in model.state_dict().items()}
    return Checkpoint(iteration, model.state_dict(), anchor, opt.state_dict(), sched.state_dict(), rng_state(),
                      {"epoch": 1, "position": 12}, {"model": "tiny", "seed": 0})


def test_round_trip_restores_everything_including_rng(tmp_path):
    ckpt = make_ckpt()
    expected_next = (random.random(), torch.rand(3))
    set_rng_state(ckpt.rng)  # rewind to the saved state
    path = save_checkpoint(ckpt, tmp_path)
    loaded = load_checkpoint(path)
    assert loaded.iteration == 7 and loaded.data_cursor == {"epoch": 1, "position": 12}
    for k, v in ckpt.policy.items():
        assert torch.equal(loaded.policy[k], v) and torch.equal(loaded.anchor[k], ckpt.anchor[k])
    assert torch.equal(loaded.optimizer["state"][0]["exp_avg"], ckpt.optimizer["state"][0]["exp_avg"])
    assert loaded.scheduler["last_epoch"] == ckpt.scheduler["last_epoch"]
    random.random(), torch.rand(3)  # move the generators on
    set_rng_state(loaded.rng)
    assert random.random() == expected_next[0] and torch.equal(torch.rand(3), expected_next[1])


def test_a_bf16_anchor_round_trips_in_bf16_bit_for_bit(tmp_path):
    """ema.dtype=bfloat16 (the authors'): the checkpoint keeps the anchor's bf16 tensors as they are, and a bf16
    EmaAnchor loads them back exactly (an fp32 one refuses them)."""
    from trainer.ema import EmaAnchor

    model, opt, sched = tiny_state()
    anchor = EmaAnchor(model, dtype=torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    anchor.update(model, 0.9)
    ckpt = Checkpoint(3, model.state_dict(), anchor.state_dict(), opt.state_dict(), sched.state_dict(), rng_state(),
                      {"epoch": 0, "position": 0}, {"model": "tiny", "seed": 0})
    loaded = load_checkpoint(save_checkpoint(ckpt, tmp_path))
    assert all(t.dtype == torch.bfloat16 for t in loaded.anchor.values())
    restored = EmaAnchor(tiny_state()[0], dtype=torch.bfloat16)
    restored.load_state_dict(loaded.anchor)
    for name, tensor in anchor.state_dict().items():
        assert torch.equal(restored.state_dict()[name], tensor)
    with pytest.raises(ValueError, match="bfloat16"):
        EmaAnchor(tiny_state()[0]).load_state_dict(loaded.anchor)


def test_truncated_modified_or_incomplete_checkpoints_are_refused(tmp_path):
    path = save_checkpoint(make_ckpt(), tmp_path)
    weights = path / "policy.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="policy.safetensors is truncated or modified"):
        load_checkpoint(path)
    weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    with pytest.raises(CheckpointError, match="truncated or modified"):
        load_checkpoint(path)
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        load_checkpoint(path)


def test_keeps_the_newest_and_refuses_another_model(tmp_path):
    for it in (10, 20, 30):
        save_checkpoint(make_ckpt(it), tmp_path, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["iter-000020", "iter-000030"]
    assert latest_checkpoint(tmp_path).name == "iter-000030"
    with pytest.raises(CheckpointError, match="model='tiny'"):
        check_compatible({"model": "tiny"}, {"model": "other"})


def test_optimizer_state_by_name_maps_to_torch_format_and_back():
    """torch.distributed.checkpoint's state dict (by name; what FSDP gives) becomes AdamW's own (by position), with a
    tied weight counted once, and back."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 5))
    model[0].weight = model[2].weight  # tied, as SmolLM2's embedding and head: one parameter, two names
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2])).square().sum().backward()
    optimizer.step()
    names = [name for name, _ in model.named_parameters()]
    by_name = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))

    by_index = optimizer_state_by_index(by_name, names)
    torch.testing.assert_close(by_index, optimizer.state_dict(), rtol=0, atol=0)
    back = optimizer_state_by_name(by_index, names)
    assert back["param_groups"] == by_name["param_groups"]
    torch.testing.assert_close(back["state"], by_name["state"], rtol=0, atol=0)


def test_a_portable_optimizer_state_resumes_with_the_live_optimizers_own_kernel():
    """A checkpoint's AdamW state leaves out how the step runs: a state saved fused loads into a per-tensor
    optimizer (FSDP's DTensors have no fused kernel) and stays per-tensor, a state from before fused AdamW
    (fused None) loads into a fused one and stays fused, and the moments and step counts come through exactly."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    fused = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model(torch.ones(2, 4)).square().sum().backward()
    fused.step()
    saved = portable_optimizer_state(fused.state_dict())
    assert all("fused" not in group and "foreach" not in group for group in saved["param_groups"])

    per_tensor = torch.optim.AdamW(model.parameters(), lr=0.1)
    per_tensor.load_state_dict(optimizer_state_for(per_tensor, saved))
    assert per_tensor.param_groups[0]["fused"] is None
    torch.testing.assert_close(per_tensor.state_dict()["state"], fused.state_dict()["state"], rtol=0, atol=0)

    older = per_tensor.state_dict()  # what a checkpoint from before fused AdamW holds: fused None
    again = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    again.load_state_dict(optimizer_state_for(again, older))
    assert again.param_groups[0]["fused"] is True
    torch.testing.assert_close(again.state_dict()["state"], fused.state_dict()["state"], rtol=0, atol=0)

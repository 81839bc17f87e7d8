"""The optimizer and the RL learning-rate schedule (trainer/schedule.py): the fused AdamW takes the per-tensor one's
steps to rounding; warm-up in AdamW steps equals transformers' schedule, and warm-up as a fraction of iterations
equals verl's (the authors' recipe), a scheduler stepped once per iteration."""

from __future__ import annotations

import pytest
import torch
from transformers import get_constant_schedule_with_warmup

from trainer.config import ConfigError, TrainSection, load_config
from trainer.schedule import adamw, learning_rate_schedule, steps_per_iteration, warmup_iterations

LR = 1e-6


def optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)


def test_adamw_is_fused_on_cpu_and_steps_as_the_per_tensor_adamw():
    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 32, generator=generator), torch.randn(32, generator=generator)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(5)]
    trained = {}
    for kind in ("fused", "per tensor"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        if kind == "fused":
            opt = adamw(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
            assert opt.param_groups[0]["fused"] is True
        else:
            opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
        trained[kind] = params
    assert not torch.equal(trained["fused"][0], start[0])  # five steps of 1e-2 moved it
    for fused, reference in zip(trained["fused"], trained["per tensor"], strict=True):
        torch.testing.assert_close(fused, reference, rtol=0, atol=1e-6)


def rates(scheduler, steps: int) -> list[float]:
    """The learning rate of each of `steps` optimizer steps, stepping the scheduler after each (as the learner)."""
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("warmup_steps", [0, 1, 3, 10])
def test_warmup_in_steps_is_transformers_constant_schedule_with_warmup(warmup_steps):
    train = TrainSection(warmup_steps=warmup_steps)
    assert rates(learning_rate_schedule(optimizer(), train), 25) == rates(
        get_constant_schedule_with_warmup(optimizer(), warmup_steps), 25)


def verl_rates(per_iteration: int, total_training_steps: int, ratio: float, iterations: int) -> list[float]:
    """What verl's actor sees (fsdp_workers.py builds the schedule, update_actor steps it once per iteration after
    its AdamW steps): a constant-with-warm-up LambdaLR over int(ratio x total) iterations, written out here."""
    warmup = int(ratio * total_training_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer(), lambda i: min(1, float(i) / float(max(1, warmup))))
    out = []
    for _ in range(iterations):
        out.extend([scheduler.get_last_lr()[0]] * per_iteration)  # every AdamW step of the iteration
        scheduler.optimizer.step()
        scheduler.step()
    return out


def test_warmup_fraction_is_verls_per_iteration_warmup():
    # 8 trajectories, mini-batches of 4, 2 PPO epochs: 4 AdamW steps per iteration; W = int(0.25 x 22) = 5.
    train = TrainSection(iterations=22, prompts_per_iteration=4, rollouts_per_prompt=2, mini_batch_size=4,
                         micro_batch_size=2, ppo_epochs=2, warmup_steps=0, warmup_fraction=0.25)
    assert (steps_per_iteration(train), warmup_iterations(train)) == (4, 5)
    ours = rates(learning_rate_schedule(optimizer(), train), 22 * 4)
    assert ours == pytest.approx(verl_rates(4, 22, 0.25, 22), rel=1e-12, abs=0)
    assert ours[:4] == [0.0] * 4 and ours[4:8] == [LR / 5] * 4 and ours[20:] == [LR] * (len(ours) - 20)


def test_the_papers_warmup_is_286_iterations_of_10_steps():
    """The released recipe: lr_warmup_steps_ratio 0.285 of total_training_steps 1005, i.e. int(286.4) = 286; ours
    over the 1004 iterations their loop trains gives the same int(286.1)."""
    train = load_config(overrides=["train.warmup_steps=0", "train.warmup_fraction=0.285", "train.iterations=1004"]).train
    assert (steps_per_iteration(train), warmup_iterations(train), int(0.285 * 1005)) == (10, 286, 286)


def test_the_schedule_resumes_from_its_state_dict():
    train = TrainSection(iterations=10, prompts_per_iteration=2, rollouts_per_prompt=2, mini_batch_size=2,
                         micro_batch_size=2, warmup_steps=0, warmup_fraction=0.5)
    first = learning_rate_schedule(optimizer(), train)
    before = rates(first, 7)
    resumed = learning_rate_schedule(optimizer(), train)
    resumed.load_state_dict(first.state_dict())
    assert before + rates(resumed, 8) == rates(learning_rate_schedule(optimizer(), train), 15)


def test_two_warmups_at_once_are_a_config_error_naming_both_fields():
    with pytest.raises(ConfigError, match=r"train\.warmup_steps \(10\) and train\.warmup_fraction"):
        load_config(overrides=["train.warmup_fraction=0.285"])
    with pytest.raises(ConfigError, match="train.warmup_fraction"):
        load_config(overrides=["train.warmup_steps=0", "train.warmup_fraction=1.5"])

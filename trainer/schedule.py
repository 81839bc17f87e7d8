"""The optimizer (AdamW, fused where torch can) and the RL learning-rate schedule: a linear warm-up from 0, then
constant. The learner steps it once per AdamW step.

Two ways to say how long the warm-up is (trainer.config.TrainSection):

- `train.warmup_steps` AdamW steps (ours): the rate rises by lr / warmup_steps every step, from 0 at the first one
  (transformers' `get_constant_schedule_with_warmup`).
- `train.warmup_fraction` of `train.iterations` (the authors' recipe, verl's `lr_warmup_steps_ratio`): W =
  floor(fraction x iterations) iterations, and the rate steps once per iteration, not per AdamW step, as verl's
  scheduler does: iteration i (from 1) runs all its AdamW steps at lr x min(1, (i - 1) / W), so the first
  iteration's steps run at 0. With 10 AdamW steps per iteration that is 10 W steps of warm-up, where warmup_steps
  counts single steps.

A step the guard skips (trainer.run.guard) does not step the schedule in either mode, so after a skip the fraction mode's
rate changes one step later within the iteration than verl's would.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from trainer.config import TrainSection


def adamw(params: list[torch.nn.Parameter], *, lr: float, betas: tuple[float, float],
          weight_decay: float) -> torch.optim.AdamW:
    """AdamW, fused into one kernel over all parameters where torch has one for them (floating tensors on CPU or CUDA,
    none of them sharded DTensors). On 2 CPU cores a step over SmolLM2-135M's parameters takes 0.44 s fused against
    1.40 s one tensor at a time (torch's CPU default), a fifth of a GRPO update there (docs/benchmarks.md); the two
    differ by rounding only (at most 1e-9 in the parameters after a step there). RL only: SFT keeps the per-tensor
    step (trainer/run/sft.py)."""
    from torch.distributed.tensor import DTensor

    fusable = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() and not isinstance(p, DTensor)
                  for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=fusable or None)


def step_warmup(step: int, warmup_steps: int) -> float:
    """The share of the learning rate at AdamW step `step` (from 0): step / warmup_steps, 1 from warmup_steps on
    (at once when it is 0), as transformers' get_constant_schedule_with_warmup."""
    return 1.0 if step >= warmup_steps else step / warmup_steps


def iteration_warmup(iteration: int, warmup_iterations: int) -> float:
    """The share at iteration `iteration` (from 0): verl's min(1, i / max(1, W)) (so even W = 0 starts at 0)."""
    return min(1.0, iteration / max(1, warmup_iterations))


def steps_per_iteration(train: TrainSection) -> int:
    """AdamW steps per iteration: mini-batches per epoch x PPO epochs (the config makes the division exact)."""
    return train.prompts_per_iteration * train.rollouts_per_prompt // train.mini_batch_size * train.ppo_epochs


def warmup_iterations(train: TrainSection) -> int:
    """W = floor(warmup_fraction x iterations), verl's int(lr_warmup_steps_ratio x total_training_steps)."""
    if train.warmup_fraction is None:
        raise ValueError("train.warmup_fraction is not set")
    return int(train.warmup_fraction * train.iterations)


def learning_rate_schedule(optimizer: Optimizer, train: TrainSection) -> LambdaLR:
    """The schedule `train` asks for, as a LambdaLR stepped once per AdamW step."""
    if train.warmup_fraction is None:
        return LambdaLR(optimizer, lambda step: step_warmup(step, train.warmup_steps))
    per_iteration, warmup = steps_per_iteration(train), warmup_iterations(train)
    return LambdaLR(optimizer, lambda step: iteration_warmup(step // per_iteration, warmup))

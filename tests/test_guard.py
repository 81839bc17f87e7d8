"""The training-health guard (trainer/run/guard.py): its rules on hand-made metric sequences, and on real tiny models a
non-finite micro-batch that never reaches the weights, N in a row that stop the run, and a collapse rolled back to
exactly the last good state at a lower learning rate (one process, and two DDP/FSDP ranks)."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path

import pytest
import torch
from test_learner import ragged_trajectories
from test_training import (  # noqa: F401 (peaked_model: a fixture)
    make_trainer,
    peaked_model,
    peaked_tiny_model,
    tiny_config,
    tiny_examples,
)

from trainer.learner.batch import collate
from trainer.config import GuardSection, load_config
from trainer.run.workers import PolicyTrainer
from trainer.learner.step_guard import GuardError, StepGuard
from trainer.run.guard import (
    Guard,
    bounds_rule,
    collapse_rules,
    entropy_rise_rule,
    events_markdown,
    nonfinite_rule,
    read_events,
    reward_collapse_rule,
    scale_learning_rate,
)
from trainer.reward import Score

NAN = float("nan")


# ---- pure rules on hand-made sequences -------------------------------------------------------------------------------

def observe_rewards(rewards: list[float], **rules) -> list[tuple[int, dict[str, str], dict]]:
    """Feed a reward sequence (other metrics healthy) to a Guard; (iteration, fired rules, metrics) per iteration."""
    guard = Guard(GuardSection(**rules), Path("unused"))  # no skipped steps: no event is written
    out = []
    for iteration, reward in enumerate(rewards, start=1):
        metrics = {"rollout/reward": reward, "loss/entropy": 0.25, "kl/anchor": 0.001, "loss/clip_fraction": 0.01,
                   "kl/anchor_distance": 0.1}
        out.append((iteration, guard.observe(iteration, metrics), metrics))
    return out


def test_reward_collapse_fires_after_warm_up_when_the_smoothed_reward_falls_below_a_fraction_of_its_peak():
    rewards = [0.1, 0.3, 0.5, 0.5, 0.5, 0.2, 0.0, 0.0, 0.0]
    seen = observe_rewards(rewards, warmup_iterations=3, reward_window=3, reward_drop=0.2)
    smoothed = [m["guard/reward_smoothed"] for _, _, m in seen]
    # Trailing means of 3 (fewer at the start), by hand; the peak is the running max of those.
    expected = [0.1, 0.2, 0.3, 13 / 30, 0.5, 0.4, 0.7 / 3, 0.2 / 3, 0.0]
    assert smoothed == pytest.approx(expected)
    assert [m["guard/reward_peak"] for _, _, m in seen] == pytest.approx([0.1, 0.2, 0.3, 13 / 30, 0.5, 0.5, 0.5, 0.5, 0.5])
    fired = [iteration for iteration, rules, _ in seen if rules]
    assert fired == [8, 9]  # 0.2/3 < 0.2 x 0.5; iteration 7's 0.233 is not
    assert "reward_collapse" in seen[7][1]


def test_reward_rule_waits_for_warm_up_and_a_peak_worth_falling_from():
    # A fall during warm-up does not fire, nor does one from a peak under min_reward_peak.
    assert not any(r for _, r, _ in observe_rewards([0.6, 0.0, 0.0], warmup_iterations=3, reward_window=1))
    assert not any(r for _, r, _ in observe_rewards([0.04, 0.0, 0.0, 0.0], warmup_iterations=0, reward_window=1))
    assert reward_collapse_rule(0.0, 0.5, 3, GuardSection(reward_drop=None, warmup_iterations=0)) is None


def test_default_rules_never_fire_on_a_healthy_noisy_cpu_compare_run():
    # Per-iteration rewards with the spread the cpu_compare run logged (0.09-0.52, mean ~0.2; docs/history/).
    rewards = [0.25, 0.09, 0.52, 0.17, 0.12, 0.30, 0.09, 0.14, 0.21, 0.38, 0.10, 0.09, 0.16, 0.27, 0.11, 0.09,
               0.44, 0.13, 0.19, 0.10] * 3
    assert not any(rules for _, rules, _ in observe_rewards(rewards))


def observe_entropies(entropies: list[float], **rules) -> list[dict[str, str]]:
    """Feed an entropy sequence (a flat, healthy reward) to a Guard: the fired rules per iteration."""
    guard = Guard(GuardSection(**rules), Path("unused"))
    return [guard.observe(i, {"rollout/reward": 0.3, "loss/entropy": h, "kl/anchor": 0.01}) for i, h in enumerate(entropies, start=1)]


# Per-iteration entropy of two GRPO pilots of configs/cpu_evidence.yaml (artifacts/runs/cpu-evidence-pilot-lr*/grpo/
# metrics.jsonl, rounded): lr 8e-5 collapsed (held-out EM 0.22 -> 0.015) with its reward flat, lr 2e-5 was healthy.
PILOT_8E5_ENTROPY = [0.21, 0.2, 0.22, 0.5, 0.86, 0.66, 0.78, 0.52, 0.45, 1.0, 1.53, 1.36, 1.31, 0.95, 0.84, 1.1, 0.95,
                     1.37, 1.0, 1.68]
PILOT_2E5_ENTROPY = [0.21, 0.19, 0.17, 0.17, 0.16, 0.17, 0.18, 0.17, 0.16, 0.22, 0.16, 0.21, 0.18, 0.13, 0.22, 0.13,
                     0.18, 0.16, 0.14, 0.09]


def test_entropy_rise_fires_on_the_collapsed_pilot_and_never_on_the_healthy_one():
    fired = [i for i, rules in enumerate(observe_entropies(PILOT_8E5_ENTROPY), start=1) if "entropy_rise" in rules]
    # Trailing means of 5 against the first iteration's 0.21: iteration 11's (1.0+0.45+0.52+0.78+1.53)/5 = 0.856 is
    # 4.08x; iteration 12's 4.63x, ...; the guard's default warm-up (10) holds the rule until iteration 11.
    assert fired == list(range(11, 21))
    assert not any(observe_entropies(PILOT_2E5_ENTROPY))
    assert not any(observe_entropies(PILOT_8E5_ENTROPY, entropy_rise=None))


def test_entropy_rise_rule_by_hand():
    cfg = GuardSection(entropy_rise=3.0, warmup_iterations=2)
    assert entropy_rise_rule(0.61, 0.2, 3, cfg) == ("entropy (mean of the last 5 iterations) 0.61 > 3.0 x its first "
                                                    "iteration's 0.2")
    assert entropy_rise_rule(0.6, 0.2, 3, cfg) is None  # not above
    assert entropy_rise_rule(0.9, 0.2, 2, cfg) is None  # warm-up
    assert entropy_rise_rule(0.9, 0.0, 3, cfg) is None  # a start at zero has no multiple to exceed


def test_the_entropy_signals_survive_a_checkpoint_and_older_checkpoints_start_them_afresh():
    guard = Guard(GuardSection(), Path("unused"))
    for i, h in enumerate([0.3, 0.5, 0.4], start=1):
        metrics = {"rollout/reward": 0.2, "loss/entropy": h}
        guard.observe(i, metrics)
    assert metrics["guard/entropy_start"] == 0.3 and metrics["guard/entropy_smoothed"] == pytest.approx(0.4)
    restored = Guard(GuardSection(), Path("unused"))
    restored.load_state_dict(copy.deepcopy(guard.state_dict()))
    after, again = {"rollout/reward": 0.2, "loss/entropy": 0.6}, {"rollout/reward": 0.2, "loss/entropy": 0.6}
    guard.observe(4, after)
    restored.observe(4, again)
    assert after == again
    old = Guard(GuardSection(), Path("unused"))
    old.load_state_dict({"recent_rewards": [0.2], "reward_peak": 0.2, "rollbacks": 0, "lr_scale": 1.0})
    metrics = {"rollout/reward": 0.2, "loss/entropy": 0.6}
    old.observe(4, metrics)
    assert metrics["guard/entropy_start"] == 0.6 and metrics["guard/entropy_smoothed"] == 0.6


def test_bounds_and_nonfinite_rules():
    assert bounds_rule("entropy", 0.01, low=0.05) == "entropy 0.01 < 0.05"
    assert bounds_rule("entropy", 7.5, 0.05, 6.0) == "entropy 7.5 > 6.0"
    assert bounds_rule("entropy", 3.0, None, None) is None
    assert bounds_rule("entropy", NAN, 0.05, 6.0) is None  # the non-finite rule's business
    assert bounds_rule("entropy", None, 0.05, 6.0) is None  # no optimizer step this iteration
    assert (nonfinite_rule({"rollout/reward": 0.2, "kl/anchor": NAN, "loss/grad_norm": math.inf})
            == "non-finite kl/anchor=nan, loss/grad_norm=inf")
    assert nonfinite_rule({"rollout/reward": 0.2}) is None
    fired = collapse_rules({"rollout/reward": 0.2, "loss/entropy": 9.0, "kl/anchor": 2.0,
                            "rollout/zero_variance_groups": 1.0}, 1, GuardSection(kl_max=1.0, zero_variance_max=0.9))
    assert fired == {"entropy": "loss/entropy 9 > 6.0", "kl": "kl/anchor 2 > 1.0",
                     "zero_variance_groups": "rollout/zero_variance_groups 1 > 0.9"}


def test_step_guard_skips_non_finite_steps_and_stops_after_n_in_a_row():
    guard = StepGuard(max_consecutive_skips=3)
    assert guard.skip(None, 0.5, "iteration 1, optimizer step 1") is False
    assert guard.skip(2, NAN, "iteration 1, optimizer step 2") is True
    assert guard.skip(None, math.inf, "iteration 2, optimizer step 1") is True
    assert guard.skip(None, 0.7, "iteration 2, optimizer step 2") is False  # a good step resets the count
    assert guard.skip(0, 0.7, "iteration 3, optimizer step 1") is True
    assert guard.skip(None, NAN, "iteration 3, optimizer step 2") is True
    with pytest.raises(GuardError, match=r"3 optimizer steps in a row.*iteration 4, optimizer step 1: micro-batch 1"):
        guard.skip(1, NAN, "iteration 4, optimizer step 1")


def test_scale_learning_rate_equals_a_schedule_built_at_the_lower_rate():
    from transformers import get_constant_schedule_with_warmup

    def schedule(lr: float):
        params = [torch.nn.Parameter(torch.ones(2))]
        optimizer = torch.optim.AdamW(params, lr=lr)
        return params, optimizer, get_constant_schedule_with_warmup(optimizer, 4)

    params, optimizer, scheduler = schedule(1e-3)
    for _ in range(2):  # part-way through the warm-up
        params[0].grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    opt_state, sched_state = copy.deepcopy(optimizer.state_dict()), copy.deepcopy(scheduler.state_dict())
    scale_learning_rate(opt_state, sched_state, 0.25)
    _, restored, restored_scheduler = schedule(1e-3)
    restored.load_state_dict(opt_state)
    restored_scheduler.load_state_dict(sched_state)
    _, reference, reference_scheduler = schedule(0.25e-3)
    for _ in range(2):
        reference.step()
        reference_scheduler.step()
    lrs, want = [], []
    for _ in range(4):  # the rest of the warm-up, then constant
        lrs.append(restored.param_groups[0]["lr"])
        want.append(reference.param_groups[0]["lr"])
        restored_scheduler.step()
        reference_scheduler.step()
    assert lrs == pytest.approx(want, rel=1e-12)
    assert lrs[-1] == pytest.approx(0.25e-3)


# ---- the learner on a real tiny model --------------------------------------------------------------------------------

def learner_config(*overrides: str):
    return load_config(overrides=[
        "train.prompts_per_iteration=3", "train.rollouts_per_prompt=2", "train.mini_batch_size=6",
        "train.micro_batch_size=2", "train.lr=1e-3", "train.warmup_steps=3", "kl.topk=4", "kl.beta=0.5",
        "ema.period=1", *overrides,
    ])


def learning_state(trainer: PolicyTrainer) -> dict:
    return copy.deepcopy({**trainer.state(), "lr": trainer.optimizer.param_groups[0]["lr"]})


def assert_identical(a, b, where: str = "") -> None:
    """Bit-identical nested state (tensors with torch.equal, the rest with ==)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_a_nan_in_one_micro_batch_leaves_weights_anchor_and_optimizer_bit_identical(tiny_model, tokenizer):
    trainer = PolicyTrainer(learner_config(), copy.deepcopy(tiny_model))
    trajs = ragged_trajectories(len(tokenizer))
    healthy = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    for iteration in (1, 2):  # warm-up lr 0, then 1/3 x lr: AdamW moments, weights and anchor all moved
        stats = trainer.train_step(collate(trajs, healthy, tokenizer.pad_token_id), iteration)
        assert stats["optimizer_steps"] == 1 and stats["guard_skipped_steps"] == 0
    before = learning_state(trainer)

    fake_advantages = healthy.clone()
    fake_advantages[3] = NAN  # a fake advantage: row 3's micro-batch (one of 3) gets a NaN loss
    stats = trainer.train_step(collate(trajs, fake_advantages, tokenizer.pad_token_id), 3)
    assert stats["guard_skipped_steps"] == 1 and stats["optimizer_steps"] == 0
    assert "policy_loss" not in stats  # the skipped step's stats are not averaged in
    assert_identical(learning_state(trainer), before, "state")  # policy, anchor (no EMA update), AdamW, scheduler
    assert all(p.grad is None for p in trainer.policy.parameters())

    after = trainer.train_step(collate(trajs, healthy, tokenizer.pad_token_id), 4)  # and it learns on
    assert after["optimizer_steps"] == 1 and math.isfinite(after["policy_loss"])
    assert after["lr"] == pytest.approx(2 / 3 * 1e-3)  # the schedule's third step: the skipped one did not count


class FakeNanGradientOnce:
    """A fake fault (a post-accumulate hook): the first gradient accumulated into a weight's .grad is NaN; every loss
    stays finite. After accumulation, not on the gradient's way: the learner's gradient probe takes
    gradients of the KL term with torch.autograd.grad (nothing accumulated), and must not use up the fault."""

    def __init__(self):
        self.fired = False

    def __call__(self, param: torch.Tensor) -> None:
        if not self.fired:
            self.fired = True
            param.grad.fill_(NAN)


def test_a_fake_nan_gradient_is_caught_by_the_gradient_norm(tiny_model, tokenizer):
    cfg = learner_config("train.mini_batch_size=3", "train.micro_batch_size=1", "train.warmup_steps=0")
    trainer = PolicyTrainer(cfg, copy.deepcopy(tiny_model))
    trainer.policy.get_input_embeddings().weight.register_post_accumulate_grad_hook(FakeNanGradientOnce())
    before = copy.deepcopy(trainer.policy.state_dict())
    stats = trainer.train_step(collate(ragged_trajectories(len(tokenizer)),
                                       torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]), tokenizer.pad_token_id), 1)
    assert stats["guard_skipped_steps"] == 1 and stats["optimizer_steps"] == 1  # 2 mini-batches: one skipped
    assert all(torch.isfinite(p).all() for p in trainer.policy.parameters())
    assert any(not torch.equal(p, before[name]) for name, p in trainer.policy.state_dict().items())


def test_guard_off_steps_the_nan_into_the_weights(tiny_model, tokenizer):
    """What the guard is for: without it, the same fake NaN advantage reaches the weights."""
    trainer = PolicyTrainer(learner_config("guard.enabled=false"), copy.deepcopy(tiny_model))
    fake_advantages = torch.tensor([1.0, -1.0, 0.5, NAN, 2.0, -2.0])
    stats = trainer.train_step(collate(ragged_trajectories(len(tokenizer)), fake_advantages,
                                       tokenizer.pad_token_id), 1)
    assert stats["optimizer_steps"] == 1
    assert not all(torch.isfinite(p).all() for p in trainer.policy.parameters())


# ---- the training loop: N skips in a row, rollback -------------------------------------------------------------------

def small_run(tmp_path, *overrides):
    return tiny_config(tmp_path, "train.prompts_per_iteration=4", "train.rollouts_per_prompt=4",
                       "train.mini_batch_size=8", "train.micro_batch_size=4", "train.lr=1e-3", *overrides)


def test_n_skipped_steps_in_a_row_stop_the_run_naming_iteration_and_micro_batch(tmp_path, peaked_model, tokenizer):
    cfg = small_run(tmp_path, "train.iterations=5", "guard.max_consecutive_skips=3")
    trainer = make_trainer(cfg, peaked_model, tokenizer)
    start = copy.deepcopy(trainer.workers.learning.policy.state_dict())
    layer = trainer.workers.learning.policy.get_decoder().layers[0].mlp
    # A fake fault: the MLP's output turns NaN in train mode (the learner's gradient passes), every step.
    layer.register_forward_hook(lambda module, inputs, output: output * NAN if module.training else output)
    with pytest.raises(GuardError, match=r"3 optimizer steps in a row skipped.*iteration 2, optimizer step 1: "
                                         r"micro-batch 0 had a non-finite loss"):
        trainer.run()
    for name, p in trainer.workers.learning.policy.state_dict().items():
        assert torch.equal(p, start[name]), name
    events = read_events(cfg.run_dir)
    assert [e["action"] for e in events] == ["skipped_steps"]  # iteration 1's 2 skipped steps; then the stop
    assert events[0]["iteration"] == 1


class FakeCollapsingReward:
    """A fake reward: rollout s of each group scores s % 2 (half of them), except in the first `times` runs of
    iteration `collapse_at` (a run is `per_iteration` calls), where every rollout scores 0."""

    def __init__(self, collapse_at: int, times: int, per_iteration: int):
        self.collapse_at, self.times, self.per_iteration = collapse_at, times, per_iteration
        self.trainer = None
        self.calls_at_collapse = 0

    def __call__(self, traj):
        if self.trainer.iteration == self.collapse_at:
            self.calls_at_collapse += 1
            if (self.calls_at_collapse - 1) // self.per_iteration < self.times:
                return Score(0.0, 0.0, 0.0)
        score = float(int(traj.uid.rsplit("#", 1)[1]) % 2)
        return Score(score, score, 0.0)


def collapse_run(tmp_path, peaked_model, tokenizer, times: int, *overrides):
    from conftest import local_engine
    from trainer.run.loop import Trainer

    cfg = small_run(tmp_path, "train.iterations=4", "guard.rollback=true", "guard.warmup_iterations=0",
                    "guard.reward_window=1", "guard.reward_drop=0.5", "guard.lr_decay=0.25",
                    "guard.entropy_max=null", *overrides)  # a random tiny model samples at ~8 nats
    policy = copy.deepcopy(peaked_model)
    engine = local_engine(cfg, policy, tokenizer)
    fake_reward = FakeCollapsingReward(collapse_at=3, times=times, per_iteration=16)
    trainer = Trainer(cfg, engine, tokenizer, tiny_examples(), reward_fn=fake_reward)
    fake_reward.trainer = trainer
    return cfg, trainer


def full_state(trainer) -> dict:
    return copy.deepcopy({**trainer.workers.state(), "cursor": trainer.sampler.cursor(),
                          "rng": torch.get_rng_state(), "guard": trainer.guard.state_dict()})


def test_a_collapse_rolls_back_to_exactly_the_last_good_state_at_a_lower_learning_rate(tmp_path, peaked_model,
                                                                                         tokenizer):
    cfg, trainer = collapse_run(tmp_path, peaked_model, tokenizer, 1, "guard.max_rollbacks=1")
    snapshots, after_rollback = {}, {}

    def watch(iteration, metrics):
        if iteration == 2:  # its checkpoint is the last good state
            snapshots[2] = full_state(trainer)
        if iteration == 3 and not after_rollback:  # called after the guard acted on iteration 3
            after_rollback.update(iteration=trainer.iteration, state=full_state(trainer))

    history = trainer.run(progress=watch)
    assert [m["rollout/reward"] for m in history] == [0.5, 0.5, 0.0, 0.5, 0.5]  # iteration 3 ran twice
    assert after_rollback["iteration"] == 2
    good, restored = snapshots[2], after_rollback["state"]
    lr = cfg.train.lr
    assert good["optimizer"]["param_groups"][0]["lr"] == pytest.approx(lr)
    assert restored["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.25 * lr)
    assert restored["scheduler"]["base_lrs"] == pytest.approx([0.25 * lr])
    for state in (good, restored):  # the rest bit-identical: policy, anchor, AdamW moments, cursor, RNG
        state["optimizer"]["param_groups"][0].pop("lr")
        state["optimizer"]["param_groups"][0].pop("initial_lr")
        state["scheduler"].pop("base_lrs")
        state["scheduler"].pop("_last_lr")
    good["guard"].update(rollbacks=1, lr_scale=0.25)  # the rollback's own ledger outlives the restore
    assert_identical(restored, good, "state")
    assert history[3]["loss/lr"] == pytest.approx(0.25 * lr) and history[3]["guard/rollbacks"] == 1
    events = read_events(cfg.run_dir)
    assert [(e["iteration"], e["action"], e["restored_iteration"], e["lr_scale"]) for e in events] == \
        [(3, "rollback", 2, 0.25)]
    assert "reward_collapse" in events[0]["rules"]
    assert any("| 3 | rollback |" in line for line in events_markdown(cfg.run_dir))


def test_a_collapse_with_no_rollback_left_stops_the_run(tmp_path, peaked_model, tokenizer):
    cfg, trainer = collapse_run(tmp_path, peaked_model, tokenizer, 2, "guard.max_rollbacks=1")
    with pytest.raises(GuardError, match=r"iteration 3: reward .* no rollback left \(1 of guard.max_rollbacks=1"):
        trainer.run()
    assert [e["action"] for e in read_events(cfg.run_dir)] == ["rollback", "stop"]


# ---- two ranks: every rank skips the same step -----------------------------------------------------------------------

def guarded_rank(rank: int, strategy: str, vocab: int, init_file: str, out: str) -> None:
    """One gloo rank (torch.multiprocessing.spawn): the same tiny model and batch on each, a fake NaN advantage in
    one trajectory, so exactly one rank's micro-batch has a non-finite loss."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        cfg = learner_config("train.prompts_per_iteration=4", "train.mini_batch_size=8", "train.warmup_steps=0",
                             f"distributed.strategy={strategy}")
        trainer = PolicyTrainer(cfg, peaked_tiny_model(vocab))  # seeded: the same weights on both ranks
        before = trainer.policy_state()
        fake_advantages = torch.linspace(-1.0, 1.0, 8)
        fake_advantages[5] = NAN
        warnings: list[str] = []  # what each rank says it skipped, and why
        handler = logging.Handler()
        handler.emit = lambda record: warnings.append(record.getMessage())
        logging.getLogger("emapg.guard").addHandler(handler)
        stats = trainer.train_step(collate(ragged_trajectories(vocab, n=8), fake_advantages, pad_id=0), 1)
        after = trainer.policy_state()
        torch.save({"stats": stats, "unchanged": all(torch.equal(after[k], v) for k, v in before.items()),
                    "in_a_row": trainer.learner.step_guard.in_a_row, "warnings": warnings}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_rank_skips_the_step_a_nan_on_one_rank_spoils(tmp_path, tokenizer, strategy):
    import torch.multiprocessing as mp

    mp.spawn(guarded_rank, args=(strategy, len(tokenizer), str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for result in ranks:
        assert result["stats"]["guard_skipped_steps"] == 1 and result["stats"]["optimizer_steps"] == 0
        assert result["unchanged"] and result["in_a_row"] == 1
    # Both name the same micro-batch: the rank whose own losses were finite learned of it from the other.
    assert ranks[0]["warnings"] == ranks[1]["warnings"]
    assert len(ranks[0]["warnings"]) == 1 and "had a non-finite loss" in ranks[0]["warnings"][0]

"""Ray scale-out on a local cluster: 2 rollout workers and 2 learner ranks (gloo; DDP, FSDP2 sharding, and DDP over
LoRA adapters) give the one-process update exactly (FSDP2 with activation checkpointing), hold identical weights,
save and restore their state, and run the training loop (LoRA: the workers get merged weights).

The rollout workers use the transformers engine here (a vLLM engine per actor would take minutes to start on
2 cores; tests/test_vllm_backend.py covers vLLM and its weight sync).
"""

from __future__ import annotations

import pytest
import ray
import torch
from test_learner import grouped_trajectories, ragged_trajectories
from transformers import set_seed

from agent.policy import load_policy
from data.qa import QAExample
from trainer.learner.batch import collate
from trainer.config import load_config
from trainer.run.workers import PolicyTrainer
from trainer.run.loop import Trainer
from trainer.reward import Score


def ray_config(tmp_path, model_dir, *overrides):
    return load_config(overrides=[
        f"out_dir={tmp_path}", f"model={model_dir}", "rollout.backend=transformers", "rollout.mode=direct",
        "rollout.max_tokens_per_turn=4",
        "train.iterations=2", "train.prompts_per_iteration=4", "train.rollouts_per_prompt=2",
        "train.mini_batch_size=8", "train.micro_batch_size=2", "train.lr=1e-5", "train.warmup_steps=0",
        "train.grad_clip=1e9", "kl.topk=4", "kl.beta=0.5", "ema.period=1", "checkpoint.every=100",
        "distributed.backend=ray", "distributed.rollout_workers=2", "distributed.learner_ranks=2", *overrides,
    ])


def parity_reward(traj):
    """A fake reward (unit test): sample s of each group scores s % 2, so every group has variance to learn from."""
    score = float(int(traj.uid.rsplit("#", 1)[1]) % 2)
    return Score(reward=score, em=score, format=0.0)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("variant", ["ddp", "fsdp", "ddp-lora"])
def test_two_ranks_and_two_workers_equal_one_process(local_ray, tiny_model_dir, tokenizer, tmp_path, variant):
    from trainer.run.ray_workers import RayWorkers

    strategy, _, lora = variant.partition("-")
    # FSDP with activation checkpointing (the GPU recipes' setting): the one-process reference checkpoints too.
    checkpointing = f"train.gradient_checkpointing={strategy == 'fsdp'}"
    cfg = ray_config(tmp_path, tiny_model_dir, f"distributed.strategy={strategy}", checkpointing,
                     f"lora.rank={4 if lora else 0}", "lora.alpha=8")
    # Rows that share prefixes (DDP's learner runs those once, FSDP's whole: train.share_prefix) and rows that
    # share none.
    trajectories = grouped_trajectories(len(tokenizer)) + ragged_trajectories(len(tokenizer), n=2)
    advantages = torch.linspace(-1.0, 1.0, 8)
    batch = collate(trajectories, advantages, pad_id=0)

    set_seed(cfg.seed)  # as each rank does before building its PolicyTrainer (LoRA's A is drawn at random)
    single = PolicyTrainer(cfg, load_policy(str(tiny_model_dir)))
    single_stats = single.train_step(collate(trajectories, advantages, pad_id=0), iteration=1)

    examples = [QAExample(f"toy/train/{i}", "toy", "train", f"question {i}?", ("x",), "toy") for i in range(4)]
    engine = RayWorkers(cfg)
    try:
        stats = engine.learn(batch, iteration=1)
        gradients = ray.get([rank.gradients.remote() for rank in engine.ranks])
        states = ray.get([rank.state.remote() for rank in engine.ranks])
        trained = [(name, p) for name, p in single.policy.named_parameters() if p.requires_grad]
        if lora:  # the adapters alone train
            assert 0 < len(trained) < len(list(single.policy.parameters()))
        for name, param in trained:
            for rank_gradients in gradients:  # the ranks' summed gradient = the one-process mini-batch gradient
                torch.testing.assert_close(rank_gradients[name], param.grad, rtol=1e-4, atol=1e-6)
        for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm", "anchor_distance"):
            assert stats[key] == pytest.approx(single_stats[key], rel=1e-4, abs=1e-6), key
        if strategy == "ddp":  # every rank holds the same policy and the same EMA anchor, bit for bit
            for part in ("policy", "anchor"):
                for name, value in states[0][part].items():
                    torch.testing.assert_close(states[1][part][name], value, rtol=0, atol=0)
        else:  # sharded: rank 0 gathers the full state, the others answer empty
            assert states[1]["policy"] == {} and states[1]["anchor"] == {}
        # After one AdamW step: Adam's first step is ~lr x g / |g|, so where a gradient is near 0, summation-order
        # noise moves a weight by a good fraction of lr (measured 1.6e-4 at lr 0.01); lr 1e-5 keeps that under 1e-6.
        for part, reference in (("policy", single.state()["policy"]), ("anchor", single.anchor.state_dict())):
            for name, value in reference.items():
                torch.testing.assert_close(states[0][part][name], value, rtol=1e-4, atol=1e-6)

        # One checkpoint format whatever the sharding: AdamW's moments by parameter position, equal to the
        # one-process ones, and a Ray run's state resumes in one process.
        assert states[0]["optimizer"]["param_groups"] == single.state()["optimizer"]["param_groups"]
        torch.testing.assert_close(states[0]["optimizer"]["state"], single.state()["optimizer"]["state"],
                                   rtol=1e-4, atol=1e-6)
        single.load_state(states[0])  # sharded AdamW runs per tensor (DTensors); the one-process one stays fused
        assert all(group["fused"] for group in single.optimizer.param_groups)
        torch.testing.assert_close(single.state()["optimizer"]["state"], states[0]["optimizer"]["state"], rtol=0,
                                   atol=0)

        engine.load_state(states[0])  # what a resume does: the full state back into every rank
        again = engine.state()
        for part in ("policy", "anchor"):
            for name, value in states[0][part].items():
                torch.testing.assert_close(again[part][name], value, rtol=0, atol=0)

        engine.sync_weights()  # rank 0's weights into both workers' engines
        prompt = tokenizer.encode("who wrote pride and prejudice?")
        probes = ray.get([worker.greedy.remote(prompt, 8) for worker in engine.workers])
        assert probes[0].token_ids == probes[1].token_ids and probes[0].logprobs == probes[1].logprobs
        with torch.no_grad():
            logits = single.policy(torch.tensor([prompt + probes[0].token_ids])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(probes[0].token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(probes[0].logprobs), expected, rtol=0, atol=1e-4)

        # The loop itself: rollouts on the workers, learning on the ranks, sync, logs.
        history = Trainer(cfg, engine, tokenizer, examples, reward_fn=parity_reward).run()
        assert [len(h) > 0 for h in history] == [True, True]
        assert all(m["loss/sampler_trainer_logprob_gap_max"] < 1e-3 for m in history), history
        assert (cfg.run_dir / "metrics.jsonl").read_text().count("\n") == 2
        assert (cfg.run_dir / "checkpoints").is_dir()  # saved at the last iteration from rank 0's state
    finally:
        engine.close()


def test_the_ddp_strategy_on_one_gloo_rank_gives_the_one_process_update(tiny_model, tokenizer):
    """trainer.learner.data_parallel: with torch.distributed initialised the learner takes the DDP strategy (wrapped policy,
    no_sync on all but the last micro-batch, sums over the ranks), and on one rank its prepared values, stats and
    gradient are the one-process learner's; fast, where the Ray tests above cover two ranks."""
    import copy

    import torch.distributed as dist
    from test_learner import make_learner
    from torch.nn.parallel import DistributedDataParallel

    from retriever.process import free_port
    from trainer.learner.data_parallel import DDP, OneProcess

    trajs = ragged_trajectories(len(tokenizer))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    results = []
    for distributed in (False, True):
        if distributed:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        try:
            model = copy.deepcopy(tiny_model)
            torch.manual_seed(0)
            learner = make_learner(model, 2, "token-mean", "k3", "train.grad_probe_every=1")
            assert type(learner.parallel) is (DDP if distributed else OneProcess)
            assert isinstance(learner.policy_logits, DistributedDataParallel) == distributed
            batch = learner.prepare(collate(trajs, advantages, tokenizer.pad_token_id))
            stats = learner.update(batch, torch.Generator().manual_seed(0), iteration=1)
            results.append((batch.old_logprobs, batch.ref_token_logprob, stats,
                            torch.cat([p.grad.flatten() for p in model.parameters()])))
        finally:
            if distributed:
                dist.destroy_process_group()
    (old, ref, stats, grad), (ddp_old, ddp_ref, ddp_stats, ddp_grad) = results
    torch.testing.assert_close(ddp_old, old)
    torch.testing.assert_close(ddp_ref, ref)
    torch.testing.assert_close(ddp_grad, grad, rtol=1e-5, atol=1e-7)
    assert "grad/kl_norm" in stats and "grad/kl_norm" not in ddp_stats  # the probe: one process only
    for key in ("loss", "policy_loss", "kl", "grad_norm"):
        assert ddp_stats[key] == pytest.approx(stats[key], rel=1e-6), key

"""The learner's part of one iteration (`Learner.prepare` + `Learner.update`) for GRPO (k3 KL, fixed anchor), EMA-k3
(k3 KL, EMA anchor), EMA-PG (Top-k KL) and a run with the KL off, with the decoder passes each one runs, counted by
forward hooks on the policy's and the anchor's decoders. On a random Llama of SmolLM2-135M's shape (its 49,152-token
vocabulary, hidden 576, 9 heads / 3 KV heads, MLP 1536; --layers of its 30) over synthetic search-shaped
trajectories (groups of --samples rollouts of one prompt: model turns of varying length alternating with
observations), so no download is needed. The learner is built as trainer.run.workers.PolicyTrainer builds it (EMA anchor,
AdamW, constant schedule). Prints one JSON line.

    python benchmarks/learner_passes.py [--layers 2] [--prompts 2] [--samples 2] [--micro 2] [--prompt-tokens 64]
        [--turns 2] [--turn-tokens 48] [--obs-tokens 64] [--repeats 5] [--commit HASH] [--probe-cost]

Run on two commits (before / after a learner change) it compares them: the JSON carries the commit, the passes, the
median times over --repeats (variants interleaved, so a change in the machine's load hits each alike) and the first
update's loss values from the same weights and batch (the same numbers = the same behaviour). With
--probe-cost, also what the gradient probe (trainer/gradient_probe.py) costs on the iteration it runs: EMA-k3's first
micro-batch's forward + backward with and without it (medians over --repeats, alternated), against the update's time.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from agent.trajectory import Trajectory
from trainer.learner.batch import RolloutBatch, collate
from trainer.config import load_config
from trainer.ema import EmaAnchor
from trainer.gradient_probe import GradientProbe
from trainer.learner.learner import Learner
from trainer.schedule import adamw

ROOT = Path(__file__).resolve().parents[1]
# Each variant's config overrides (configs/cpu_evidence.yaml's three runs, and the KL off).
VARIANTS = {
    "grpo": ["kl.estimator=k3", "ema.tau=1.0"],
    "ema_k3": ["kl.estimator=k3", "ema.tau=0.9"],
    "ema_pg": ["kl.estimator=topk", "ema.tau=0.9"],
    "kl_off": ["kl.estimator=none"],
}
LOSS_KEYS = ("loss", "policy_loss", "kl", "entropy", "grad_norm")


def commit() -> str:
    """HEAD, marked when trainer/ differs from it."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "trainer"], cwd=ROOT, check=False).returncode
    return out.stdout.strip() + (" + uncommitted trainer/ changes" if dirty else "")


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")


def search_batch(args, generator: torch.Generator) -> RolloutBatch:
    """`--samples` rollouts of each of `--prompts` prompts, each turn's length drawn apart, advantages N(0, 1)."""
    def ids(n: int) -> list[int]:
        return torch.randint(0, args.vocab, (n,), generator=generator).tolist()

    trajectories = []
    for prompt in range(args.prompts):
        prompt_ids = ids(args.prompt_tokens)
        for sample in range(args.samples):
            traj = Trajectory(uid=f"p{prompt}#{sample}", group_id=f"p{prompt}", question="q", golden_answers=["a"],
                              prompt_ids=prompt_ids)
            for turn in range(args.turns):
                n = int(torch.randint(args.turn_tokens // 2, args.turn_tokens + 1, (), generator=generator))
                traj.append(ids(n), model=True, logprobs=[-1.0] * n)
                if turn < args.turns - 1:
                    traj.append(ids(args.obs_tokens), model=False)
            trajectories.append(traj)
    return collate(trajectories, torch.randn(len(trajectories), generator=generator), pad_id=0)


def make_learner(policy, cfg) -> Learner:
    """As trainer.run.workers.PolicyTrainer makes it in one process without LoRA."""
    anchor = EmaAnchor(policy)
    with torch.no_grad():  # an anchor a little away from the policy, as after some EMA updates
        for p in anchor.module.parameters():
            p.add_(0.01 * torch.randn_like(p))
    t = cfg.train
    optimizer = adamw(list(policy.parameters()), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Learner(policy, anchor, optimizer, scheduler, t, cfg.kl, cfg.rollout.temperature, cfg.autocast,
                   guard=cfg.guard)


def count_passes(model, counts: Counter, name: str) -> None:
    """Counts every forward pass of `model`'s decoder (a shared-prefix micro-batch runs it twice) under `name`."""
    model.get_decoder().register_forward_hook(lambda *_: counts.update([name]))


def probe_cost(learner: Learner, batch: RolloutBatch, repeats: int) -> dict[str, float]:
    """Median seconds of the first micro-batch's forward + backward without and with the gradient probe."""
    prepared = learner.prepare(batch)
    first = prepared.select(learner.micro_rows(prepared)[0])
    learner.policy.train()
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for probed in (False, True):
            learner.optimizer.zero_grad(set_to_none=True)
            start = time.perf_counter()
            probe = GradientProbe([p for p in learner.policy.parameters() if p.requires_grad]) if probed else None
            learner.micro_loss(first, 1.0, probe)
            if probe is not None:
                probe.finish()
            seconds[probed].append(time.perf_counter() - start)
    learner.optimizer.zero_grad(set_to_none=True)
    without, with_probe = statistics.median(seconds[False]), statistics.median(seconds[True])
    return {"micro_batch_s": round(without, 4), "with_probe_s": round(with_probe, 4),
            "extra_s": round(with_probe - without, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--turn-tokens", type=int, default=48)
    ap.add_argument("--obs-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--commit", default=None, help="the code's commit, when it is not this checkout's HEAD")
    ap.add_argument("--probe-cost", action="store_true", help="time the gradient probe's extra backward")
    args = ap.parse_args()
    args.vocab = 49152
    code = args.commit or commit()  # before the run: the code it runs

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096, tie_word_embeddings=True))
    batch = search_batch(args, torch.Generator().manual_seed(0))
    n = len(batch)
    learners, counts = {}, {}
    for name, overrides in VARIANTS.items():
        cfg = load_config(overrides=[
            f"train.prompts_per_iteration={args.prompts}", f"train.rollouts_per_prompt={args.samples}",
            f"train.mini_batch_size={n}", f"train.micro_batch_size={args.micro}", "train.lr=1e-5", *overrides])
        torch.manual_seed(1)  # the same anchor offset in every variant
        learner = make_learner(copy.deepcopy(base), cfg)
        counts[name] = Counter()
        count_passes(learner.policy, counts[name], "policy")
        count_passes(learner.anchor_logits.model, counts[name], "anchor")
        learners[name] = learner

    times = {name: {"prepare_s": [], "update_s": []} for name in VARIANTS}
    first_stats, passes = {}, {}
    for repeat in range(1 + args.repeats):  # repeat 0 warms up, untimed
        for name, learner in learners.items():
            counts[name].clear()
            t0 = time.perf_counter()
            prepared = learner.prepare(batch)
            t1 = time.perf_counter()
            prepare_passes = dict(counts[name])
            stats = learner.update(prepared, torch.Generator().manual_seed(0))
            t2 = time.perf_counter()
            if repeat == 0:
                first_stats[name] = {k: stats[k] for k in LOSS_KEYS if k in stats}
                passes[name] = {"prepare": prepare_passes,
                                "update": dict(counts[name] - Counter(prepare_passes))}
                continue
            times[name]["prepare_s"].append(t1 - t0)
            times[name]["update_s"].append(t2 - t1)

    result = {}
    if args.probe_cost:
        result["probe_cost"] = probe_cost(learners["ema_k3"], batch, args.repeats)
        result["probe_cost"]["over_update"] = round(
            result["probe_cost"]["extra_s"] / statistics.median(times["ema_k3"]["update_s"]), 4)
    for name in VARIANTS:
        median = {k: statistics.median(v) for k, v in times[name].items()}
        result[name] = {**{k: round(v, 4) for k, v in median.items()},
                        "learner_s": round(median["prepare_s"] + median["update_s"], 4),
                        "passes": passes[name], "first_update": first_stats[name]}
    print(json.dumps({
        "benchmark": "learner_passes", "commit": code, "device_name": cpu_name(),
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "model": {"layers": args.layers, "params": sum(p.numel() for p in base.parameters())},
        "trajectories": n, "micro_batch": args.micro, "tokens": int(batch.attention_mask.sum()),
        "model_tokens": int(batch.loss_mask.sum()), "repeats": args.repeats, **result,
    }))


if __name__ == "__main__":
    main()

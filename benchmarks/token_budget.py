"""Micro-batches of a fixed number of rows (`train.micro_batch_size`, today's) against micro-batches cut to a token
budget (`train.micro_batch_tokens`), on one synthetic batch shaped like the paper's search trajectories, in one run.
Prints one JSON line.

    python benchmarks/token_budget.py [--layers 2] [--prompts 8] [--samples 5] [--micro 8] [--scale 1.0]
        [--repeats 3] [--estimator topk] [--no-share-prefix] [--budget N] [--commit HASH]

The batch: --prompts prompts of ~150 tokens (130-170), --samples rollouts of each; a rollout makes 1-4 searches,
each a model turn of 50-500 tokens then an observation of 3 documents of 100-150 tokens, and ends with a model turn
of 50-500 tokens (the answer). --scale multiplies every length (a quick run on a CPU). The model: a random Llama of
SmolLM2-135M's shape (its 49,152-token vocabulary, hidden 576, 9 heads / 3 KV heads, MLP 1536; --layers of its 30),
built without downloads as benchmarks/learner_passes.py builds it, the learner as trainer.run.workers.PolicyTrainer
builds it (EMA anchor, AdamW), one mini-batch of the whole batch.

Per variant: the padding share (padded tokens over all the tokens the decoder runs, `pass_tokens` over the
micro-batches of prepare; the policy decoder's first layer is hooked to check that count), micro-batches and their
mean and largest tokens, and the learner's tokens/s: the batch's real tokens over the median of prepare + update
seconds, the variants interleaved (alternating which goes first) over --repeats after one untimed warm-up. The budget
(unless --budget) is the one whose micro-batches average closest to the row-count ones' mean pass, so both run about
the same tokens per pass. The first update's losses of both (the same weights and batch) show that the
gradient is the same.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from learner_passes import commit, cpu_name, make_learner  # noqa: E402
from shared_prefix import TokenRows  # noqa: E402

from agent.trajectory import Trajectory  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.learner.batch import RolloutBatch, collate, pass_tokens  # noqa: E402

LOSS_KEYS = ("loss", "policy_loss", "kl", "entropy", "grad_norm")


def search_batch(args, generator: torch.Generator) -> RolloutBatch:
    """--samples rollouts of each of --prompts prompts, shaped like the paper's (module docstring); advantages N(0, 1)."""
    def between(lo: int, hi: int) -> int:
        return int(torch.randint(max(1, round(lo * args.scale)), max(1, round(hi * args.scale)) + 1, (),
                                 generator=generator))

    def ids(n: int) -> list[int]:
        return torch.randint(0, args.vocab, (n,), generator=generator).tolist()

    trajectories = []
    for prompt in range(args.prompts):
        prompt_ids = ids(between(130, 170))
        for sample in range(args.samples):
            traj = Trajectory(uid=f"p{prompt}#{sample}", group_id=f"p{prompt}", question="q", golden_answers=["a"],
                              prompt_ids=prompt_ids)
            for _ in range(int(torch.randint(1, 5, (), generator=generator))):  # searches: not scaled
                turn = ids(between(50, 500))
                traj.append(turn, model=True, logprobs=[-1.0] * len(turn))
                traj.append([t for _ in range(3) for t in ids(between(100, 150))], model=False)
            answer = ids(between(50, 500))
            traj.append(answer, model=True, logprobs=[-1.0] * len(answer))
            trajectories.append(traj)
    return collate(trajectories, torch.randn(len(trajectories), generator=generator), pad_id=0)


def micro_batch_tokens(batch: RolloutBatch, runs, share_prefix: bool) -> list[tuple[int, int]]:
    return [pass_tokens(batch.select(rows), share_prefix) for rows in runs]


def summary(passes: list[tuple[int, int]]) -> dict:
    tokens = [t for t, _ in passes]
    return {"micro_batches": len(passes), "decoder_tokens": sum(tokens),
            "padded_tokens": sum(p for _, p in passes),
            "padding_share": round(sum(p for _, p in passes) / sum(tokens), 4),
            "mean_micro_batch_tokens": round(sum(tokens) / len(tokens), 1), "max_micro_batch_tokens": max(tokens)}


def calibrated_budget(learner, batch: RolloutBatch, target: float, share_prefix: bool) -> int:
    """The budget whose micro-batches (as the learner cuts them) average closest to `target` tokens: 0.8x to 3x the
    target in steps of 1% (a budget bounds a pass, so they average less than it)."""
    best = (float("inf"), 0)
    for percent in range(80, 301):
        budget = max(1, int(target * percent / 100))
        learner.train.micro_batch_tokens = budget
        passes = micro_batch_tokens(batch, learner.micro_rows(batch), share_prefix)
        best = min(best, (abs(sum(t for t, _ in passes) / len(passes) - target), budget))
    return best[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--micro", type=int, default=8, help="rows per micro-batch of the row-count variant")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every length of the trajectory mix")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--estimator", default="topk", help="kl.estimator of both learners")
    ap.add_argument("--no-share-prefix", action="store_true", help="train.share_prefix=false in both")
    ap.add_argument("--budget", type=int, default=None, help="the token budget (default: calibrated, see above)")
    ap.add_argument("--commit", default=None, help="the code's commit, when it is not this checkout's HEAD")
    args = ap.parse_args()
    args.vocab = 49152
    code = args.commit or commit()
    share = not args.no_share_prefix

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=16384, tie_word_embeddings=True))
    base.eval()
    batch = search_batch(args, torch.Generator().manual_seed(0))
    n = len(batch)

    def config(*overrides):
        return load_config(overrides=[
            f"train.prompts_per_iteration={args.prompts}", f"train.rollouts_per_prompt={args.samples}",
            f"train.mini_batch_size={n}", f"train.micro_batch_size={args.micro}", "train.lr=1e-5",
            f"train.share_prefix={share}", f"kl.estimator={args.estimator}", "ema.tau=0.9", *overrides])

    learners, counters = {}, {}
    for name in ("rows", "tokens"):
        torch.manual_seed(1)  # the same anchor offset in both
        learners[name] = make_learner(copy.deepcopy(base), config())
        counters[name] = TokenRows(learners[name].policy)
    row_passes = micro_batch_tokens(batch, learners["rows"].micro_rows(batch), share)
    row_mean = sum(t for t, _ in row_passes) / len(row_passes)
    budget = args.budget or calibrated_budget(learners["tokens"], batch, row_mean, share)
    learners["tokens"].train.micro_batch_tokens = budget
    passes = {"rows": row_passes, "tokens": micro_batch_tokens(batch, learners["tokens"].micro_rows(batch), share)}

    real_tokens = int(batch.attention_mask.sum())
    times = {name: [] for name in learners}
    first, prepare_rows = {}, {}
    for repeat in range(1 + args.repeats):  # repeat 0 warms up, untimed
        names = list(learners) if repeat % 2 else list(reversed(learners))
        for name in names:
            learner = learners[name]
            before = counters[name].rows
            t0 = time.perf_counter()
            prepared = learner.prepare(batch)
            t1 = time.perf_counter()
            prepare_rows[name] = counters[name].rows - before
            stats = learner.update(prepared, torch.Generator().manual_seed(0))
            t2 = time.perf_counter()
            if repeat == 0:  # both from the same weights and batch
                first[name] = {k: stats[k] for k in LOSS_KEYS if k in stats}
            else:
                times[name].append(t2 - t0)

    result = {}
    for name in learners:
        median = statistics.median(times[name])
        result[name] = {**summary(passes[name]), "prepare_policy_decoder_tokens_hooked": prepare_rows[name],
                        "learner_s": round(median, 3), "tokens_per_s": round(real_tokens / median, 1),
                        "learner_s_each": [round(t, 3) for t in times[name]], "first_update": first[name]}
    rows, tokens = result["rows"], result["tokens"]
    print(json.dumps({
        "benchmark": "token_budget", "commit": code, "device_name": cpu_name(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "model": {"layers": args.layers, "params": sum(p.numel() for p in base.parameters())},
        "estimator": args.estimator, "share_prefix": share, "scale": args.scale, "trajectories": n,
        "prompt_width": batch.prompt_width, "row_tokens": {"min": int(batch.attention_mask.sum(1).min()),
                                                         "max": int(batch.attention_mask.sum(1).max())},
        "real_tokens": real_tokens, "model_tokens": int(batch.loss_mask.sum()), "repeats": args.repeats,
        "micro_batch_size": args.micro, "micro_batch_tokens": budget, "rows": rows, "tokens": tokens,
        "tokens_over_rows": {"padding_share": round(tokens["padding_share"] / rows["padding_share"], 3),
                             "decoder_tokens": round(tokens["decoder_tokens"] / rows["decoder_tokens"], 3),
                             "tokens_per_s": round(tokens["tokens_per_s"] / rows["tokens_per_s"], 3)},
        "first_update_largest_difference": max(abs(rows["first_update"][k] - tokens["first_update"][k])
                                               for k in rows["first_update"]),
    }))


if __name__ == "__main__":
    main()

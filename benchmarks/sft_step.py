"""One SFT step (forward + backward over a batch of demonstrations) two ways, in one run:

    padded:  micro-batches in batch order, every one padded to the batch's longest response, LM head at every
             response position (then masked)
    trimmed: micro-batches of length-sorted rows, each cut to its own longest response, LM head only at the
             model-token positions (what trainer/run/sft.py does)

Both compute the same loss (checked). Needs demonstrations: `make demo` or `emapg sft` writes them.

    python benchmarks/sft_step.py [--demos artifacts/runs/cpu-demo/sft/demonstrations.jsonl] [--batch 8 --micro 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch

from agent.policy import load_policy, load_tokenizer
from agent.trajectory import load_jsonl
from trainer.learner.batch import RolloutBatch, collate
from trainer.learner.logprobs import autocast, response_logits
from trainer.learner.learner import micro_batch_shares, micro_batches
from trainer.run.sft import sft_loss


def rows_uncut(batch: RolloutBatch, rows: torch.Tensor) -> RolloutBatch:
    """The rows at the full batch width (no trimming): the old way."""
    return RolloutBatch(**{f.name: (v[rows] if isinstance(v := getattr(batch, f.name), torch.Tensor) else v)
                           for f in fields(batch)})


def step(model, batch: RolloutBatch, micro: int, variant: str, precision: str) -> tuple[float, float]:
    model.zero_grad(set_to_none=True)
    order = torch.arange(len(batch)) if variant == "padded" else batch.response_lengths().argsort()
    micro_rows = micro_batches(order, micro)
    start, total = time.perf_counter(), 0.0
    for rows, share in zip(micro_rows, micro_batch_shares(batch.loss_mask, micro_rows), strict=True):
        if variant == "padded":
            mb = rows_uncut(batch, rows)
            with autocast(precision, model):
                logits = response_logits(model, mb)
            loss = sft_loss(logits[mb.loss_mask], mb.response_ids[mb.loss_mask])
        else:
            mb = batch.select(rows)
            with autocast(precision, model):
                logits = response_logits(model, mb, only=mb.loss_mask)
            loss = sft_loss(logits, mb.response_ids[mb.loss_mask])
        (loss * share).backward()
        total += float(loss.detach()) * share
    return time.perf_counter() - start, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--demos", type=Path, default=Path("artifacts/runs/cpu-demo/sft/demonstrations.jsonl"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--autocast", default="bfloat16", choices=["none", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not args.demos.is_file():
        sys.exit(f"{args.demos} not found: run `make demo` or `emapg sft` first")
    demos = list(load_jsonl(args.demos))[: args.batch]
    tokenizer = load_tokenizer()
    model = load_policy(device="cpu").train()  # the CPU measurement; its batches are built on the CPU
    batch = collate(demos, torch.zeros(len(demos)), tokenizer.pad_token_id)
    results = {}
    for variant in ("padded", "trimmed"):
        runs = [step(model, batch, args.micro, variant, args.autocast) for _ in range(args.repeats)]
        results[variant] = {"best_s": round(min(t for t, _ in runs), 2), "loss": round(runs[0][1], 5)}
    assert abs(results["padded"]["loss"] - results["trimmed"]["loss"]) < 1e-2, results  # bf16: not bit-equal
    print(json.dumps({
        "benchmark": "sft_step", "model": "smollm2-135m-instruct", "autocast": args.autocast,
        "demonstrations": len(demos), "micro_batch": args.micro,
        "tokens": int(batch.attention_mask.sum()), "model_tokens": int(batch.loss_mask.sum()),
        "padded_positions": int(batch.input_ids.numel()), **results,
        "trimmed_over_padded": round(results["trimmed"]["best_s"] / results["padded"]["best_s"], 3),
    }))


if __name__ == "__main__":
    main()

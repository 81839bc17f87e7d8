"""The held-out evaluation on vLLM, laid out in different ways, in one run on one engine: per set (each set its own
continuous run, rollout.max_in_flight trajectories in flight, so each set ends on a tail of a few long trajectories)
against the sets pooled into one continuous run (eval.harness.evaluate's way since e8ed015, 2026-12-02), and more
trajectories in flight. Prints one JSON line.

    python benchmarks/eval_concurrency.py --init artifacts/runs/cpu-demo/sft \
        --index artifacts/indexes/wiki-minilm-flat [--config configs/cpu_compare.yaml] \
        [--variants per-set:32 pooled:32 pooled:64] [--kv-cache-gib 2]

A variant is `per-set:N` or `pooled:N` (N trajectories in flight at most). Every variant starts from the same SFT
weights with an empty prefix cache (the weights are reloaded, which empties it) and a freshly started retrieval
server (its result cache would otherwise answer a later variant's searches for free). The engine's KV cache is
sized once, for the widest variant (`--kv-cache-gib`): a variant's own width, not the cache, bounds its batch.
Reported per variant: seconds, EM over all sets, and how many trajectories are token for token the first variant's
(greedy decoding on a batch of another size may round differently).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the one JSON line

ROOT = Path(__file__).resolve().parents[1]


def parse_variant(text: str) -> tuple[str, int]:
    layout, _, width = text.partition(":")
    if layout not in ("per-set", "pooled") or not width.isdigit() or int(width) < 1:
        raise argparse.ArgumentTypeError(f"a variant is per-set:N or pooled:N with N >= 1, got {text!r}")
    return layout, int(width)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", type=Path, required=True, help="SFT checkpoint or run folder (the demo's sft/)")
    ap.add_argument("--index", type=Path, default=Path("artifacts/indexes/wiki-minilm-flat"))
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu_compare.yaml")
    ap.add_argument("--variants", type=parse_variant, nargs="+",
                    default=[("per-set", 32), ("pooled", 32), ("pooled", 64)])
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--scan-limit", type=int, default=1000)
    args = ap.parse_args()

    from transformers import set_seed

    from agent.factory import make_agent, open_backend
    from agent.policy import load_policy, load_tokenizer
    from emapg.session import connect_retriever
    from emapg.workflow import eval_examples
    from eval.harness import model_text, run_mode, run_pooled, score
    from trainer.run.checkpoint import load_policy_weights
    from trainer.config import load_config

    cfg = load_config(args.config, [f"data.scan_limit={args.scan_limit}", f"retriever.index={args.index}",
                                    "rollout.backend=vllm", f"rollout.kv_cache_gib={args.kv_cache_gib}"])
    set_seed(cfg.seed)
    result: dict = {"benchmark": "eval_concurrency", "config": str(args.config), "init": str(args.init),
                    "kv_cache_gib": args.kv_cache_gib, "variants": {}}
    with contextlib.redirect_stdout(sys.stderr):
        with connect_retriever(cfg) as (client, tag):
            held_out = eval_examples(cfg, client, tag)
        result["held_out_questions"] = {name: len(examples) for name, examples in held_out.items()}
        tokenizer = load_tokenizer(cfg.model)
        policy = load_policy(cfg.model, dtype=cfg.dtype)
        policy.load_state_dict(load_policy_weights(args.init))
        backend = open_backend(cfg.rollout, cfg.model, tokenizer, policy, dtype=cfg.dtype, seed=cfg.seed)
        first_ids = None
        try:
            for layout, width in args.variants:
                with connect_retriever(cfg) as (client, _):  # a fresh server: a cold result cache
                    backend.load_weights(policy.named_parameters())  # same weights; empties the prefix cache
                    agent = make_agent(backend, tokenizer, client, cfg.rollout.model_copy(update={"max_in_flight": width}),
                                       retriever_timeout_s=cfg.retriever.timeout_s)
                    start = time.perf_counter()
                    if layout == "pooled":
                        trajectories = list(run_pooled(agent, held_out).values())
                    else:
                        trajectories = [run_mode(agent, examples) for examples in held_out.values()]
                    seconds = time.perf_counter() - start
                flat = [t for per_set in trajectories for t in per_set]
                results = [score(ts, name, "agent", seconds, [model_text(tokenizer, t) for t in ts])
                           for name, ts in zip(held_out, trajectories, strict=True)]
                ids = [t.response_ids for t in flat]
                first_ids = first_ids or ids
                result["variants"][f"{layout}:{width}"] = {
                    "seconds": round(seconds, 1), "em": round(sum(r.em * r.n for r in results) / len(flat), 3),
                    "token_identical_to_first": sum(a == b for a, b in zip(first_ids, ids, strict=True))}
                print(f"{layout}:{width}: {seconds:.1f} s", flush=True)
        finally:
            backend.close()
    first = next(iter(result["variants"].values()))["seconds"]
    for variant in result["variants"].values():
        variant["over_first"] = round(variant["seconds"] / first, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

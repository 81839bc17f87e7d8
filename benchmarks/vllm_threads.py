"""vLLM's CPU worker on the cores vLLM's automatic binding gives it against the worker on every core this process may
use, in one run. On a 2-core machine the automatic binding (`VLLM_CPU_OMP_THREADS_BIND=auto`) keeps one core for the
EngineCore process, which polls the worker while it computes, and leaves the worker one thread on the other.

Each binding runs in a subprocess of its own (the binding is read when the engine starts), on the same prompts: the
held-out evaluation's first turn (the agent prompt of NQ-test questions, greedy, stop at </search> or </answer>), all
in flight at once as in the continuous scheduler, after one warm-up request; then the same prompts sampled as in a
rollout (temperature 1, seeded). Prints one JSON line: greedy generated tokens per second per binding (best of
--rounds), their ratio, whether the two bindings generated the same greedy and sampled tokens, and the largest
difference between their sampled tokens' log-probs.

    python benchmarks/vllm_threads.py [--prompts 64] [--max-tokens 128] [--rounds 2] [--checkpoint <an SFT run>]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the one JSON line

ROOT = Path(__file__).resolve().parents[1]


def all_cores() -> str:
    """This process's CPUs as a vLLM CPU list ("0,1")."""
    return ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))


def generate(args) -> dict:
    """One binding (this subprocess's VLLM_CPU_OMP_THREADS_BIND): its timed rounds and the tokens generated."""
    from agent.backend import SamplingParams
    from agent.policy import load_tokenizer, resolve_policy
    from agent.protocol import ANSWER_STOP, SEARCH_STOP, prompt_ids, prompt_text
    from agent.vllm_backend import VLLMBackend
    from data.qa import load_packaged

    tokenizer = load_tokenizer()
    prompts = [prompt_ids(tokenizer, prompt_text(ex.question)) for ex in load_packaged("nq", "test")[: args.prompts]]
    backend = VLLMBackend(resolve_policy("smollm2-135m-instruct"), max_model_len=4096)
    try:
        if args.checkpoint is not None:  # synced in place, as in training
            from agent.policy import load_policy
            from trainer.run.checkpoint import load_policy_weights

            policy = load_policy()
            policy.load_state_dict(load_policy_weights(args.checkpoint))
            backend.load_weights(policy.named_parameters())
            del policy
        stops = [SEARCH_STOP, ANSWER_STOP]
        greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        backend.generate(prompts[:1], greedy, stops)  # warm-up
        seconds = []
        for _ in range(args.rounds):
            backend.run(backend.engine.reset_prefix_cache())  # every round computes every prompt anew
            start = time.perf_counter()
            generations = backend.generate(prompts, greedy, stops)
            seconds.append(time.perf_counter() - start)
        # A rollout's sampling (temperature 1, seeded per row): the same draws need the same logits.
        sampled = backend.generate(prompts, SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=0), stops)
    finally:
        backend.close()
    tokens = [g.token_ids for g in generations]
    return {"seconds": [round(s, 2) for s in seconds], "generated_tokens": sum(map(len, tokens)), "tokens": tokens,
            "sampled_tokens": [g.token_ids for g in sampled], "sampled_logprobs": [g.logprobs for g in sampled]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--checkpoint", type=Path, default=None, help="policy weights (e.g. an SFT run folder)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(generate(args)))
        return
    bindings = {"auto": "auto", "all_cores": all_cores()}
    runs = {}
    for name, binding in bindings.items():
        out = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], cwd=ROOT, check=True,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": binding}).stdout
        runs[name] = json.loads(out.strip().splitlines()[-1])
    result = {"benchmark": "vllm_threads", "prompts": args.prompts, "max_tokens": args.max_tokens,
              "checkpoint": str(args.checkpoint) if args.checkpoint else None, "cpus": os.cpu_count(),
              "bindings": bindings}
    for name, run in runs.items():
        best = min(run["seconds"])
        result[name] = {"seconds": run["seconds"], "generated_tokens": run["generated_tokens"],
                        "tokens_per_s": round(run["generated_tokens"] / best, 1)}
    result["all_cores_over_auto_tokens_per_s"] = round(
        result["all_cores"]["tokens_per_s"] / result["auto"]["tokens_per_s"], 2)
    auto, every = runs["auto"], runs["all_cores"]
    result["same_greedy_tokens"] = auto["tokens"] == every["tokens"]
    result["same_sampled_tokens"] = auto["sampled_tokens"] == every["sampled_tokens"]
    if result["same_sampled_tokens"]:
        result["sampled_logprob_max_difference"] = max(
            (abs(a - b) for row_a, row_b in zip(auto["sampled_logprobs"], every["sampled_logprobs"], strict=True)
             for a, b in zip(row_a, row_b, strict=True)), default=0.0)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

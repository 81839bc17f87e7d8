"""KL estimators in the loss: time and peak memory of (loss + backward) for exact, Top-k (k = 32) and k3 at
Qwen's and SmolLM2's vocabulary sizes, 2,048 tokens; and the EMA anchor update against an optimizer step.
Prints one JSON line.

Memory is the peak above what the inputs already hold (the policy's fp32 logits with their gradient, and what
each estimator needs from the anchor: full logits for exact, k + 1 log-probs per token for Top-k, one for k3).
On CPU each measurement runs in its own process: the kernel's RSS high-water mark is reset (clear_refs) after
the inputs are built, and the peak above the RSS at that point is read back (VmHWM); on CUDA,
max_memory_allocated above the allocated memory before the step.

    python benchmarks/kl.py [--device cuda] [--tokens 2048] [--vocab 49152 151936]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from trainer.kl import exact_kl, gather_logprobs, sampled_kl, topk_kl

K = 32


def inputs(variant: str, tokens: int, vocab: int, device: str) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = torch.randn(1, tokens, vocab, generator=g).to(device).requires_grad_(True)
    sampled = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    x = {"logits": logits, "tokens": sampled}
    with torch.no_grad():
        ref_logits = logits + 0.1 * torch.randn(1, tokens, vocab, generator=g).to(device)
        x["ref_token_logprob"] = gather_logprobs(ref_logits, sampled[..., None])[..., 0]
        if variant == "exact":
            x["ref_logits"] = ref_logits
        elif variant == "topk":
            x["topk_ids"] = logits.topk(K, dim=-1).indices
            x["ref_topk_logprobs"] = gather_logprobs(ref_logits, x["topk_ids"])
        del ref_logits
    return x


def loss(variant: str, x: dict) -> torch.Tensor:
    if variant == "exact":
        return exact_kl(x["logits"], x["ref_logits"], "reverse").mean()
    if variant == "topk":
        return topk_kl(x["logits"], x["ref_topk_logprobs"], x["ref_token_logprob"], x["topk_ids"], x["tokens"],
                       direction="reverse").mean()
    logprob = gather_logprobs(x["logits"], x["tokens"][..., None])[..., 0]
    return sampled_kl(logprob, x["ref_token_logprob"], "k3").mean()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak(device: str) -> int:
    """Start a new peak window; returns the memory in use now (the window's base)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset the RSS high-water mark (VmHWM) to the current RSS
    return _status_kib("VmRSS") * 1024


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return _status_kib("VmHWM") * 1024


def measure_one(variant: str, tokens: int, vocab: int, device: str, repeats: int) -> dict:
    x = inputs(variant, tokens, vocab, device)
    loss(variant, x).backward()  # warm-up
    x["logits"].grad = None
    base = reset_peak(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        loss(variant, x).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        x["logits"].grad = None
    return {"seconds": min(times), "peak_bytes": peak_bytes(device) - base}


def ema_vs_optimizer(device: str) -> dict:
    """The EMA update of a SmolLM2-135M-shaped model against its AdamW step and a full train step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.ema import EmaAnchor

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(device)
    anchor = EmaAnchor(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(0, 49152, (2, 256), device=device)

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(3):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    def train_step() -> None:
        optimizer.zero_grad()
        model(ids, labels=ids).loss.backward()
        optimizer.step()

    train_s = timed(train_step)
    step_s = timed(optimizer.step)
    ema_s = timed(lambda: anchor.update(model, 0.9))
    return {"params": sum(p.numel() for p in model.parameters()), "ema_update_s": round(ema_s, 4),
            "adamw_step_s": round(step_s, 4), "train_step_s_2x256_tokens": round(train_s, 3),
            "ema_over_adamw_step": round(ema_s / step_s, 3), "ema_over_train_step": round(ema_s / train_s, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", nargs=2, metavar=("VARIANT", "VOCAB"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # child process: one measurement, its own peak RSS
        print(json.dumps(measure_one(args.one[0], args.tokens, int(args.one[1]), args.device, args.repeats)))
        return
    results = {}
    for vocab in args.vocab:
        row = {}
        for variant in ("k3", "topk", "exact"):
            cmd = [sys.executable, __file__, "--one", variant, str(vocab), "--tokens", str(args.tokens),
                   "--device", args.device, "--repeats", str(args.repeats)]
            row[variant] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        extra_topk = row["topk"]["peak_bytes"] - row["k3"]["peak_bytes"]
        extra_exact = row["exact"]["peak_bytes"] - row["k3"]["peak_bytes"]
        results[str(vocab)] = {
            **{v: {"seconds": round(r["seconds"], 4), "peak_mb": round(r["peak_bytes"] / 2**20, 1)} for v, r in row.items()},
            "topk_extra_memory_over_exact_extra": round(extra_topk / extra_exact, 4) if extra_exact > 0 else None,
            "topk_time_over_k3": round(row["topk"]["seconds"] / row["k3"]["seconds"], 3),
            "exact_time_over_k3": round(row["exact"]["seconds"] / row["k3"]["seconds"], 3),
        }
    print(json.dumps({"benchmark": "kl", "device": args.device, "tokens": args.tokens, "k": K,
                      "by_vocab": results, "ema": ema_vs_optimizer(args.device)}))


if __name__ == "__main__":
    main()

"""KL estimators in the loss: time and peak memory of (LM head + loss + backward) for exact, Top-k (k = 32) and k3
at Qwen's and SmolLM2's vocabulary sizes, 2,048 tokens, each with the whole logits at once (unchunked, as before
chunking) and chunked (`train.logprob_chunk_tokens`, trainer/learner/logprobs.py); and the EMA anchor update against an
optimizer step. Prints one JSON line.

The inputs are what the learner has before its head: the final hidden states (tokens x hidden, with gradient) and the
head weight (V x hidden, with gradient, as a tied embedding is trained), plus what each estimator needs from the
anchor: its hidden states and head for exact, k + 1 log-probs per token for Top-k, one for k3. Memory is the peak
above those inputs and their gradient buffers (kept between repeats, as gradient accumulation keeps them). Each
estimator runs in its own process, its unchunked and chunked paths alternating (best time, highest peak of each):
on CPU the kernel's RSS high-water mark is reset (clear_refs) before each pass and the peak above the RSS at that
point read back (VmHWM); on CUDA, max_memory_allocated above the allocated memory before the pass.

    python benchmarks/kl.py [--device cuda] [--tokens 2048] [--vocab 49152 151936] [--hidden 576] [--chunk 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from trainer.kl import sampled_kl, topk_kl_from_logprobs
from trainer.learner.logprobs import token_logprobs

K = 32
ESTIMATORS = ("k3", "topk", "exact")


def inputs(estimator: str, tokens: int, vocab: int, hidden: int, device: str) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():  # logits of a few units' spread, like a trained model's
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) / hidden**0.5)
    head = head.to(device)
    states = torch.randn(tokens, hidden, generator=g).to(device).requires_grad_(True)
    sampled = torch.randint(0, vocab, (tokens, 1), generator=g).to(device)
    ref_head = torch.nn.Linear(hidden, vocab, bias=False).to(device).requires_grad_(False)
    with torch.no_grad():
        ref_head.weight.copy_(head.weight + 0.1 * torch.randn(vocab, hidden, generator=g).to(device) / hidden**0.5)
        top = token_logprobs(states, head, sampled, topk=K, chunk_tokens=256).topk_ids
        ref = token_logprobs(states, ref_head, torch.cat([top, sampled], -1), chunk_tokens=256).logprobs
    x = {"hidden": states, "head": head, "tokens": sampled, "ref_token_logprob": ref[:, -1]}
    if estimator == "exact":
        x["reference"] = (states.detach().clone(), ref_head)
    elif estimator == "topk":
        x["topk_ids"], x["ref_topk_logprobs"] = top, ref[:, :-1]
    return x


def loss(estimator: str, x: dict, chunk: int) -> torch.Tensor:
    if estimator == "exact":
        out = token_logprobs(x["hidden"], x["head"], x["tokens"], chunk_tokens=chunk, reference=x["reference"])
        return out.kl.mean()
    if estimator == "topk":
        ids = torch.cat([x["topk_ids"], x["tokens"]], -1)
        logprobs = token_logprobs(x["hidden"], x["head"], ids, chunk_tokens=chunk).logprobs
        return topk_kl_from_logprobs(logprobs[:, :-1], logprobs[:, -1], x["ref_topk_logprobs"], x["ref_token_logprob"],
                                     x["topk_ids"], x["tokens"][:, 0], direction="reverse").mean()
    logprob = token_logprobs(x["hidden"], x["head"], x["tokens"], chunk_tokens=chunk).logprobs[:, 0]
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


def measure_one(estimator: str, chunk: int, tokens: int, vocab: int, hidden: int, device: str, repeats: int) -> dict:
    """The unchunked and the chunked path of one estimator in one process, alternating (load that drifts during the
    run hits both alike): best time and peak memory of each."""
    x = inputs(estimator, tokens, vocab, hidden, device)
    params = [x["hidden"], x["head"].weight]
    paths = {"unchunked": 0, "chunked": chunk}
    for size in paths.values():  # warm-up; allocates the gradient buffers, kept (zeroed) from here on
        loss(estimator, x, size).backward()
    results = {name: {"seconds": float("inf"), "peak_bytes": 0} for name in paths}
    for _ in range(repeats):
        for name, size in paths.items():
            for p in params:
                p.grad.zero_()
            base = reset_peak(device)
            start = time.perf_counter()
            loss(estimator, x, size).backward()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            result = results[name]
            result["seconds"] = min(result["seconds"], seconds)
            result["peak_bytes"] = max(result["peak_bytes"], peak_bytes(device) - base)
    return results


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
    ap.add_argument("--hidden", type=int, default=576, help="the head's input width (SmolLM2-135M's by default)")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per chunk on the chunked path")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-ema", action="store_true", help="skip the EMA-update measurement")
    ap.add_argument("--one", nargs=2, metavar=("ESTIMATOR", "VOCAB"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # child process: one estimator, its own memory
        estimator, vocab = args.one[0], int(args.one[1])
        print(json.dumps(measure_one(estimator, args.chunk, args.tokens, vocab, args.hidden, args.device,
                                     args.repeats)))
        return
    results = {}
    for vocab in args.vocab:
        row = {}
        for estimator in ESTIMATORS:
            cmd = [sys.executable, __file__, "--one", estimator, str(vocab), "--tokens", str(args.tokens),
                   "--hidden", str(args.hidden), "--chunk", str(args.chunk), "--device", args.device,
                   "--repeats", str(args.repeats)]
            both = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
            row[estimator], row[f"{estimator}_chunked"] = both["unchunked"], both["chunked"]
        k3, topk, chunked = row["k3"], row["topk"], row["topk_chunked"]
        extra_topk = topk["peak_bytes"] - k3["peak_bytes"]
        extra_exact = row["exact"]["peak_bytes"] - k3["peak_bytes"]
        results[str(vocab)] = {
            **{v: {"seconds": round(r["seconds"], 4), "peak_mb": round(r["peak_bytes"] / 2**20, 1)}
               for v, r in row.items()},
            "topk_extra_memory_over_exact_extra": round(extra_topk / extra_exact, 4) if extra_exact > 0 else None,
            "topk_time_over_k3": round(topk["seconds"] / k3["seconds"], 3),
            "exact_time_over_k3": round(row["exact"]["seconds"] / k3["seconds"], 3),
            "topk_chunked_peak_over_k3_peak": round(chunked["peak_bytes"] / k3["peak_bytes"], 4),
            "topk_chunked_time_over_topk": round(chunked["seconds"] / topk["seconds"], 3),
            "topk_chunked_time_over_k3": round(chunked["seconds"] / k3["seconds"], 3),
        }
    print(json.dumps({"benchmark": "kl", "device": args.device, "tokens": args.tokens, "hidden": args.hidden, "k": K,
                      "chunk_tokens": args.chunk, "by_vocab": results,
                      **({} if args.no_ema else {"ema": ema_vs_optimizer(args.device)})}))


if __name__ == "__main__":
    main()

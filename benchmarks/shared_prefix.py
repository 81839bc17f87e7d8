"""The learner with and without shared-prefix passes (`train.share_prefix`), on the same real rollout batches, in one
run. Prints one JSON line.

    python benchmarks/shared_prefix.py --init <SFT checkpoint or run folder> \
        [--index artifacts/indexes/wiki-minilm-flat] [--config configs/cpu_evidence.yaml] [--iterations 3]

Training runs as `emapg train` would from the SFT weights (vLLM rollouts through the real retriever, rewards,
advantages) with two learners side by side from the same weights: every collated batch goes to both, in alternating
order, so each iteration times both on the same trajectories under the same load. The run's policy is the sharing
learner's (its weights feed the engine); the other trains on the same batches, so the two stay the same policy up
to float rounding, which the weight difference at the end shows. Per learner: median prepare (pi_old and anchor
passes) and update (AdamW steps) seconds, and the token rows the decoder ran (counted at its first layer), with
the ratios; and the largest difference of the update's logged statistics between the two.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from iteration import cpu_kind  # noqa: E402

COMPARED = ["loss", "policy_loss", "kl", "entropy", "grad_norm", "sampler_trainer_logprob_gap_mean"]


class TokenRows:
    """Counts the token rows (batch x columns) entering a decoder's first layer: what every layer computes on."""

    def __init__(self, model):
        self.rows = 0
        model.get_decoder().layers[0].register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.rows += hidden.shape[0] * hidden.shape[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", type=Path, required=True, help="SFT checkpoint or run folder")
    ap.add_argument("--index", type=Path, default=Path("artifacts/indexes/wiki-minilm-flat"))
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu_evidence.yaml")
    ap.add_argument("--iterations", type=int, default=3)
    args = ap.parse_args()

    import torch
    from transformers import set_seed

    from agent.factory import make_agent, open_backend
    from agent.policy import load_policy, load_tokenizer
    from emapg.session import connect_retriever
    from emapg.workflow import train_examples
    from trainer.run.checkpoint import load_policy_weights
    from trainer.config import load_config
    from trainer.run.workers import LocalWorkers, PolicyTrainer
    from trainer.run.loop import Trainer

    out = Path(tempfile.mkdtemp(prefix="shared-prefix-bench-"))
    overrides = [f"out_dir={out}", f"retriever.index={args.index}", "data.scan_limit=1000"]
    cfg = load_config(args.config, [*overrides, "train.share_prefix=true"])
    off_cfg = load_config(args.config, [*overrides, "train.share_prefix=false"])
    set_seed(cfg.seed)
    config = args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config
    result: dict = {"benchmark": "shared_prefix", "config": str(config), "init": str(args.init), "cpu": cpu_kind(),
                    "iterations": args.iterations}
    timings: dict[str, list[dict]] = {"shared": [], "whole": []}
    gaps: dict[str, float] = dict.fromkeys(COMPARED, 0.0)
    with contextlib.redirect_stdout(sys.stderr), connect_retriever(cfg) as (client, tag):
        train = train_examples(cfg, client, tag)
        tokenizer = load_tokenizer(cfg.model)
        sft = load_policy_weights(args.init)
        policies = {}
        for name in timings:
            policies[name] = load_policy(cfg.model, dtype=cfg.dtype)
            policies[name].load_state_dict(sft)
        backend = open_backend(cfg.rollout, cfg.model, tokenizer, policies["shared"], dtype=cfg.dtype, seed=cfg.seed)
        try:
            agent = make_agent(backend, tokenizer, client, cfg.rollout, retriever_timeout_s=cfg.retriever.timeout_s)
            engine = LocalWorkers(cfg, policies["shared"], backend, agent)
            learners = {"shared": engine.learning, "whole": PolicyTrainer(off_cfg, policies["whole"])}
            counters = {name: TokenRows(policies[name]) for name in learners}
            learn = engine.learn

            def both_learn(batch, iteration):
                order = list(learners) if iteration % 2 else list(reversed(learners))
                stats = {}
                for name in order:
                    before = counters[name].rows
                    stats[name] = learn(batch, iteration) if name == "shared" else \
                        learners[name].train_step(batch, iteration)
                    timings[name].append({"prepare_s": round(stats[name]["time_prepare_s"], 2),
                                          "update_s": round(stats[name]["time_update_s"], 2),
                                          "decoder_token_rows": counters[name].rows - before})
                for key in COMPARED:
                    gaps[key] = max(gaps[key], abs(stats["shared"][key] - stats["whole"][key]))
                return stats["shared"]

            engine.learn = both_learn
            trainer = Trainer(cfg, engine, tokenizer, train)
            for _ in range(args.iterations):
                start = time.perf_counter()
                metrics = trainer.step()
                print(f"iteration {trainer.iteration}: {time.perf_counter() - start:.0f} s, reward "
                      f"{metrics['rollout/reward']:.3f}, {metrics['rollout/response_tokens']:.0f} response tokens",
                      file=sys.stderr)
        finally:
            backend.close()
            shutil.rmtree(out)
    for name, runs in timings.items():
        result[name] = {key: statistics.median(r[key] for r in runs) for key in runs[0]} | {"per_iteration": runs}
    result["shared_over_whole"] = {key: round(result["shared"][key] / result["whole"][key], 3)
                                   for key in ("prepare_s", "update_s", "decoder_token_rows")}
    learner_s = {name: result[name]["prepare_s"] + result[name]["update_s"] for name in timings}
    result["shared_over_whole"]["learner_s"] = round(learner_s["shared"] / learner_s["whole"], 3)
    result["largest_stat_difference"] = {k: float(f"{v:.3g}") for k, v in gaps.items()}
    with torch.no_grad():
        weight_gap = max((a - b).abs().max().item() for a, b in
                         zip(policies["shared"].parameters(), policies["whole"].parameters(), strict=True))
    result["largest_weight_difference_at_end"] = float(f"{weight_gap:.3g}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()

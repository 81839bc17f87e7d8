"""`make compare`: GRPO (fixed reference, k3 KL) against EMA-PG (EMA anchor, Top-k KL) from one SFT checkpoint.

Both variants start from the same SFT weights with the same seeds, data order and budget; the only differences
are `ema.tau` (1.0: a fixed reference) and `kl.estimator`. Held-out EM is measured at the start (the SFT model, shared) and
every `eval_every` iterations. Writes <run>/compare.md, compare.json and compare.png (reward curves, held-out EM).

A two-hour job must survive an interrupted session: run again, it picks up what is on disk (the SFT checkpoint,
finished evaluations, each variant's latest checkpoint) and computes only the rest.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from emapg.demo import pooled, read_jsonl
from emapg.workflow import (
    build_sft_data,
    connect_retriever,
    console,
    eval_examples,
    print_iteration,
    run_eval,
    run_sft,
    train_examples,
)

# The two methods differ only in these keys; everything else comes from the run's config.
VARIANTS = {
    "GRPO": {"ema": {"tau": 1.0}, "kl": {"estimator": "k3"}},
    "EMA-PG": {"ema": {}, "kl": {"estimator": "topk"}},
}


def variant_config(cfg, name: str):
    from trainer.config import TrainConfig

    raw = cfg.model_dump()
    for section, values in VARIANTS[name].items():
        raw[section] = {**raw[section], **values}
    raw["name"] = f"{cfg.name}/{name.lower()}"
    return TrainConfig.model_validate(raw)


def plot(curves: dict[str, list[dict]], held_out: dict[str, list[tuple[int, dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, (name, metrics) in enumerate(curves.items()):
        color, it = f"C{i}", [m["iteration"] for m in metrics]
        ax_r.plot(it, [m["reward"] for m in metrics], color=color, alpha=0.3)
        window = 5  # a trailing mean: single iterations of a few groups are noisy
        smooth = [sum(m["reward"] for m in metrics[max(0, j - window + 1) : j + 1]) / min(window, j + 1)
                  for j in range(len(metrics))]
        ax_r.plot(it, smooth, color=color, label=f"{name} (faint: per iteration; bold: mean of {window})")
        points = held_out[name]
        shift = 0.15 * (i - 0.5)  # side by side, so equal values stay visible
        ax_e.errorbar([j + shift for j, _ in points], [p["em"] for _, p in points],
                      yerr=[[p["em"] - p["em_low"] for _, p in points], [p["em_high"] - p["em"] for _, p in points]],
                      color=color, marker="o", capsize=3, label=name)
    ax_r.set(title="training reward (rollouts)", xlabel="iteration")
    ax_e.set(title="held-out EM (95% CI)", xlabel="iteration", ylim=(0, None))
    ax_r.legend()
    ax_e.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def held_out_eval(cfg, policy, tokenizer, client, test, name: str, out_dir: Path, backend) -> dict:
    """Pooled held-out EM of `policy`, or of the evaluation an earlier (interrupted) run saved in `out_dir`."""
    from eval.harness import EvalReport

    if (out_dir / "report.json").exists():
        console.print(f"{name}: reusing {out_dir / 'report.json'}")
        return pooled(EvalReport.load(out_dir / "report.json"))
    return pooled(run_eval(cfg, policy, tokenizer, client, test, name, out_dir, "held-out", backend))


def run_variant(cfg, name: str, policy, sft_weights, tokenizer, client, train, test, backend, start: dict,
                eval_every: int) -> list[tuple[int, dict]]:
    """One method from the SFT weights (or its latest checkpoint), evaluated every `eval_every` iterations."""
    from transformers import set_seed

    from trainer.checkpoint import latest_checkpoint
    from trainer.engine import LocalEngine
    from trainer.loop import Trainer

    vcfg = variant_config(cfg, name)
    set_seed(vcfg.seed)
    policy.load_state_dict(sft_weights)
    engine = LocalEngine(vcfg, policy, tokenizer, backend, client)  # anchor starts at SFT
    trainer = Trainer(vcfg, engine, tokenizer, train)
    if (checkpoint := latest_checkpoint(vcfg.run_dir)) is not None:
        trainer.restore(checkpoint)
        console.print(f"{name}: resuming from {checkpoint}")
    points = [(0, start)]
    # Evaluations before the resumed iteration were saved by the run that got there (their policies are gone).
    for iteration in range(eval_every, trainer.iteration + 1, eval_every):
        folder = vcfg.run_dir / f"eval-{iteration:04d}"
        if iteration < trainer.iteration and not (folder / "report.json").exists():
            raise FileNotFoundError(f"{folder / 'report.json'} is missing and iteration {iteration}'s policy is "
                                    f"gone (resuming at {trainer.iteration}): delete {vcfg.run_dir} to redo {name}")
        points.append((iteration, held_out_eval(vcfg, policy, tokenizer, client, test, f"{name} @ {iteration}",
                                                folder, backend)))
    while trainer.iteration < vcfg.train.iterations:
        trainer.run(progress=print_iteration, until=trainer.iteration + eval_every)
        points.append((trainer.iteration, held_out_eval(vcfg, policy, tokenizer, client, test,
                                                        f"{name} @ {trainer.iteration}",
                                                        vcfg.run_dir / f"eval-{trainer.iteration:04d}", backend)))
        console.print(f"{name} iteration {trainer.iteration}: held-out EM {points[-1][1]['em']:.3f}")
    return points


def last_per_iteration(metrics: list[dict]) -> list[dict]:
    """A resumed run logs the iterations after its checkpoint again: keep each iteration's latest line."""
    return sorted({m["iteration"]: m for m in metrics}.values(), key=lambda m: m["iteration"])


def work_minutes(curves: dict[str, list[dict]], held_out: dict[str, list[tuple[int, dict]]]) -> float:
    """Training and evaluation time summed from the logs, which count the work of an interrupted earlier run too
    (a resumed run's wall time does not): every iteration's timed phases and every distinct evaluation."""
    training = sum(value for metrics in curves.values() for m in metrics
                   for key, value in m.items() if key.startswith("time_"))
    # Every variant's points start with the same SFT evaluation: count it once.
    start = next(iter(held_out.values()))[0][1]["seconds"]
    evaluations = start + sum(p["seconds"] for points in held_out.values() for _, p in points[1:])
    return (training + evaluations) / 60


def run_compare(cfg, init: Path | None, eval_every: int) -> Path:
    from agent.policy import load_policy, load_tokenizer
    from trainer.checkpoint import latest_checkpoint, load_policy_weights
    from trainer.engine import rollout_backend
    from trainer.guard import events_markdown, read_events
    from trainer.wandb_logger import attach_run_reports

    out = cfg.run_dir
    out.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    held_out: dict[str, list[tuple[int, dict]]] = {}
    with connect_retriever(cfg, log=out / "server.log") as (client, tag):
        train, test = train_examples(cfg, client, tag), eval_examples(cfg, client, tag)
        tokenizer = load_tokenizer(cfg.model)
        if init is None and latest_checkpoint(cfg.sft_dir) is not None:
            init = cfg.sft_dir  # an earlier run's SFT
            console.print(f"reusing the SFT checkpoint in {init}")
        if init is None:  # no SFT checkpoint given: make one, shared by both variants
            console.rule("SFT warm start")
            init = run_sft(cfg, load_policy(cfg.model, dtype=cfg.dtype), tokenizer,
                           build_sft_data(cfg, client, tokenizer, train))
        sft_weights = load_policy_weights(init)
        policy = load_policy(cfg.model, dtype=cfg.dtype)
        policy.load_state_dict(sft_weights)
        backend = rollout_backend(cfg, tokenizer, policy)  # one engine for both variants' rollouts and evaluations
        try:
            start = held_out_eval(cfg, policy, tokenizer, client, test, "SFT", out / "eval-sft", backend)
            for name in VARIANTS:
                console.rule(name)
                held_out[name] = run_variant(cfg, name, policy, sft_weights, tokenizer, client, train, test, backend,
                                             start, eval_every)
        finally:
            backend.close()
    curves = {name: last_per_iteration(read_jsonl(variant_config(cfg, name).run_dir / "metrics.jsonl"))
              for name in VARIANTS}
    lines = [(f"From `{init}`; held-out: {sum(len(v) for v in test.values())} questions; wall time "
              f"{(time.perf_counter() - begin) / 60:.0f} min (this run); training and evaluation "
              f"{work_minutes(curves, held_out):.0f} min (all runs, from the logs; SFT not counted)."), "",
             "| method | iteration | held-out EM | 95% CI | valid format | mean reward, last 5 iterations |",
             "|---|---|---|---|---|---|"]
    for name, points in held_out.items():
        last = curves[name][-5:]
        for iteration, p in points:
            tail = f"{sum(m['reward'] for m in last) / max(1, len(last)):.3f}" if iteration == points[-1][0] else ""
            lines.append(f"| {name} | {iteration} | {p['em']:.3f} | {p['em_low']:.3f}-{p['em_high']:.3f} | "
                         f"{p['well_formed']:.2f} | {tail} |")
    runs = {name: variant_config(cfg, name).run_dir for name in VARIANTS}
    for name, run_dir in runs.items():
        lines += ["", *events_markdown(run_dir, title=f"{name} guard")]
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    (out / "compare.json").write_text(json.dumps({"init": str(init), "held_out": held_out, "guard_events": {
        name: read_events(run_dir) for name, run_dir in runs.items()}}, indent=2))
    plot(curves, held_out, out / "compare.png")
    attach_run_reports(cfg, [out / name for name in ("compare.md", "compare.json", "compare.png")]
                       + sorted(out.glob("**/eval-*/report.*")) + sorted(out.glob("**/eval-*/em.png")))
    print("\n".join(lines))
    return out / "compare.md"

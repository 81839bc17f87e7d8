"""`make demo`: the whole job on the CPU default, in one process, with one retrieval server.

    serve -> evaluate base -> demonstrations + SFT -> evaluate -> EMA-PG from SFT -> evaluate -> report

The policy stays in memory between stages: the SFT stage trains it in place, and the EMA-PG trainer built after it
starts its anchor at the SFT weights (what `emapg train --init <sft run>` does from disk). Everything lands in the
run folder: eval-*/ (reports, trajectories), sft/ (demonstrations, checkpoint, metrics), checkpoints/,
metrics.jsonl, tb/, and report.md / report.json / curves.png / em.png.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

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
from eval.harness import EvalReport, wilson_interval

RETRIEVAL_CHECK = ["who wrote pride and prejudice", "what is the capital of australia", "who painted the mona lisa"]


def pooled(report: EvalReport) -> dict[str, float]:
    """One row over all evaluated questions (datasets pooled), with the Wilson 95% CI of EM."""
    n = sum(r.n for r in report.results)

    def mean(attr: str) -> float:
        return sum(getattr(r, attr) * r.n for r in report.results) / max(1, n)

    low, high = wilson_interval(mean("em") * n, n)
    return {"n": n, "em": mean("em"), "em_low": low, "em_high": high, "cover_em": mean("cover_em"),
            "well_formed": mean("well_formed"), "searches": mean("mean_searches"),
            "tokens": mean("mean_response_tokens"), "seconds": report.seconds}


def report_markdown(stages: dict[str, EvalReport], timings: dict[str, float], subset: str) -> str:
    lines = [
        f"Held-out questions: {subset}. Agent mode, greedy.",
        "",
        "| stage | n | EM | EM 95% CI | cover-EM | valid format | searches | model tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, report in stages.items():
        p = pooled(report)
        lines.append(f"| {name} | {p['n']} | {p['em']:.3f} | {p['em_low']:.3f}-{p['em_high']:.3f} | "
                     f"{p['cover_em']:.3f} | {p['well_formed']:.2f} | {p['searches']:.2f} | {p['tokens']:.0f} |")
    lines += ["", "Per dataset:", "", "| stage | dataset | n | EM | EM 95% CI | cover-EM | valid format |",
              "|---|---|---|---|---|---|---|"]
    for name, report in stages.items():
        for r in report.results:
            lines.append(f"| {name} | {r.dataset} | {r.n} | {r.em:.3f} | {r.em_ci95[0]:.3f}-{r.em_ci95[1]:.3f} | "
                         f"{r.cover_em:.3f} | {r.well_formed:.2f} |")
    lines += ["", "Wall time per stage (minutes):", "", "| " + " | ".join(timings) + " |",
              "|" + "---|" * len(timings), "| " + " | ".join(f"{t / 60:.1f}" for t in timings.values()) + " |"]
    return "\n".join(lines) + "\n"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def plot_curves(rl_metrics: list[dict], sft_metrics: list[dict], path: Path) -> None:
    """SFT loss per step; EMA-PG reward / EM, KL to the anchor, and response length per iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.4))
    axes[0].plot([m["iteration"] for m in sft_metrics], [m["sft_loss"] for m in sft_metrics])
    axes[0].set(title="SFT loss (model tokens)", xlabel="step")
    it = [m["iteration"] for m in rl_metrics]
    axes[1].plot(it, [m["reward"] for m in rl_metrics], marker="o", label="reward")
    axes[1].plot(it, [m["em"] for m in rl_metrics], marker="o", label="EM")
    axes[1].set(title="EMA-PG reward (rollouts)", xlabel="iteration")
    axes[1].legend()
    axes[2].plot(it, [m.get("kl", 0.0) for m in rl_metrics], marker="o")
    axes[2].set(title="KL estimate, policy to EMA anchor", xlabel="iteration")
    axes[3].plot(it, [m["response_tokens"] for m in rl_metrics], marker="o")
    axes[3].set(title="model tokens per trajectory", xlabel="iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_stages(stages: dict[str, EvalReport], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [pooled(r) for r in stages.values()]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ems = [p["em"] for p in rows]
    err = [[p["em"] - p["em_low"] for p in rows], [p["em_high"] - p["em"] for p in rows]]
    ax.bar(list(stages), ems, yerr=err, capsize=4)
    ax.set(ylabel="held-out EM (95% CI)", ylim=(0, 1), title="base -> SFT -> SFT + EMA-PG")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(cfg) -> Path:
    from agent.policy import load_policy, load_tokenizer
    from trainer.engine import LocalEngine, rollout_backend
    from trainer.guard import events_markdown, read_events
    from trainer.loop import Trainer
    from trainer.wandb_logger import attach_run_reports

    out = cfg.run_dir
    if out.exists():
        console.print(f"removing the previous demo run {out}")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    timings: dict[str, float] = {}
    stages: dict[str, EvalReport] = {}
    begin = time.perf_counter()

    def stage(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = now - since
        return now

    console.rule("retrieval server")
    with connect_retriever(cfg, log=out / "server.log") as (client, tag):
        for question, hits in zip(RETRIEVAL_CHECK, client.search(RETRIEVAL_CHECK, 1), strict=True):
            console.print(f"{question!r} -> {hits[0].contents.splitlines()[0]} ({hits[0].score:.3f})")
        train = train_examples(cfg, client, tag)
        held_out = eval_examples(cfg, client, tag)
        subset = (f"first {cfg.data.eval_limit} of the answerable subsets (top-{cfg.data.answerable_k}) of "
                  f"{', '.join(cfg.data.eval)}" if cfg.data.subset == "answerable" else ", ".join(cfg.data.eval))
        tokenizer = load_tokenizer(cfg.model)
        policy = load_policy(cfg.model, dtype=cfg.dtype)
        backend = rollout_backend(cfg, tokenizer, policy)  # one engine for every stage's rollouts
        t = stage("setup", begin)
        try:
            console.rule("evaluate the base model")
            stages["base"] = run_eval(cfg, policy, tokenizer, client, held_out, "base", out / "eval-base", subset, backend)
            t = stage("eval base", t)

            console.rule("SFT warm start")
            run_sft(cfg, policy, tokenizer, build_sft_data(cfg, client, tokenizer, train))
            t = stage("SFT", t)
            stages["SFT"] = run_eval(cfg, policy, tokenizer, client, held_out, "SFT", out / "eval-sft", subset, backend)
            t = stage("eval SFT", t)

            console.rule(f"EMA-PG from the SFT model ({cfg.train.iterations} iterations)")
            engine = LocalEngine(cfg, policy, tokenizer, backend, client)
            Trainer(cfg, engine, tokenizer, train).run(progress=print_iteration)
            t = stage("EMA-PG", t)
            stages["SFT + EMA-PG"] = run_eval(cfg, policy, tokenizer, client, held_out, "SFT + EMA-PG",
                                              out / "eval-emapg", subset, backend)
            stage("eval SFT + EMA-PG", t)
        finally:
            backend.close()
    timings["total"] = time.perf_counter() - begin

    markdown = report_markdown(stages, timings, subset) + "\n" + "\n".join(events_markdown(out)) + "\n"
    (out / "report.md").write_text(markdown)
    (out / "report.json").write_text(json.dumps(
        {"stages": {name: pooled(r) for name, r in stages.items()}, "timings_s": timings,
         "guard_events": read_events(out), "config": cfg.model_dump(mode="json")}, indent=2))
    plot_curves(read_jsonl(out / "metrics.jsonl"), read_jsonl(cfg.sft_dir / "metrics.jsonl"), out / "curves.png")
    plot_stages(stages, out / "em.png")
    attach_run_reports(cfg, [out / name for name in ("report.md", "report.json", "curves.png", "em.png")]
                       + sorted(out.glob("eval-*/report.*")) + sorted(out.glob("eval-*/em.png")))
    print(markdown)
    return out / "report.md"

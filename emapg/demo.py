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

from emapg.console import log_to
from emapg.session import open_session
from emapg.workflow import build_sft_data, console, eval_examples, run_sft, train_examples, train_with_progress
from emapg.view import view_command
from eval.report import EvalReport, plot_curves, plot_stages, pooled, stages_markdown

RETRIEVAL_CHECK = ["who wrote pride and prejudice", "what is the capital of australia", "who painted the mona lisa"]


def run_demo(cfg) -> Path:
    from trainer.run.metrics_log import current_history, read_metrics
    from trainer.run.guard import events_markdown, read_events
    from trainer.run.loop import Trainer
    from trainer.run.wandb_logger import attach_run_reports

    out = cfg.run_dir
    if out.exists():
        console.print(f"removing the previous demo run {out}")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    log_to(out)  # the engine's logs into the run folder (after the previous run's folder is gone)
    timings: dict[str, float] = {}
    stages: dict[str, EvalReport] = {}
    begin = time.perf_counter()

    def stage(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = now - since
        return now

    console.rule("retrieval server")
    with open_session(cfg, log=out / "server.log") as session:
        client = session.client
        for question, hits in zip(RETRIEVAL_CHECK, client.search(RETRIEVAL_CHECK, 1), strict=True):
            console.print(f"{question!r} -> {hits[0].contents.splitlines()[0]} ({hits[0].score:.3f})")
        train = train_examples(cfg, client, session.index_tag)
        held_out = eval_examples(cfg, client, session.index_tag)
        subset = (f"first {cfg.data.eval_limit} of the answerable subsets (top-{cfg.data.answerable_k}) of "
                  f"{', '.join(cfg.data.eval)}" if cfg.data.subset == "answerable" else ", ".join(cfg.data.eval))
        policy = session.policy
        session.backend  # noqa: B018 - started here, so that its start-up counts as set-up: one engine for every stage
        t = stage("setup", begin)

        def evaluate(name: str, folder: str) -> EvalReport:
            return session.evaluate(held_out, name=name, out_dir=out / folder, subset=subset, policy=policy)

        console.rule("evaluate the base model")
        stages["base"] = evaluate("base", "eval-base")
        t = stage("eval base", t)

        console.rule("SFT warm start")
        run_sft(cfg, policy, session.tokenizer, build_sft_data(cfg, client, session.tokenizer, train))
        t = stage("SFT", t)
        stages["SFT"] = evaluate("SFT", "eval-sft")
        t = stage("eval SFT", t)

        console.rule(f"EMA-PG from the SFT model ({cfg.train.iterations} iterations)")
        train_with_progress(Trainer(cfg, session.local_engine(), session.tokenizer, train), "EMA-PG")
        t = stage("EMA-PG", t)
        stages["SFT + EMA-PG"] = evaluate("SFT + EMA-PG", "eval-emapg")
        stage("eval SFT + EMA-PG", t)
    timings["total"] = time.perf_counter() - begin

    markdown = stages_markdown(stages, timings, subset) + "\n" + "\n".join(events_markdown(out)) + "\n"
    (out / "report.md").write_text(markdown)
    (out / "report.json").write_text(json.dumps(
        {"stages": {name: pooled(r) for name, r in stages.items()}, "timings_s": timings,
         "guard_events": read_events(out), "config": cfg.model_dump(mode="json")}, indent=2))
    plot_curves(current_history(read_metrics(out / "metrics.jsonl")),
                current_history(read_metrics(cfg.sft_dir / "metrics.jsonl")), out / "curves.png")
    plot_stages(stages, out / "em.png")
    attach_run_reports(cfg, [out / name for name in ("report.md", "report.json", "curves.png", "em.png")]
                       + sorted(out.glob("eval-*/report.*")) + sorted(out.glob("eval-*/em.png")))
    print(markdown)
    console.print(f"inspect the run (trajectories, curves, side by side): {view_command(out)}")
    return out / "report.md"

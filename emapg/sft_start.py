"""`emapg sft`: an SFT start that reports its own quality. Demonstrations through the run's retriever, SFT on them,
and greedy evaluations of a held-out slice (the first sft.eval_questions of each data.eval set) every
sft.eval_every steps and at the end, through the session's agent and retriever (eval.harness, as every evaluation);
then the verdict (eval/sft_verdict.py) against the floors sft.min_format and sft.min_em.

In <run>/sft/: metrics.jsonl (the loss curve, per step), eval-step-NNNNNN/ (each evaluation's report and
trajectories), evaluations.json (each evaluation's pooled row, the floors and the verdict).
"""

from __future__ import annotations

import json
from pathlib import Path

from emapg.session import Session
from emapg.workflow import build_sft_data, console, eval_examples, run_sft, train_examples
from eval.report import pooled
from eval.sft_verdict import Verdict, sft_verdict


def held_out_slice(cfg, session: Session) -> dict[str, list]:
    """The first sft.eval_questions of each held-out set (after data.subset and data.eval_limit); {} when 0."""
    if not cfg.sft.eval_questions:
        return {}
    sets = eval_examples(cfg, session.client, session.index_tag)
    if not any(sets.values()):
        raise ValueError(f"sft.eval_questions: the held-out sets {', '.join(cfg.data.eval)} have no questions "
                         f"(data.subset={cfg.data.subset}) to evaluate the SFT start on")
    return {name: examples[: cfg.sft.eval_questions] for name, examples in sets.items() if examples}


def sft_start(cfg, session: Session) -> tuple[Path, Verdict | None]:
    """Demonstrations, SFT with its held-out evaluations, the verdict (None when sft.eval_questions is 0). Raises
    ValueError when no train question yields a demonstration."""
    demos = build_sft_data(cfg, session.client, session.tokenizer,
                           train_examples(cfg, session.client, session.index_tag))
    if not demos:
        raise ValueError("no demonstrations: no train question's retrieved documents show its gold answer")
    held_out = held_out_slice(cfg, session)
    record = cfg.sft_dir / "evaluations.json"
    floors = {"min_format": cfg.sft.min_format, "min_em": cfg.sft.min_em}
    evaluations: list[dict] = []

    def evaluate(step: int) -> None:
        report = session.evaluate(held_out, name=f"SFT step {step}", out_dir=cfg.sft_dir / f"eval-step-{step:06d}",
                                  subset=f"first {cfg.sft.eval_questions} of {', '.join(cfg.data.eval)}",
                                  policy=session.policy)
        row = {"step": step, **pooled(report)}
        evaluations.append(row)
        record.write_text(json.dumps({"floors": floors, "evaluations": evaluations}, indent=2))
        console.print(f"SFT step {step}: held-out EM {row['em']:.3f}, valid format {row['well_formed']:.2f}, "
                      f"searches {row['searches']:.2f} (n = {row['n']})")

    path = run_sft(cfg, session.policy, session.tokenizer, demos, evaluate=evaluate if held_out else None)
    if not evaluations:
        return path, None
    verdict = sft_verdict(evaluations[-1], cfg.sft.min_format, cfg.sft.min_em)
    record.write_text(json.dumps({"floors": floors, "evaluations": evaluations, "verdict": {
        "ok": verdict.ok, "lines": verdict.lines, "failures": verdict.failures}}, indent=2))
    return path, verdict

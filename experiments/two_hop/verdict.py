"""Study B's break rule for one pilot run (docs/study_b_plan.md, "The collapse rule").

    python -m experiments.two_hop.verdict artifacts/study-b/pilot-lr1e-4/two-hop/grpo-k3c

A run breaks when it collapses (experiments.mechanism.cell `curve_summary` on its train reward, read as the run's
history: a resumed run logs iterations again) or when its last held-out `kb-2hop` EM is below the SFT start's + 0.5.
The SFT start's evaluation is the run's sibling `eval-sft`. Prints one JSON line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from eval.report import EvalReport
from experiments.mechanism.cell import all_finite, curve_summary
from trainer.run.metrics_log import current_history, read_metrics

PRIMARY = "kb-2hop"
MARGIN = 0.5  # "fails to learn what every arm learned at 2e-5": below the start's EM + 0.5


def dataset_em(evaluation: Path) -> dict[str, float]:
    """dataset -> agent-mode EM of one evaluation folder."""
    report = EvalReport.load(evaluation / "report.json")
    return {row.dataset: row.em for row in report.results if row.mode == "agent"}


def primary_em(evaluation: Path) -> float:
    return dataset_em(evaluation)[PRIMARY]


def pilot_verdict(run: Path) -> dict:
    """The rule's inputs and its verdict (`broke`); a run without a finished evaluation is refused."""
    metrics = current_history(read_metrics(run / "metrics.jsonl"))
    evaluations = sorted(run.glob("eval-[0-9]*"))  # eval-<iteration:04d>; not an EMA arm's eval-anchor-*
    if not evaluations:
        raise ValueError(f"{run}: no finished evaluation (eval-<iteration>/report.json)")
    summary = curve_summary([m["rollout/reward"] for m in metrics], all_finite(metrics))
    start, last = primary_em(run.parent / "eval-sft"), primary_em(evaluations[-1])
    return {"run": str(run), "iterations": len(metrics), "last_evaluation": evaluations[-1].name,
            "kb_2hop_em": last, "sft_kb_2hop_em": start, **summary,
            "broke": summary["collapsed"] or last < start + MARGIN}


def main(run: Annotated[Path, typer.Argument(help="a pilot run's folder, e.g. <out>/two-hop/grpo-k3c")]) -> None:
    try:
        print(json.dumps(pilot_verdict(run)))
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from e


if __name__ == "__main__":
    typer.run(main)

"""Study A of issue 43, analysed as its plan declares (docs/study_stability_plan.md): the stable learning-rate frontier.

    python -m experiments.mechanism.stability --blocks artifacts/study-a/block-1,artifacts/study-a/block-2 \
        --out artifacts/study-a

Reads every finished cell (`cells/*/result.json`) of each block (one SFT start each, `experiments.mechanism.run
--preset stability`), and writes <out>/stability.md, stability.json and frontier.png:

    primary     final held-out EM, EMA-PG - GRPO-k3c at lr 3e-3, paired by seed over the seeds where both finished,
                exact two-sided sign-flip p (eval/seed_stats.py), its mean and 95% bootstrap interval
    secondary   Holm over the declared family (FAMILY below): EMA-PG - GRPO-k3c at the other rates, the other pairs
                at every rate, and the collapse counts of EMA-PG against GRPO-k3c at every rate (the exact sign-flip
                test on paired 0/1 collapse indicators, which is the exact McNemar test)
    picture     held-out EM against the learning rate, one line per arm (the mean), every seed a point, collapses as x
    grad/       per arm and rate: the median over a run's iterations of grad/kl_pg_ratio (NaN skipped) and of
                grad/kl_pg_cosine, with the count of iterations where the policy gradient was zero

Seeds are the unit; a seed that a block lacks for an arm is left out of that comparison only (whole seeds are
what the plan runs, so in a finished study every comparison has all of them). Blocks are pooled for the tests, and
each block's mean difference is reported beside them.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from eval.seed_stats import format_p, holm, paired_seeds
from trainer.methods import STUDIES

PRIMARY = ("EMA-PG", "GRPO-k3c", 3e-3)
ARMS = STUDIES["stability"]
RATES = (2e-3, 3e-3, 5e-3)
PAIRS = (("EMA-PG", "EMA-k3c"), ("EMA-k3c", "GRPO-k3c"), ("EMA-PG", "GRPO-floor"))


def family() -> list[tuple[str, str, str, float]]:
    """The secondary family, fixed by the plan: (outcome, A, B, lr)."""
    rows = [("em", "EMA-PG", "GRPO-k3c", lr) for lr in RATES if lr != PRIMARY[2]]
    rows += [("em", a, b, lr) for a, b in PAIRS for lr in RATES]
    rows += [("collapse", "GRPO-k3c", "EMA-PG", lr) for lr in RATES]  # A - B > 0: GRPO-k3c collapsed, EMA-PG not
    return rows


def load_cells(blocks: list[Path]) -> dict[tuple[str, float], dict[int, dict]]:
    """(arm, lr) -> seed -> result.json (with its block's folder under "block"); a seed in two blocks is an error."""
    cells: dict[tuple[str, float], dict[int, dict]] = defaultdict(dict)
    for block in blocks:
        for path in sorted((block / "cells").glob("*/result.json")):
            r = json.loads(path.read_text())
            key = (r["method"], float(r["lr"]))
            if r["seed"] in cells[key]:
                raise ValueError(f"seed {r['seed']} of {key} is in two blocks ({cells[key][r['seed']]['block']}, "
                                 f"{block}): each block has seeds of its own")
            cells[key][r["seed"]] = {**r, "block": block.name}
    return dict(cells)


OUTCOMES = {
    "em": lambda r: float(r["final"]["em"]),  # final greedy held-out EM
    "collapse": lambda r: float(bool(r["collapsed"])),
    "answered": lambda r: float(r["final"]["answered"]),  # share of held-out questions answered at all
}


def outcome(r: dict, name: str) -> float:
    return OUTCOMES[name](r)


PULL_ITERATIONS = (2, 3, 4)  # iteration 1's KL is zero by construction (policy = anchor): it says nothing of the pull


def pull_ratio(cells: dict, a: str, b: str, lr: float, iterations: tuple[int, ...] = PULL_ITERATIONS) -> dict | None:
    """How hard A's KL term pulls against B's at the same learning rate and seed (`paired_norm_ratio` of their
    grad/kl_norm, beta included). Iteration 1's rollouts are the same in every arm of a seed (same seed, same
    start), so the states compared are alike at iteration 2 and drift apart after it."""
    left, right = cells.get((a, lr), {}), cells.get((b, lr), {})
    ratio = paired_norm_ratio({s: r["grad"]["grad/kl_norm"] for s, r in left.items()},
                              {s: r["grad"]["grad/kl_norm"] for s, r in right.items()}, iterations)
    return None if ratio is None else {"a": a, "b": b, "lr": lr, **ratio}


def paired_norm_ratio(left: dict[int, list], right: dict[int, list],
                      iterations: tuple[int, ...] = PULL_ITERATIONS) -> dict | None:
    """Per seed (in both), the median over `iterations` (from 1) of left / right (iterations where either is
    missing, zero or non-finite skipped), then the median and range across seeds; None when no seed has one."""
    per_seed = {}
    for seed in sorted(set(left) & set(right)):
        ratios = []
        for i in iterations:
            x, y = (norms[i - 1] if len(norms) >= i else None for norms in (left[seed], right[seed]))
            if x is not None and y and math.isfinite(x) and math.isfinite(y):
                ratios.append(x / y)
        if ratios:
            per_seed[seed] = float(np.median(ratios))
    if not per_seed:
        return None
    values = list(per_seed.values())
    return {"iterations": list(iterations), "n": len(values), "median": float(np.median(values)), "low": min(values),
            "high": max(values), "per_seed": per_seed}


def compare(cells: dict, name: str, a: str, b: str, lr: float) -> dict | None:
    """A - B on `name` over the seeds both finished; None before any."""
    left, right = cells.get((a, lr), {}), cells.get((b, lr), {})
    seeds = sorted(set(left) & set(right))
    if not seeds:
        return None
    r = paired_seeds({s: outcome(left[s], name) for s in seeds}, {s: outcome(right[s], name) for s in seeds})
    per_block: dict[str, list[float]] = defaultdict(list)
    for s, d in zip(seeds, r.differences, strict=True):
        per_block[left[s]["block"]].append(d)
    low, high = r.ci if len(seeds) > 1 else (math.nan, math.nan)
    return {"outcome": name, "a": a, "b": b, "lr": lr, "n": len(seeds), "mean": r.mean, "low": low, "high": high,
            "p": r.p_value, "smallest_p": r.smallest_possible_p, "wins": r.wins, "losses": r.losses, "ties": r.ties,
            "per_block": {k: float(np.mean(v)) for k, v in sorted(per_block.items())}}


def finite_median(values: list) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.median(finite)) if finite else math.nan


def grad_summary(runs: dict[int, dict]) -> dict:
    """Medians across seeds of each run's median grad/kl_pg_ratio and grad/kl_pg_cosine over its iterations (NaN
    skipped), and the share of probed iterations where the policy gradient was zero."""
    ratios, cosines, zero, probed = [], [], 0, 0
    for r in runs.values():
        grad = r.get("grad") or {}
        ratios.append(finite_median(grad.get("grad/kl_pg_ratio", [])))
        cosines.append(finite_median(grad.get("grad/kl_pg_cosine", [])))
        for pg in grad.get("grad/pg_norm", []):
            if pg is not None:
                probed += 1
                zero += pg == 0
    return {"kl_pg_ratio": finite_median(ratios), "kl_pg_cosine": finite_median(cosines),
            "zero_pg_share": zero / probed if probed else math.nan}


def summarise(cells: dict) -> dict:
    primary = compare(cells, "em", *PRIMARY)
    secondary = [c for c in (compare(cells, *row) for row in family()) if c is not None]
    for c, adjusted in zip(secondary, holm([c["p"] for c in secondary]) if secondary else [], strict=True):
        c["holm_p"] = adjusted
    per_cell = []
    for arm in ARMS:
        for lr in RATES:
            runs = cells.get((arm, lr), {})
            if not runs:
                continue
            ems = [r["final"]["em"] for r in runs.values()]
            per_cell.append({"arm": arm, "lr": lr, "n": len(runs), "em_mean": float(np.mean(ems)),
                             "collapsed": sum(bool(r["collapsed"]) for r in runs.values()),
                             "beta": next(iter(runs.values()))["beta"], **grad_summary(runs),
                             "hours": sum(r.get("train_seconds", 0) + r.get("measure_seconds", 0)
                                          for r in runs.values()) / 3600})
    return {"primary": primary, "secondary": secondary, "family_size": len(family()), "cells": per_cell,
            "runs": sum(len(v) for v in cells.values()), "run_hours": sum(c["hours"] for c in per_cell)}


def fmt_interval(c: dict) -> str:
    interval = "" if math.isnan(c["low"]) else f" [{c['low']:+.3f}, {c['high']:+.3f}]"
    return f"{c['mean']:+.3f}{interval}"


PLANNED_RUNS = 192  # the plan's 4 arms x 3 rates x 16 seeds


def readme_effect(summary: dict) -> str:
    """README's evidence-table cell for the study: its progress while runs are missing, else the primary's effect."""
    if summary["runs"] < PLANNED_RUNS or summary["primary"] is None:
        return f"running ({summary['runs']} of {PLANNED_RUNS} runs)"
    return effect_cell(summary["primary"])


def effect_cell(c: dict) -> str:
    """README's effect cell for one comparison (the primary or a secondary)."""
    if c["outcome"] == "em":
        return f"held-out EM {fmt_interval(c)} (ahead in {c['wins']}, behind in {c['losses']} of {c['n']} seeds)"
    return (f"collapse rate {fmt_interval(c)} (only {c['a']} collapsed in {c['wins']} seeds, only {c['b']} in "
            f"{c['losses']}, of {c['n']})")


def markdown(summary: dict) -> str:
    p = summary["primary"]
    lines = ["# Study A: the stable learning-rate frontier (issue 43)", "",
             f"{summary['runs']} runs, {summary['run_hours']:.2f} h of training and evaluation.", "",
             "## Primary (declared): final held-out EM, EMA-PG - GRPO-k3c at lr 3e-3", ""]
    if p is None:
        lines.append("No seed has both arms finished yet.")
    else:
        lines += [f"- {p['n']} seeds: {fmt_interval(p)} (95% bootstrap interval), EMA-PG ahead in {p['wins']}, behind "
                  f"in {p['losses']}, tied in {p['ties']}; exact sign-flip p = {format_p(p['p'])} (the smallest these "
                  f"seeds allow: {format_p(p['smallest_p'])})",
                  "- per block: " + ", ".join(f"{k} {v:+.3f}" for k, v in p["per_block"].items())]
    lines += ["", f"## Secondary (declared family of {summary['family_size']}, Holm)", "",
              "| outcome | A - B | lr | seeds | mean [95% interval] | A ahead / behind / tied | p | Holm p |",
              "|---|---|---|---|---|---|---|---|"]
    for c in summary["secondary"]:
        label = "collapsed (1/0)" if c["outcome"] == "collapse" else "held-out EM"
        lines.append(f"| {label} | {c['a']} - {c['b']} | {c['lr']:g} | {c['n']} | {fmt_interval(c)} | {c['wins']} / "
                     f"{c['losses']} / {c['ties']} | {format_p(c['p'])} | {format_p(c['holm_p'])} |")
    lines += ["", "## Per arm and learning rate", "",
              "| arm | beta | lr | seeds | held-out EM (mean) | collapsed | grad/kl_pg_ratio | grad/kl_pg_cosine | "
              "zero policy gradient | machine h |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in summary["cells"]:
        lines.append(f"| {c['arm']} | {c['beta']:g} | {c['lr']:g} | {c['n']} | {c['em_mean']:.3f} | {c['collapsed']}/"
                     f"{c['n']} | {c['kl_pg_ratio']:.3g} | {c['kl_pg_cosine']:.3g} | {c['zero_pg_share']:.2f} | "
                     f"{c['hours']:.2f} |")
    lines += ["", "grad/ columns: the median across seeds of each run's median over its iterations (NaN skipped); "
              "zero policy gradient: the share of probed iterations whose first step had none (every group tied).",
              "", "![held-out EM against the learning rate](frontier.png)"]
    return "\n".join(lines) + "\n"


def plot(cells: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    rng = np.random.default_rng(0)
    for i, arm in enumerate(ARMS):
        color, rates, means = f"C{i}", [], []
        for lr in RATES:
            runs = cells.get((arm, lr), {})
            if not runs:
                continue
            x = lr * np.exp(0.05 * (i - 1.5) + 0.015 * rng.standard_normal(len(runs)))  # arms side by side
            ems = np.array([r["final"]["em"] for r in runs.values()])
            collapsed = np.array([bool(r["collapsed"]) for r in runs.values()])
            ax.scatter(x[~collapsed], ems[~collapsed], s=12, color=color, alpha=0.5)
            ax.scatter(x[collapsed], ems[collapsed], s=30, color=color, marker="x")
            rates.append(lr)
            means.append(ems.mean())
        if rates:
            ax.plot(rates, means, "-o", color=color, label=arm, linewidth=2)
    ax.scatter([], [], color="gray", marker="x", label="collapsed run")
    ax.set(xscale="log", xlabel="learning rate", ylabel="final held-out EM (200 questions)", ylim=(-0.03, 1.03),
           title="Study A: each dot a seed, lines the means")
    ax.set_xticks(RATES, [f"{lr:g}" for lr in RATES])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def analyse(blocks: list[Path], out: Path) -> dict:
    cells = load_cells(blocks)
    summary = summarise(cells)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stability.json").write_text(json.dumps(summary, indent=1))
    (out / "stability.md").write_text(markdown(summary))
    plot(cells, out / "frontier.png")
    return summary


def main(
    blocks: Annotated[str, typer.Option(help="comma-separated block folders (one SFT start each)")],
    out: Annotated[Path, typer.Option(help="where stability.md, stability.json and frontier.png go")],
) -> None:
    summary = analyse([Path(b) for b in blocks.split(",")], out)
    print(json.dumps({"runs": summary["runs"], "primary": summary["primary"]}))


if __name__ == "__main__":
    typer.run(main)

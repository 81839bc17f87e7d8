"""Study C of issue 54, analysed as its plan declares (docs/study_c_plan.md): what in the EMA-PG arm buys the
stability (Part 1), and whether it survives the authors' warm-up (Part 2).

    python -m experiments.mechanism.study_c --blocks artifacts/study-c/block-4,artifacts/study-c/block-2 \
        --out artifacts/study-c [--study-a docs/evidence/study-a]

Reads every finished cell of each block (`experiments.mechanism.run --preset study-c`), recomputes each run's held-out
EM from its recorded answers against the block's test questions (a mismatch is refused), and writes
<out>/study_c.md, study_c.json and study_c.png:

    primaries    two, Holm over the pair: Part 1, EMA-PG - EMA-k3c-strong (the same pull, the estimator differs);
                 Part 2, EMA-PG-warmup - GRPO-k3c-warmup, both at lr 3e-3, final held-out EM, paired by seed,
                 exact two-sided sign-flip p (eval/seed_stats.py)
    secondary    the declared family (FAMILY below), Holm; collapse by the exact sign-flip test on paired 0/1
                 indicators (the exact McNemar test)
    check        the manipulation check: each matched-beta arm's KL pull against the arm it was matched to
                 (stability.pull_ratio, iterations 2-4), passed when its median is within [0.67, 1.5]
    reported     per arm and rate: EM, the share of questions answered at all, collapses, the grad/ medians
    picture      Part 1's arms at lr 3e-3 (each seed a dot), and EM against the learning rate with and without
                 warm-up (Study A's lines beside them when --study-a names its record)
"""

from __future__ import annotations

import json
import math
import tarfile
import tempfile
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from eval.metrics import exact_match
from eval.seed_stats import format_p, holm
from experiments.mechanism.stability import compare, fmt_interval, grad_summary, load_cells, pull_ratio
from trainer.methods import STUDIES

ARMS = STUDIES["study-c"]
PRIMARIES = (("em", "EMA-PG", "EMA-k3c-strong", 3e-3), ("em", "EMA-PG-warmup", "GRPO-k3c-warmup", 3e-3))
FAMILY = (
    # Part 1 (lr 3e-3, EMA anchor in every arm, no warm-up): one factor each
    ("em", "EMA-PG-weak", "EMA-k3c", 3e-3),  # the estimator at k3c's pull
    ("em", "EMA-PG", "EMA-PG-weak", 3e-3),  # the size of Top-k's pull
    ("em", "EMA-k3c-strong", "EMA-k3c", 3e-3),  # the size of k3c's pull
    ("em", "EMA-PG", "EMA-PG-tail", 3e-3),  # Top-k's variance reduction (same expected gradient)
    ("em", "EMA-PG", "EMA-k3c", 3e-3),  # Study A's estimator contrast on fresh seeds
    # Part 2: the authors' warm-up
    ("collapse", "GRPO-k3c", "GRPO-k3c-warmup", 3e-3),  # does warm-up alone remove GRPO-k3c's collapse?
    ("em", "GRPO-k3c-warmup", "GRPO-k3c", 3e-3),
    ("em", "EMA-PG-warmup", "EMA-PG", 3e-3),
    ("em", "EMA-PG-warmup", "GRPO-k3c-warmup", 5e-3),
    ("collapse", "GRPO-k3c-warmup", "EMA-PG-warmup", 3e-3),
    ("collapse", "GRPO-k3c-warmup", "EMA-PG-warmup", 5e-3),
)
# The matched-beta arms and the arm each was matched to (trainer/methods.py), and the check's band.
MATCHED = (("EMA-PG-weak", "EMA-k3c"), ("EMA-k3c-strong", "EMA-PG"))
CHECK_BAND = (0.67, 1.5)
# The conditional rate: both warm-up arms at 1e-2 when each collapsed in at most this many seeds at 5e-3.
EXTRA_RATE, EXTRA_MAX_COLLAPSES = 1e-2, 4
EXTRA = (("em", "EMA-PG-warmup", "GRPO-k3c-warmup", EXTRA_RATE),
         ("collapse", "GRPO-k3c-warmup", "EMA-PG-warmup", EXTRA_RATE))
PLANNED_RUNS = 160  # 10 cells a seed (sweep.STUDY_C) x 16 seeds


def recompute_em(block: Path, cells: dict) -> int:
    """Check every finished run's held-out EM against its recorded answers, scored here against the block's test
    questions (kb/questions-test.jsonl); returns the runs checked. A run without answers (not evaluated: it did not
    finish finitely) must have EM 0."""
    gold = {}
    for line in (block / "kb" / "questions-test.jsonl").read_text().splitlines():
        example = json.loads(line)["example"]
        gold[example["id"]] = example["golden_answers"]
    checked = 0
    for runs in cells.values():
        for r in runs.values():
            if r["block"] != block.name:
                continue
            final = r["final"]
            answers = final.get("predictions")
            em = (sum(exact_match(p["answer"], gold[p["id"]]) for p in answers) / len(answers)) if answers else 0.0
            if not math.isclose(em, final["em"], abs_tol=1e-9):
                raise ValueError(f"{block.name}/{r['cell']}: EM {final['em']} recorded, {em} from its answers")
            checked += 1
    return checked


def extra_rate_due(summary: dict) -> bool | None:
    """The plan's rule for the 1e-2 cells: None until both warm-up arms have every planned seed at 5e-3, then
    whether each collapsed in at most EXTRA_MAX_COLLAPSES of them."""
    at = {c["arm"]: c for c in summary["cells"] if c["lr"] == 5e-3 and c["warmup"]}
    if set(at) != {"GRPO-k3c-warmup", "EMA-PG-warmup"} or min(c["n"] for c in at.values()) < 16:
        return None
    return all(c["collapsed"] <= EXTRA_MAX_COLLAPSES for c in at.values())


def summarise(cells: dict) -> dict:
    primaries = [compare(cells, *row) for row in PRIMARIES]
    done = [c for c in primaries if c is not None]
    for c, adjusted in zip(done, holm([c["p"] for c in done]) if done else [], strict=True):
        c["holm_p"] = adjusted
    secondary = [c for c in (compare(cells, *row) for row in FAMILY) if c is not None]
    for c, adjusted in zip(secondary, holm([c["p"] for c in secondary]) if secondary else [], strict=True):
        c["holm_p"] = adjusted
    answered = {row[1:]: compare(cells, "answered", *row[1:]) for row in PRIMARIES}
    checks = []
    for arm, matched in MATCHED:
        ratio = pull_ratio(cells, arm, matched, 3e-3)
        if ratio is not None:
            ratio["passed"] = CHECK_BAND[0] <= ratio["median"] <= CHECK_BAND[1]
            checks.append(ratio)
    context = [r for r in (pull_ratio(cells, "EMA-PG", "EMA-k3c", 3e-3), pull_ratio(cells, "EMA-PG-tail", "EMA-PG", 3e-3))
               if r is not None]
    per_cell = []
    for arm in ARMS:
        for lr in sorted({lr for a, lr in cells if a == arm}):
            runs = cells[(arm, lr)]
            per_cell.append({"arm": arm, "lr": lr, "warmup": arm.endswith("-warmup"), "n": len(runs),
                             "beta": next(iter(runs.values()))["beta"],
                             "em_mean": float(np.mean([r["final"]["em"] for r in runs.values()])),
                             "answered_mean": float(np.mean([r["final"]["answered"] for r in runs.values()])),
                             "collapsed": sum(bool(r["collapsed"]) for r in runs.values()), **grad_summary(runs),
                             "hours": sum(r.get("train_seconds", 0) + r.get("measure_seconds", 0)
                                          for r in runs.values()) / 3600})
    summary = {"primaries": primaries, "answered": [a for a in answered.values() if a is not None],
               "secondary": secondary, "family_size": len(FAMILY), "checks": checks, "pull_context": context,
               "cells": per_cell, "runs": sum(len(v) for v in cells.values()),
               "run_hours": sum(c["hours"] for c in per_cell)}
    summary["extra_rate_due"] = extra_rate_due(summary)
    summary["extra"] = [c for c in (compare(cells, *row) for row in EXTRA) if c is not None]  # outside the family
    return summary


def effect_cell(c: dict) -> str:
    """README's effect cell for one comparison."""
    if c["outcome"] == "collapse":
        return (f"collapse rate {fmt_interval(c)} (only {c['a']} collapsed in {c['wins']} seeds, only {c['b']} in "
                f"{c['losses']}, of {c['n']})")
    return f"held-out EM {fmt_interval(c)} (ahead in {c['wins']}, behind in {c['losses']} of {c['n']} seeds)"


def readme_effect(summary: dict, which: int) -> str:
    """README's cell for primary `which` (0: Part 1, 1: Part 2): progress while runs are missing, then its effect."""
    c = summary["primaries"][which]
    if summary["runs"] < PLANNED_RUNS or c is None:
        return f"running ({summary['runs']} of {PLANNED_RUNS} runs)"
    return effect_cell(c)


def _row(c: dict) -> str:
    label = {"em": "held-out EM", "collapse": "collapsed (1/0)", "answered": "answered (share)"}[c["outcome"]]
    holm_p = format_p(c["holm_p"]) if "holm_p" in c else "-"
    return (f"| {label} | {c['a']} - {c['b']} | {c['lr']:g} | {c['n']} | {fmt_interval(c)} | {c['wins']} / "
            f"{c['losses']} / {c['ties']} | {format_p(c['p'])} | {holm_p} |")


HEADER = ["| outcome | A - B | lr | seeds | mean [95% interval] | A ahead / behind / tied | exact p | Holm p |",
          "|---|---|---|---|---|---|---|---|"]


def markdown(summary: dict) -> str:
    lines = ["# Study C: what buys EMA-PG's stability, and does it survive warm-up (issue 54)", "",
             f"{summary['runs']} of {PLANNED_RUNS} planned runs, {summary['run_hours']:.2f} h of training and "
             "evaluation.", "", "## Primaries (declared; Holm over the two)", "", *HEADER]
    lines += [_row(c) for c in summary["primaries"] if c is not None]
    lines += ["", "The same pairs on the share of held-out questions answered at all (reported, not tested):", "",
              *HEADER, *(_row(c) for c in summary["answered"])]
    lines += ["", f"## Secondary (declared family of {summary['family_size']}, Holm)", "", *HEADER,
              *(_row(c) for c in summary["secondary"])]
    lines += ["", "## Manipulation check: the KL pull of each matched-beta arm against the arm it was matched to", "",
              f"grad/kl_norm(A) / grad/kl_norm(B) at lr 3e-3, per seed the median over iterations 2-4, then across "
              f"seeds; passed when the median is within [{CHECK_BAND[0]}, {CHECK_BAND[1]}].", "",
              "| A / B | seeds | median | range | passed |", "|---|---|---|---|---|"]
    lines += [f"| {r['a']} / {r['b']} | {r['n']} | {r['median']:.2f} | {r['low']:.2f}-{r['high']:.2f} | "
              f"{'yes' if r.get('passed') else 'no'} |" for r in summary["checks"]]
    lines += [f"| {r['a']} / {r['b']} (context, no band) | {r['n']} | {r['median']:.2f} | {r['low']:.2f}-{r['high']:.2f}"
              " | - |" for r in summary["pull_context"]]
    due = summary["extra_rate_due"]
    lines += ["", f"## The conditional rate ({EXTRA_RATE:g}; run only if both warm-up arms held at 5e-3)", "",
              {None: "Not decided yet (5e-3 not finished).", True: "Due by the plan's rule.",
               False: "Not due: an arm collapsed in more than "
                      f"{EXTRA_MAX_COLLAPSES} seeds at 5e-3."}[due]]
    if summary["extra"]:
        lines += ["", "Outside the family (exact p reported, no correction):", "", *HEADER,
                  *(_row(c) for c in summary["extra"])]
    lines += ["", "## Per arm and learning rate", "",
              "| arm | beta | lr | warm-up | seeds | held-out EM (mean) | answered (mean) | collapsed | "
              "grad/kl_pg_ratio | machine h |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {c['arm']} | {c['beta']:g} | {c['lr']:g} | {'yes' if c['warmup'] else 'no'} | {c['n']} | "
              f"{c['em_mean']:.3f} | {c['answered_mean']:.3f} | {c['collapsed']}/{c['n']} | {c['kl_pg_ratio']:.3g} | "
              f"{c['hours']:.2f} |" for c in summary["cells"]]
    lines += ["", "![Part 1 at lr 3e-3, and EM against the learning rate with and without warm-up](study_c.png)"]
    return "\n".join(lines) + "\n"


def plot(cells: dict, path: Path, study_a: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (part1, part2) = plt.subplots(1, 2, figsize=(11, 4.2))
    rng = np.random.default_rng(0)
    part1_arms = ("EMA-k3c", "EMA-PG-weak", "EMA-k3c-strong", "EMA-PG", "EMA-PG-tail")
    for i, arm in enumerate(part1_arms):
        runs = cells.get((arm, 3e-3), {})
        if not runs:
            continue
        ems = np.array([r["final"]["em"] for r in runs.values()])
        collapsed = np.array([bool(r["collapsed"]) for r in runs.values()])
        x = i + 0.08 * rng.standard_normal(len(ems))
        part1.scatter(x[~collapsed], ems[~collapsed], s=14, color=f"C{i}", alpha=0.6)
        part1.scatter(x[collapsed], ems[collapsed], s=30, color=f"C{i}", marker="x")
        part1.hlines(ems.mean(), i - 0.3, i + 0.3, color=f"C{i}", linewidth=2)
    part1.set(xticks=range(len(part1_arms)), ylim=(-0.03, 1.03), ylabel="final held-out EM (200 questions)",
              title="Part 1, lr 3e-3, no warm-up (x: collapsed)")
    part1.set_xticklabels(part1_arms, rotation=20, fontsize=8)
    lines = [("GRPO-k3c-warmup", "C3", "-", cells), ("EMA-PG-warmup", "C0", "-", cells),
             ("GRPO-k3c", "C3", ":", cells), ("EMA-PG", "C0", ":", cells)]
    if study_a:
        lines += [("GRPO-k3c", "C3", "--", study_a), ("EMA-PG", "C0", "--", study_a)]
    for arm, color, style, source in lines:
        rates = sorted(lr for a, lr in source if a == arm)
        if not rates:
            continue
        means = [np.mean([r["final"]["em"] for r in source[(arm, lr)].values()]) for lr in rates]
        label = arm if source is cells else f"{arm} (Study A)"
        part2.plot(rates, means, style, marker="o", color=color, label=label, linewidth=2)
        if style == "-":
            for lr in rates:
                ems = [r["final"]["em"] for r in source[(arm, lr)].values()]
                part2.scatter(lr * np.exp(0.03 * rng.standard_normal(len(ems))), ems, s=10, color=color, alpha=0.4)
    part2.set(xscale="log", xlabel="learning rate", ylim=(-0.03, 1.03),
              title="EM against the rate: warm-up (solid),\nnone (dotted: Study C, dashed: Study A)")
    part2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def study_a_cells(record: Path) -> dict:
    """Study A's cells from its committed record (docs/evidence/study-a/block-*.tar.gz), for the picture only."""
    with tempfile.TemporaryDirectory() as tmp:
        blocks = []
        for packed in sorted(record.glob("block-*.tar.gz")):
            if "refused" in packed.name:
                continue
            folder = Path(tmp) / packed.name.removesuffix(".tar.gz")
            with tarfile.open(packed) as tar:
                tar.extractall(folder, filter="data")
            blocks.append(folder)
        return load_cells(blocks)


def analyse(blocks: list[Path], out: Path, study_a: Path | None = None) -> dict:
    cells = load_cells(blocks)
    checked = sum(recompute_em(block, cells) for block in blocks)
    summary = summarise(cells) | {"em_recomputed_from_answers": checked}
    out.mkdir(parents=True, exist_ok=True)
    (out / "study_c.json").write_text(json.dumps(summary, indent=1))
    (out / "study_c.md").write_text(markdown(summary))
    plot(cells, out / "study_c.png", study_a_cells(study_a) if study_a else None)
    return summary


def main(
    blocks: Annotated[str, typer.Option(help="comma-separated block folders (one SFT start each)")],
    out: Annotated[Path, typer.Option(help="where study_c.md, study_c.json and study_c.png go")],
    study_a: Annotated[Path | None, typer.Option(help="Study A's record folder, for its lines in the picture")] = None,
) -> None:
    summary = analyse([Path(b) for b in blocks.split(",")], out, study_a)
    print(json.dumps({"runs": summary["runs"], "primaries": summary["primaries"],
                      "extra_rate_due": summary["extra_rate_due"]}))


if __name__ == "__main__":
    typer.run(main)

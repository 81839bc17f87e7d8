"""The report across training seeds: per-method held-out EM over seeds, and the comparisons declared in advance.

Input: each method's final held-out evaluation per seed (eval.harness.evaluate's out_dir: trajectories/*.agent.jsonl,
read per question by eval.paired.per_question_em) and the plan, written to the run folder before the first result:
the methods, the seeds, and the comparisons (A, B) that form the family Holm corrects over. A comparison added after
the results were seen would not be in that family; `write_plan` refuses to change it.

Output (seeds.md, seeds.json):
    per method     mean held-out EM across the seeds, bootstrap interval across seeds, each seed's EM
    per comparison mean paired difference A - B across seeds, bootstrap interval, seeds won / lost / tied, exact
                   sign-flip p (eval.seed_stats), Holm-adjusted p over the declared family
    secondary      per seed, McNemar over the questions (eval.paired): a statement about those two checkpoints only

Only seeds where every compared model has its evaluation are used (paired by seed); the others are listed as
unfinished.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from eval.paired import paired_em, per_question_em
from eval.seed_stats import format_p, holm, mean_interval, paired_seeds, smallest_sign_flip_p

PLAN_FILE = "plan.json"
METRIC = "held-out EM (agent mode, the held-out sets pooled, greedy)"


def check_comparisons(methods: Sequence[str], comparisons: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The comparisons as (A, B) tuples, each naming two different listed methods, none twice."""
    pairs = [tuple(pair) for pair in comparisons]
    for pair in pairs:
        if len(pair) != 2 or pair[0] == pair[1] or not set(pair) <= set(methods):
            raise ValueError(f"comparisons: {list(pair)} must be two different methods of {list(methods)}")
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"comparisons: listed twice: {sorted({p for p in pairs if pairs.count(p) > 1})}")
    if not pairs:
        raise ValueError("comparisons: the family is empty")
    return pairs  # type: ignore[return-value]


def write_plan(folder: Path, methods: Sequence[str], comparisons: Sequence[tuple[str, str]],
               seeds: Sequence[int]) -> dict:
    """Record the plan in <folder>/plan.json before any result, or check it against the one there: the methods and
    the comparisons must be the same (the family is fixed); seeds may be added (processes running other seeds into
    the same folder), and the plan then lists them all."""
    pairs = check_comparisons(methods, comparisons)
    plan = {"metric": METRIC, "test": "exact two-sided sign-flip across seeds", "correction": "Holm over comparisons",
            "methods": list(methods), "comparisons": [list(p) for p in pairs], "seeds": sorted(set(seeds))}
    path = Path(folder) / PLAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    # Processes started side by side read, merge and write under one lock, so that no one's seeds are lost; the
    # file is replaced whole, so that a reader never sees half of it.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            saved = read_plan(folder)
            for key in ("methods", "comparisons"):
                if saved[key] != plan[key]:
                    raise ValueError(f"{path} declares {key} {saved[key]}, not {plan[key]}: the family is fixed "
                                     "before the results; use a new folder for another plan")
            plan["seeds"] = sorted(set(saved["seeds"]) | set(plan["seeds"]))
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(plan, indent=1) + "\n")
        partial.replace(path)
    return plan


def read_plan(folder: Path) -> dict:
    path = Path(folder) / PLAN_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no plan; write_plan records one before the first run")
    plan = json.loads(path.read_text())
    missing = [key for key in ("methods", "comparisons", "seeds") if key not in plan]
    if missing:
        raise ValueError(f"{path} lacks {missing}")
    check_comparisons(plan["methods"], plan["comparisons"])
    return plan


def seed_report(evals: Mapping[str, Mapping[int, Path]], comparisons: Sequence[tuple[str, str]],
                seeds: Sequence[int], level: float = 0.95) -> dict:
    """The report as a JSON-ready dict (per-seed lists in the order of its "seeds"). `evals[model][seed]`: the folder
    of that model's final held-out evaluation at that training seed (a model shared by every seed, such as the SFT
    start, may map every seed to one folder); `comparisons`: the declared family, (A, B) reported as A - B; `seeds`:
    the declared seeds, of which those with every model's evaluation are used."""
    # A compared model with no evaluation yet is a model with no seed, not an unknown name.
    evals = {**evals, **{name: {} for pair in comparisons for name in pair if name not in evals}}
    pairs = check_comparisons(list(evals), comparisons)
    complete = [s for s in sorted(set(seeds)) if all(s in per_seed for per_seed in evals.values())]
    if not complete:
        lacking = {m: sorted(set(seeds) - set(per_seed)) for m, per_seed in evals.items() if set(seeds) - set(per_seed)}
        raise ValueError(f"seeds: none of {sorted(set(seeds))} has an evaluation of every model; missing: {lacking}")
    read: dict[Path, dict] = {}  # a folder shared by every seed (the SFT start) is read once

    def questions(folder: Path) -> dict:
        if Path(folder) not in read:
            read[Path(folder)] = per_question_em(Path(folder))
        return read[Path(folder)]

    correct = {m: {s: questions(per_seed[s]) for s in complete} for m, per_seed in evals.items()}
    em = {m: {s: sum(c.values()) / len(c) for s, c in per_seed.items()} for m, per_seed in correct.items()}
    methods = {}
    for m in evals:
        mean, low, high = mean_interval([em[m][s] for s in complete], level)
        methods[m] = {"mean": mean, "ci": [low, high], "per_seed": [em[m][s] for s in complete]}
    rows = []
    for a, b in pairs:
        r = paired_seeds(em[a], em[b], level)
        mcnemar = []
        for s in complete:
            q = paired_em(correct[a][s], correct[b][s])
            mcnemar.append({"seed": s, "n": q.n, "difference": q.difference, "a_only": q.a_only, "b_only": q.b_only,
                            "p": q.p_value})
        rows.append({"a": a, "b": b, "differences": list(r.differences), "mean": r.mean, "ci": list(r.ci),
                     "wins": r.wins, "losses": r.losses, "ties": r.ties, "p": r.p_value,
                     "smallest_possible_p": r.smallest_possible_p, "mcnemar": mcnemar})
    for row, adjusted in zip(rows, holm([row["p"] for row in rows]), strict=True):
        row["holm_p"] = adjusted
    return {"metric": METRIC, "level": level, "seeds": complete,
            "unfinished_seeds": sorted(set(seeds) - set(complete)), "questions": len(next(iter(read.values()))),
            "methods": methods, "comparisons": rows}


def seed_markdown(report: dict) -> str:
    seeds, pct = report["seeds"], f"{report['level']:.0%}"
    n = len(seeds)
    lines = [f"## Across training seeds: {n} seeds ({', '.join(map(str, seeds))})", ""]
    if report["unfinished_seeds"]:
        lines += [f"Declared seeds without every evaluation yet (left out): "
                  f"{', '.join(map(str, report['unfinished_seeds']))}.", ""]
    lines += [f"{report['metric']}, {report['questions']} questions, one training run per method and seed. The "
              f"interval is a {pct} percentile bootstrap across the {n} seeds (with few seeds it is too narrow: read "
              "it as a description).", "",
              f"| model | seeds | mean EM | {pct} CI across seeds | per seed |", "|---|---|---|---|---|"]
    for name, m in report["methods"].items():
        per_seed = ", ".join(f"{v:.3f}" for v in m["per_seed"])
        lines.append(f"| {name} | {n} | {m['mean']:.3f} | {m['ci'][0]:.3f} to {m['ci'][1]:.3f} | {per_seed} |")
    family = len(report["comparisons"])
    lines += ["", f"The {family} comparisons declared in the plan before the first run (A - B, paired by seed): the "
              f"exact two-sided sign-flip test over the 2^{n} sign assignments of the {n} per-seed differences (ties "
              f"count as extreme; the smallest p it can give on {n} seeds is {smallest_sign_flip_p(n):.3g}), and "
              f"Holm's adjustment over the {family}. A claim about the methods rests on these rows.", "",
              f"| A | B | seeds | mean A - B | {pct} CI across seeds | A won / lost / tied | sign-flip p | "
              f"Holm p ({family}) |", "|---|---|---|---|---|---|---|---|"]
    for c in report["comparisons"]:
        lines.append(f"| {c['a']} | {c['b']} | {n} | {c['mean']:+.3f} | {c['ci'][0]:+.3f} to {c['ci'][1]:+.3f} | "
                     f"{c['wins']} / {c['losses']} / {c['ties']} | {format_p(c['p'])} | {format_p(c['holm_p'])} |")
    lines += ["", "Secondary, per seed: McNemar over the questions (exact, two-sided, uncorrected). Its noise is which "
              "questions were drawn, for these two checkpoints; it says nothing about the methods.", "",
              "| A | B | seed | A - B | A right, B wrong | B right, A wrong | McNemar p |",
              "|---|---|---|---|---|---|---|"]
    for c in report["comparisons"]:
        for q in c["mcnemar"]:
            lines.append(f"| {c['a']} | {c['b']} | {q['seed']} | {q['difference']:+.3f} | {q['a_only']} | "
                         f"{q['b_only']} | {format_p(q['p'])} |")
    return "\n".join(lines) + "\n"


def write_seed_report(folder: Path, evals: Mapping[str, Mapping[int, Path]], plan: dict | None = None) -> Path:
    """<folder>/seeds.md and seeds.json from the evaluations and the plan (read from <folder>/plan.json unless
    given); returns the markdown's path."""
    plan = plan if plan is not None else read_plan(folder)
    report = seed_report(evals, [tuple(p) for p in plan["comparisons"]], plan["seeds"])
    folder = Path(folder)
    (folder / "seeds.json").write_text(json.dumps(report, indent=1) + "\n")
    path = folder / "seeds.md"
    path.write_text(seed_markdown(report))
    return path

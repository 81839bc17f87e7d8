"""The sweep's results -> tables with 95% intervals across seeds, paired comparisons, plots, summary.md.

The unit of inference is the training seed (eval/seed_stats.py, shared with `emapg compare --seeds`).
Per (lr, beta, method), over seeds: mean and 95% bootstrap interval of the held-out greedy EM (final reward), the
area under the training reward curve, the two-hop EM; the collapse rate with a Wilson interval; the KL-gradient
variance of k3 and of Top-k at the same states (geometric mean of their ratio, bootstrap interval on the log scale).
Paired, per (lr, beta): method A - method B on the same seeds (same prompts and sampling seeds), mean difference,
bootstrap interval, the exact sign-flip p (never below 2 / 2^seeds: 0.0625 on 5), seeds won / lost / tied, and the
p value Holm-adjusted over every comparison the summary reports (the study declared no primary comparison, so the
family is all of them: points x method pairs x metrics, 60 in the full sweep).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from itertools import combinations
from pathlib import Path

import numpy as np
from scipy import stats

from eval.harness import wilson_interval
from eval.seed_stats import format_p, holm, mean_interval, paired_seeds
from experiments.mechanism.cell import smoothed

METRICS = {  # name -> (label, how to read it off a result)
    "em": ("held-out EM", lambda r: r["final"]["em"]),
    "auc": ("reward AUC", lambda r: r["auc"]),
    "final_train": ("final train reward", lambda r: r["final_train_reward"]),
    "em_two_hop": ("two-hop EM", lambda r: r["final"].get("em_birth_country", 0.0)),
}


def load_results(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "cells").glob("*/result.json"))]


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): 95% bootstrap interval across seeds; the bounds are nan with fewer than two values."""
    if len(values) < 2:
        return (float(values[0]) if values else math.nan), math.nan, math.nan
    return mean_interval(values)


def geometric_mean_ci(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of positive ratios with its 95% interval, computed on log10 (ratios span decades)."""
    logs = [math.log10(r) for r in ratios if r > 0 and math.isfinite(r)]
    if not logs:
        return math.nan, math.nan, math.nan
    return tuple(10**v if not math.isnan(v) else math.nan for v in mean_ci(logs))  # type: ignore[return-value]


def paired(a: dict[int, float], b: dict[int, float]) -> dict:
    """A - B over the seeds both have (an unfinished sweep pairs what it has): mean, 95% bootstrap interval, exact
    sign-flip p and the smallest it could be on these seeds, seeds A won, lost and tied."""
    seeds = sorted(set(a) & set(b))
    r = paired_seeds({s: a[s] for s in seeds}, {s: b[s] for s in seeds})
    low, high = r.ci if len(seeds) >= 2 else (math.nan, math.nan)
    return {"n": len(seeds), "mean": r.mean, "low": low, "high": high, "p": r.p_value,
            "smallest_p": r.smallest_possible_p, "wins": r.wins, "losses": r.losses, "ties": r.ties}


def fmt(mean: float, low: float, high: float, digits: int = 3) -> str:
    if math.isnan(low):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def group(results: list[dict]) -> dict[tuple[float, float, str], list[dict]]:
    groups: dict[tuple[float, float, str], list[dict]] = defaultdict(list)
    for r in results:
        groups[(r["lr"], r["beta"], r["method"])].append(r)
    return dict(sorted(groups.items()))


def summarise(results: list[dict], methods: list[str]) -> dict:
    """Per-cell statistics and paired comparisons, as JSON-ready dicts."""
    cells = []
    for (lr, beta, method), runs in group(results).items():
        row = {"lr": lr, "beta": beta, "method": method, "n": len(runs)}
        for name, (_, read) in METRICS.items():
            row[name] = mean_ci([read(r) for r in runs])
        collapsed = sum(r["collapsed"] for r in runs)
        row["collapsed"] = (collapsed, *wilson_interval(collapsed, len(runs)))
        # A run whose policy still equals its anchor (a first iteration at lr 0 under warm-up) has no KL-gradient
        # variance to compare: its ratio is undefined, not infinite.
        diagnosed = [r["kl_gradient"] for r in runs if r.get("kl_gradient") and r["kl_gradient"]["variance_topk"] > 0
                     and r["kl_gradient"].get("variance_median_topk", 1.0) > 0]
        if diagnosed:
            row["variance_k3"] = float(np.mean([d["variance_k3"] for d in diagnosed]))
            row["variance_topk"] = float(np.mean([d["variance_topk"] for d in diagnosed]))
            row["variance_ratio"] = geometric_mean_ci([d["variance_k3"] / d["variance_topk"] for d in diagnosed])
            row["median_variance_ratio"] = geometric_mean_ci(
                [d["variance_median_k3"] / d["variance_median_topk"] for d in diagnosed if "variance_median_k3" in d])
        cells.append(row)
    comparisons = []
    by_point: dict[tuple[float, float], dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in results:
        by_point[(r["lr"], r["beta"])][r["method"]][r["seed"]] = r
    for (lr, beta), per_method in sorted(by_point.items()):
        present = [m for m in methods if m in per_method]
        for a, b in combinations(reversed(present), 2):  # EMA-PG first: the claim is that it is better
            if not set(per_method[a]) & set(per_method[b]):
                continue  # an unfinished sweep: no seed of both yet
            for name, (_, read) in METRICS.items():
                comparisons.append({"lr": lr, "beta": beta, "a": a, "b": b, "metric": name,
                                    **paired({s: read(r) for s, r in per_method[a].items()},
                                             {s: read(r) for s, r in per_method[b].items()})})
    for comparison, adjusted in zip(comparisons, holm([c["p"] for c in comparisons]), strict=True):
        comparison["holm_p"] = adjusted
    hours = sum(r.get("train_seconds", 0) + r.get("measure_seconds", 0) for r in results) / 3600
    return {"cells": cells, "comparisons": comparisons, "runs": len(results), "run_hours": hours}


def ratio(values: tuple[float, float, float]) -> str:
    mean, low, high = values
    return f"{mean:.3g}" if math.isnan(low) else f"{mean:.3g} [{low:.3g}, {high:.3g}]"


def markdown(summary: dict, sft_eval: dict | None) -> str:
    lines = ["# Mechanism study: results", ""]
    if sft_eval:
        lines += [f"SFT start (shared by every run): held-out EM {sft_eval['em']:.3f}, two-hop EM "
                  f"{sft_eval.get('em_birth_country', 0):.3f}, searches {sft_eval['searches']:.2f} (n = {sft_eval['n']:.0f}).", ""]
    lines += [f"{summary['runs']} runs, {summary['run_hours']:.2f} h of training and measuring in all (the shared SFT "
              "and the server's start not counted).", ""]
    lines += ["Means over seeds with 95% bootstrap intervals across seeds (percentile; with 5 seeds too narrow, a "
              "description rather than a test); collapse k/n with a Wilson interval; KL-gradient variance: the exact "
              "variance of one token's KL gradient (logit space) at 128 states of the run's last rollouts, against the run's "
              "own anchor, averaged over states and then runs; k3 / Top-k: geometric mean over runs of that ratio, and of "
              "the ratio of the median states.", "",
              "| lr | beta | method | seeds | held-out EM | reward AUC | final train reward | two-hop EM | collapsed | "
              "var k3 | var Top-k | k3 / Top-k | median-state k3 / Top-k |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in summary["cells"]:
        k, low, high = c["collapsed"]
        var = (f"{c['variance_k3']:.3g} | {c['variance_topk']:.3g} | {ratio(c['variance_ratio'])} | "
               f"{ratio(c['median_variance_ratio'])}" if "variance_k3" in c else "- | - | - | -")
        lines.append(f"| {c['lr']:g} | {c['beta']:g} | {c['method']} | {c['n']} | {fmt(*c['em'])} | {fmt(*c['auc'])} | "
                     f"{fmt(*c['final_train'])} | {fmt(*c['em_two_hop'])} | {k}/{c['n']} [{low:.2f}, {high:.2f}] | {var} |")
    family = len(summary["comparisons"])
    floor = min((d["smallest_p"] for d in summary["comparisons"]), default=math.nan)
    lines += ["", f"Paired by seed (A - B), across the seeds both have: mean difference [95% bootstrap interval], the "
              f"exact two-sided sign-flip p over every sign assignment of the per-seed differences (the smallest it "
              f"can give here is {format_p(floor)}), that p Holm-adjusted over all {family} comparisons below (no "
              "primary comparison was declared), and seeds A won / lost / tied.", "",
              "| lr | beta | A - B | metric | seeds | difference | sign-flip p | Holm p | A won / lost / tied |",
              "|---|---|---|---|---|---|---|---|---|"]
    for d in summary["comparisons"]:
        lines.append(f"| {d['lr']:g} | {d['beta']:g} | {d['a']} - {d['b']} | {METRICS[d['metric']][0]} | {d['n']} | "
                     f"{fmt(d['mean'], d['low'], d['high'])} | {format_p(d['p'])} | {format_p(d['holm_p'])} | "
                     f"{d['wins']} / {d['losses']} / {d['ties']} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], summary: dict, methods: list[str], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    groups = group(results)
    points = sorted({(lr, beta) for lr, beta, _ in groups})
    cols = min(3, len(points))
    rows = math.ceil(len(points) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (lr, beta) in zip(axes.flat, points, strict=False):
        for method in methods:
            runs = groups.get((lr, beta, method), [])
            if not runs:
                continue
            width = min(len(r["curve"]["reward"]) for r in runs)
            curves = np.array([smoothed(r["curve"]["reward"])[:width] for r in runs])
            mean = curves.mean(0)
            ax.plot(np.arange(1, width + 1), mean, color=colors[method], label=f"{method} (n={len(runs)})")
            if len(runs) > 1:
                half = stats.t.ppf(0.975, len(runs) - 1) * curves.std(0, ddof=1) / math.sqrt(len(runs))
                ax.fill_between(np.arange(1, width + 1), mean - half, mean + half, color=colors[method], alpha=0.2)
        ax.set(title=f"lr {lr:g}, beta {beta:g}", xlabel="iteration", ylabel="train reward (mean of 5)", ylim=(0, 1))
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(points):]:
        ax.axis("off")
    fig.tight_layout()
    paths = [out / "curves.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    fig, (ax_em, ax_var) = plt.subplots(1, 2, figsize=(11, 3.8))
    labels = [f"lr {lr:g}\nbeta {beta:g}" for lr, beta in points]
    for i, method in enumerate(methods):
        xs, means, errs, ratio_x, ratios = [], [], [], [], []
        for j, (lr, beta) in enumerate(points):
            cell = next((c for c in summary["cells"] if (c["lr"], c["beta"], c["method"]) == (lr, beta, method)), None)
            if cell is None:
                continue
            mean, low, high = cell["em"]
            xs.append(j + 0.25 * (i - 1))
            means.append(mean)
            errs.append([mean - low if not math.isnan(low) else 0, high - mean if not math.isnan(high) else 0])
            if "variance_ratio" in cell:
                ratio_x.append(j + 0.25 * (i - 1))
                ratios.append(cell["variance_ratio"][0])
        if xs:
            ax_em.errorbar(xs, means, yerr=np.array(errs).T, fmt="o", color=colors[method], capsize=3, label=method)
        if ratios:
            ax_var.bar(ratio_x, ratios, width=0.25, color=colors[method], label=method)
    ax_em.set(title="held-out EM of the final policy (95% CI)", xticks=range(len(points)), xticklabels=labels,
              ylim=(0, 1))
    ax_var.set(title="KL-gradient variance, k3 / Top-k (same states)", xticks=range(len(points)), xticklabels=labels,
               yscale="log")
    ax_em.legend(fontsize=7)
    ax_var.legend(fontsize=7)
    for ax in (ax_em, ax_var):
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    paths.append(out / "final.png")
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths


def analyse(out: Path, methods: list[str]) -> Path | None:
    """summary.json, summary.md and the plots in `out`; None when no cell has finished."""
    results = load_results(out)
    if not results:
        return None
    summary = summarise(results, methods)
    sft_path = out / "sft_eval.json"
    sft_eval = json.loads(sft_path.read_text()) if sft_path.exists() else None
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(results, summary, methods, out)
    path = out / "summary.md"
    path.write_text(markdown(summary, sft_eval))
    return path

"""Stage 2 of a two-hop study: the pre-registered block at the pilot's breaking rate, A - B paired by seed. Study B
(docs/study_b_plan.md, "Stage 2": EMA-PG - GRPO-k3c, the defaults) and Study D (docs/study_d_plan.md: EMA-PG-warmup -
GRPO-k3c-warmup) use it. Works on a block still running: only the seeds where every arm's final evaluation exists
count, the rest are listed.

    python -m experiments.two_hop.study_b --run artifacts/study-b/stage2/two-hop [--a EMA-PG --b GRPO-k3c]

Reads what `emapg compare --seeds` writes (emapg/compare.py): <run>/plan.json, <run>/eval-sft/, and per seed and arm
<run>/seed-<s>/<arm, lower case>/metrics.jsonl (read as the run's history: a resumed run logs iterations again) and
eval-<iteration:04d>/report.json. compare's own seeds.md pools every evaluated question (the primary set and the
generalisation set together): it is not the plan's primary, which is this file's.

    primary      kb-2hop EM at the last iteration, A - B, paired by seed: exact two-sided sign-flip, mean with its
                 95% bootstrap interval (eval/seed_stats.py)
    secondary    Holm over: collapse counts (exact McNemar on the paired indicators, the collapse rule of
                 experiments/two_hop/verdict.py's curve_summary), kb-reworded EM (A - B, sign-flip), and with
                 GRPO-floor run, kb-2hop EM A - GRPO-floor
    reported     the share of kb-2hop questions answered at all, A - B (sign-flip, not in the family); per arm: EM on
                 both sets, collapses, the grad/ probe's means (iterations 2 on: at 1 the anchor is the policy), the
                 EMA anchor's final EM

Writes <run>/study_b.md, study_b.json, em_per_seed.png and train_reward.png.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer

from eval.paired import mcnemar_exact_p
from eval.seed_report import read_plan
from eval.seed_stats import format_p, holm, mean_interval, paired_seeds
from eval.report import EvalReport
from experiments.mechanism.cell import all_finite, curve_summary
from experiments.mechanism.stability import paired_norm_ratio
from experiments.two_hop.analyse import CONFIG, KL_FROM, plot_per_arm
from experiments.two_hop.verdict import PRIMARY, dataset_em
from trainer.run.metrics_log import current_history, read_metrics

GENERALISATION = "kb-reworded"
A, B = "EMA-PG", "GRPO-k3c"  # Study B's primary difference, A - B: the defaults
FLOOR = "GRPO-floor"  # a third arm only if the budget allowed it
GRAD_KEYS = ("grad/pg_norm", "grad/kl_norm", "grad/kl_pg_cosine", "grad/zero_advantage_groups")

app = typer.Typer(add_completion=False)


def finite_mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def run_outcome(run: Path, iterations: int) -> dict | None:
    """One arm at one seed: its final EM on both sets, the collapse verdict and its train-reward curve; None while
    the final evaluation is missing."""
    final = run / f"eval-{iterations:04d}"
    if not (final / "report.json").exists():
        return None
    em = dataset_em(final)
    answered = {row.dataset: row.answered for row in EvalReport.load(final / "report.json").results
                if row.mode == "agent"}
    history = current_history(read_metrics(run / "metrics.jsonl"))
    summary = curve_summary([row["rollout/reward"] for row in history], all_finite(history))
    anchor = run / f"eval-anchor-{iterations:04d}"
    grad = {key: finite_mean([row[key] for row in history if key in row and row["iteration"] >= KL_FROM])
            for key in GRAD_KEYS}
    return {"em": em[PRIMARY], "em_reworded": em[GENERALISATION], "answered": answered[PRIMARY], **summary, "grad": grad,
            "kl_norms": [row.get("grad/kl_norm") for row in history],
            "anchor_em": dataset_em(anchor)[PRIMARY] if (anchor / "report.json").exists() else None,
            "train_reward": [(row["iteration"], row["rollout/reward"]) for row in history]}


def collect(run: Path, iterations: int, a: str = A, b: str = B) -> dict:
    """Every arm at every declared seed (plan.json), the seeds where all arms finished, and the SFT start."""
    plan = read_plan(run)
    arms = [arm for arm in (b, a, FLOOR) if arm in plan["methods"]]
    if a not in arms or b not in arms:
        raise ValueError(f"{run / 'plan.json'}: Stage 2 needs {a} and {b}, the plan has {plan['methods']}")
    outcomes = {arm: {seed: run_outcome(run / f"seed-{seed}" / arm.lower(), iterations) for seed in plan["seeds"]}
                for arm in arms}
    complete = [s for s in plan["seeds"] if all(outcomes[arm][s] is not None for arm in arms)]
    sft = dataset_em(run / "eval-sft") if (run / "eval-sft" / "report.json").exists() else None
    return {"pair": [a, b], "arms": arms, "declared_seeds": plan["seeds"], "seeds": complete,
            "unfinished_seeds": [s for s in plan["seeds"] if s not in complete], "sft": sft,
            "outcomes": {arm: {s: o for s, o in per_seed.items() if s in complete}
                         for arm, per_seed in outcomes.items()}}


def seed_difference(outcomes: dict, a: str, b: str, key: str, seeds: list[int]) -> dict:
    r = paired_seeds({s: outcomes[a][s][key] for s in seeds}, {s: outcomes[b][s][key] for s in seeds})
    return {"name": f"{key}: {a} - {b}", "mean": r.mean, "ci": list(r.ci), "p": r.p_value, "wins": r.wins,
            "losses": r.losses, "ties": r.ties, "smallest_possible_p": r.smallest_possible_p,
            "differences": list(r.differences)}


def collapse_test(outcomes: dict, seeds: list[int], a: str, b: str) -> dict:
    """Exact McNemar on the paired collapse indicators: seeds where only b collapsed against only a."""
    only_b = sum(outcomes[b][s]["collapsed"] and not outcomes[a][s]["collapsed"] for s in seeds)
    only_a = sum(outcomes[a][s]["collapsed"] and not outcomes[b][s]["collapsed"] for s in seeds)
    return {"name": f"collapses: {a} vs {b}", "collapsed": {arm: sum(outcomes[arm][s]["collapsed"] for s in seeds)
                                                           for arm in (a, b)},
            "only_a": only_a, "only_b": only_b, "p": mcnemar_exact_p(only_a, only_b)}


def analyse(run: Path, iterations: int, a: str = A, b: str = B) -> dict:
    """The declared tests of a - b on the finished seeds (None while no seed has finished every arm)."""
    result = collect(run, iterations, a, b)
    seeds, outcomes = result["seeds"], result["outcomes"]
    result["primary"] = seed_difference(outcomes, a, b, "em", seeds) if seeds else None
    # Beside the primary, not tested: a collapsed policy often stops writing answers at all (Study B).
    result["answered"] = seed_difference(outcomes, a, b, "answered", seeds) if seeds else None
    secondary = []
    if seeds:
        secondary = [collapse_test(outcomes, seeds, a, b), seed_difference(outcomes, a, b, "em_reworded", seeds)]
        if FLOOR in result["arms"]:
            secondary.append(seed_difference(outcomes, a, FLOOR, "em", seeds))
        for row, adjusted in zip(secondary, holm([row["p"] for row in secondary]), strict=True):
            row["holm_p"] = adjusted
    result["secondary"] = secondary
    # How hard each arm's KL term pulls at the same seed (reported, not tested): iterations 2-4, and 2 alone (the
    # state both arms share most closely: the same first rollouts, one update apart).
    norms = {arm: {s: outcomes[arm][s]["kl_norms"] for s in seeds} for arm in (a, b)}
    result["pull_ratio"] = {"iterations 2-4": paired_norm_ratio(norms[a], norms[b]),
                            "iteration 2": paired_norm_ratio(norms[a], norms[b], (2,))}
    result["per_arm"] = {}
    for arm in result["arms"]:
        runs = [outcomes[arm][s] for s in seeds]
        summary = {}
        for key in ("em", "em_reworded"):
            mean, low, high = mean_interval([r[key] for r in runs]) if runs else (None, None, None)
            summary[key] = {"mean": mean, "ci": [low, high]}
        summary["collapsed"] = sum(r["collapsed"] for r in runs)
        # A collapse scored as EM 0 is often no answer at all: how many zero-EM runs wrote none
        summary["zero_em_runs"] = sum(r["em"] == 0 for r in runs)
        summary["zero_em_runs_never_answered"] = sum(r["em"] == 0 and r["answered"] == 0 for r in runs)
        summary["grad"] = {key: finite_mean([r["grad"][key] for r in runs if r["grad"][key] is not None])
                           for key in GRAD_KEYS}
        result["per_arm"][arm] = summary
    return result


def readme_effect(pilot: list[tuple[str, str, bool]], stage2: dict | None, a: str = A, b: str = B) -> str:
    """README's evidence-table cell: the pilot's verdicts, (arm, rate, broke) in the order run, until Stage 2 has
    finished every declared seed; then Stage 2's primary (`analyse`'s result)."""
    def verdict(broke: bool) -> str:
        return "broke" if broke else "held"

    text = f"pilot: {b} " + ", ".join(f"{verdict(broke)} at {rate}" for arm, rate, broke in pilot if arm == b)
    text += "".join(f" ({a} {verdict(broke)} there, 1 seed)" for arm, _, broke in pilot if arm == a)
    if stage2 is None:
        return text + "; Stage 2 not run yet"
    done, declared = len(stage2["seeds"]), len(stage2["declared_seeds"])
    if done < declared:
        return text + f"; Stage 2 running ({done} of {declared} seeds)"
    p = stage2["primary"]
    return (f"kb-2hop EM {p['mean']:+.3f} [{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}] (ahead in {p['wins']}, behind in "
            f"{p['losses']} of {done} seeds)")


def number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(result: dict) -> str:
    seeds, (a, b) = result["seeds"], result["pair"]
    lines = [f"# Stage 2: {a} - {b}", "",
             f"Declared seeds {result['declared_seeds']}; finished by every arm: {seeds or 'none'}; unfinished: "
             f"{result['unfinished_seeds'] or 'none'}."]
    if result["sft"] is not None:
        lines.append(f"SFT start: {PRIMARY} EM {result['sft'][PRIMARY]:.3f}, {GENERALISATION} EM "
                     f"{result['sft'][GENERALISATION]:.3f}.")
    primary = result["primary"]
    if primary is None:
        return "\n".join(lines + ["", "No seed has finished every arm: nothing to test yet."]) + "\n"
    answered = result["answered"]
    lines += ["", f"**Primary** ({PRIMARY} EM at the last iteration, {a} - {b}, {len(seeds)} seeds): mean "
              f"{primary['mean']:+.3f}, 95% CI [{primary['ci'][0]:+.3f}, {primary['ci'][1]:+.3f}], exact sign-flip "
              f"p = {format_p(primary['p'])} (smallest possible {format_p(primary['smallest_possible_p'])}); "
              f"wins/losses/ties {primary['wins']}/{primary['losses']}/{primary['ties']}.", "",
              f"Beside it (reported, not tested): the share of {PRIMARY} questions answered at all, {a} - {b}: "
              f"{answered['mean']:+.3f} [{answered['ci'][0]:+.3f}, {answered['ci'][1]:+.3f}], p = "
              f"{format_p(answered['p'])}.", "",
              "| secondary | effect | p | Holm p |", "|---|---|---|---|"]
    for row in result["secondary"]:
        if "collapsed" in row:
            effect = ", ".join(f"{arm} {n}/{len(seeds)}" for arm, n in row["collapsed"].items())
        else:
            effect = f"{row['mean']:+.3f} [{row['ci'][0]:+.3f}, {row['ci'][1]:+.3f}]"
        lines.append(f"| {row['name']} | {effect} | {format_p(row['p'])} | {format_p(row['holm_p'])} |")
    lines += ["", "| arm | seed | kb-2hop EM | kb-reworded EM | anchor kb-2hop EM | collapsed | smoothed final / peak "
              "reward |", "|---|---|---|---|---|---|---|"]
    for arm in result["arms"]:
        for s in seeds:
            o = result["outcomes"][arm][s]
            lines.append(f"| {arm} | {s} | {o['em']:.3f} | {o['em_reworded']:.3f} | {number(o['anchor_em'])} | "
                         f"{'yes' if o['collapsed'] else 'no'} | {o['final_train_reward']:.3f} / "
                         f"{o['peak_train_reward']:.3f} |")
    lines += ["", f"| arm | kb-2hop EM (95% CI) | kb-reworded EM (95% CI) | collapses | "
              + " | ".join(GRAD_KEYS) + " |", "|---|---|---|---|" + "---|" * len(GRAD_KEYS)]
    for arm, s in result["per_arm"].items():
        cells = [f"{number(s[k]['mean'])} [{number(s[k]['ci'][0])}, {number(s[k]['ci'][1])}]"
                 for k in ("em", "em_reworded")]
        lines.append(f"| {arm} | {cells[0]} | {cells[1]} | {s['collapsed']}/{len(seeds)} | "
                     + " | ".join(number(s["grad"][k], 4) for k in GRAD_KEYS) + " |")
    lines += ["", f"grad/ columns: each run's mean over iterations {KL_FROM} on (finite values), then the mean over "
              "seeds. Plots: em_per_seed.png (both sets, a dot per seed, seeds joined across arms), train_reward.png."]
    return "\n".join(lines) + "\n"


def plot_em_per_seed(result: dict, path: Path) -> None:
    """Per set, a dot per seed and arm, each seed's dots joined across arms (the pairing); the SFT start dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = result["arms"]
    fig, axes = plt.subplots(1, 2, figsize=(2 + 3 * len(arms), 3.8), sharey=True)
    for ax, (key, dataset) in zip(axes, (("em", PRIMARY), ("em_reworded", GENERALISATION)), strict=True):
        for i, s in enumerate(result["seeds"]):
            ys = [result["outcomes"][arm][s][key] for arm in arms]
            ax.plot(range(len(arms)), ys, color=f"C{i % 10}", alpha=0.35, marker="o", label=f"seed {s}")
        if result["sft"] is not None:
            ax.axhline(result["sft"][dataset], color="grey", linestyle="--", label="SFT start")
        ax.set_xticks(range(len(arms)), arms)
        ax.set(title=f"{dataset} EM, last iteration", ylim=(-0.02, 1.02))
    axes[0].set_ylabel("held-out EM")
    axes[-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@app.command()
def main(
    run: Annotated[Path, typer.Option(help="the block's compare run folder (<out_dir>/two-hop)")] = Path(
        "artifacts/study-b/stage2/two-hop"),
    config: Annotated[Path, typer.Option(help="the study's run config (its train.iterations is the last)")] = CONFIG,
    a: Annotated[str, typer.Option(help="the primary's first arm (A in A - B)")] = A,
    b: Annotated[str, typer.Option(help="the primary's second arm")] = B,
    name: Annotated[str, typer.Option(help="the reports' file name: <run>/<name>.md and .json")] = "study_b",
) -> None:
    """Stage 2 of a two-hop study: the declared primary and secondary tests, per-seed outcomes and plots."""
    from trainer.config import load_config

    try:
        result = analyse(run, load_config(config).train.iterations, a, b)
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from e
    curves = {arm: {s: result["outcomes"][arm][s]["train_reward"] for s in result["seeds"]} for arm in result["arms"]}
    (run / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (run / f"{name}.md").write_text(markdown(result))
    if result["seeds"]:
        plot_em_per_seed(result, run / "em_per_seed.png")
        plot_per_arm(curves, run / "train_reward.png", "train reward", "train reward (bold: mean of seeds)")
    print(markdown(result))

if __name__ == "__main__":
    app()

"""The two-hop study's own analysis, beside the primary test (docs/study_two_hop_plan.md, "Outcomes and tests",
"Reporting"). Works on a study still running: only the runs whose final evaluation exists count, the rest are listed.

    python -m experiments.two_hop.analyse --out artifacts/two-hop

Reads what `emapg compare --seeds` writes in <out>/two-hop (emapg/compare.py):
    eval-sft/                               the SFT start's evaluation (shared by every arm and seed)
    seed-<s>/<arm, lower case>/metrics.jsonl  one line per iteration (a resumed run repeats some; read
                                            through trainer.run.metrics_log.current_history)
    seed-<s>/<arm>/eval-<iteration:04d>/    report.json + trajectories/kb-2hop.agent.jsonl (eval/harness.py)
    seed-<s>/<arm>/eval-anchor-<iteration>/ the EMA arms' anchors (counted in machine time only)
and the KB's test questions, with their bridge city, in <out>/kb/questions-test.jsonl.

Writes <out>/two-hop/study.md, study.json, em_per_seed.png, kl_grad_share.png and train_reward.png:
    1. per arm and seed, the final held-out two-hop EM (greedy); the SFT start's
    2. the secondary outcome: the share of two-hop trajectories whose second search names the bridge city, the share
       that search twice or more, and the repeated-search rate (agent/diagnostics.py); per arm the mean over seeds
       with a 95% bootstrap interval across seeds (eval/seed_stats.py)
    3. kl/grad_share per arm (iterations 2 to the last), and over iterations
    4. machine time per run: its logged phases (`time/*`) and its evaluations' seconds
    5. exploratory, added after the final EM was seen at its ceiling: the train reward's mean over the first half of
       the iterations and the first iteration at train reward 1.0, with the plan's comparisons on the former
       (sign-flip p, uncorrected)
The primary test (exact sign-flip + Holm over the declared family) is seeds.md's (eval/seed_report.py): not redone.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Annotated

import typer

from agent.diagnostics import repeated_search_rates
from agent.trajectory import Trajectory, load_jsonl
from data.qa import normalize_question
from eval.report import EvalReport
from eval.seed_report import PLAN_FILE, read_plan
from eval.seed_stats import format_p, mean_interval, paired_seeds
from experiments.two_hop.calibrate import mean_share
from trainer.methods import STUDIES
from trainer.run.metrics_log import current_history, read_metrics

app = typer.Typer(add_completion=False)

NAME = "two-hop"  # configs/two_hop.yaml's name: the compare run folder is <out>/<NAME>
CONFIG = Path("configs/two_hop.yaml")
ARMS = STUDIES["two-hop"]  # the plan's arms, in its order
SFT = "SFT"
DATASET, MODE = "kb-2hop", "agent"  # the evaluation set kb-2hop:test, as eval/harness.py names its files
TWO_HOP = "birth_country"  # experiments/mechanism/kb.py's two-hop kind
KL_FROM = 2  # at iteration 1 the anchor equals the policy: every KL gradient is exactly 0 (the plan's beta rule)
SECONDARY = ("bridge_second_search", "two_searches", "repeated_search_rate")
SECONDARY_TITLES = {"bridge_second_search": "2nd search names the bridge", "two_searches": ">= 2 searches",
                    "repeated_search_rate": "repeated searches / searches"}


# --- pure functions over trajectories ------------------------------------------------------------------------

def search_queries(trajectory: Trajectory) -> list[str]:
    """The queries of the trajectory's search turns, in order (a search turn without a query counts as "")."""
    return [turn.query or "" for turn in trajectory.turns if turn.kind == "search"]


def second_search_query(trajectory: Trajectory) -> str | None:
    """The query of the trajectory's second search turn, None if it searched fewer than twice."""
    queries = search_queries(trajectory)
    return queries[1] if len(queries) >= 2 else None


def contains_number(text: str, number: str) -> bool:
    """`number` written in `text` as a whole number: not as part of a longer run of digits. The KB's entities are
    distinct 4-digit numbers (kb.py), so "16317" or "63170" is another number, not city 6317; letters or punctuation
    around it ("city6317?") do not matter."""
    return re.search(rf"(?<!\d){re.escape(number)}(?!\d)", text) is not None


def names_bridge(trajectory: Trajectory, bridge: str) -> bool:
    """The plan's secondary outcome for one two-hop trajectory: its second search's query names the bridge city."""
    query = second_search_query(trajectory)
    return query is not None and contains_number(query, bridge)


def question_key(question: str) -> str:
    """Questions are matched by text: the evaluation set's ids (kb-2hop/test/<position>) are not the KB's
    (kb-birth_country/test/<index>). Both sides are normalised as data.qa loads them."""
    return normalize_question(question)


def bridge_of(trajectory: Trajectory, bridges: dict[str, str]) -> str:
    key = question_key(trajectory.question)
    if key not in bridges:
        raise KeyError(f"{trajectory.uid}: the question {trajectory.question!r} is not a two-hop question of the KB")
    return bridges[key]


def search_outcomes(trajectories: list[Trajectory], bridges: dict[str, str]) -> dict[str, float | int]:
    """The secondary outcome over one evaluation's two-hop trajectories: shares of all of them (n)."""
    n = len(trajectories)
    named = sum(names_bridge(t, bridge_of(t, bridges)) for t in trajectories)
    twice = sum(len(search_queries(t)) >= 2 for t in trajectories)
    repeated, with_repeat = repeated_search_rates(trajectories)
    return {"n": n,
            "bridge_second_search": named / max(1, n),
            "two_searches": twice / max(1, n),
            # Of those that searched twice: does the second search go where the first pointed?
            "bridge_given_two_searches": named / twice if twice else None,
            "repeated_search_rate": repeated,  # repeated searches / all searches, as rollout/repeated_search_rate
            "repeated_trajectory_rate": with_repeat}  # trajectories with at least one repeated search


# --- pure functions over metrics -----------------------------------------------------------------------------

def mean_grad_share(metrics: list[dict]) -> float | None:
    """kl/grad_share averaged over iterations KL_FROM.. (the run's history), leaving out those without a
    policy gradient (an infinite share) as the calibration does; None when no such share is logged."""
    shares = [m["kl/grad_share"] for m in current_history(metrics)
              if m["iteration"] >= KL_FROM and m.get("kl/grad_share") is not None]
    value = mean_share(shares)
    return None if math.isnan(value) else value


def finite_grad_shares(metrics: list[dict]) -> list[tuple[int, float]]:
    """(iteration, kl/grad_share) for each iteration with a policy gradient (a finite share), from the run's history."""
    return [(m["iteration"], m["kl/grad_share"]) for m in current_history(metrics)
            if m.get("kl/grad_share") is not None and math.isfinite(m["kl/grad_share"])]


def finite_grad_share_count(metrics: list[dict]) -> int:
    """How many iterations from KL_FROM the mean above rests on: a saturated reward leaves most with no policy
    gradient, so a run's mean can be one iteration's share."""
    return sum(1 for iteration, _ in finite_grad_shares(metrics) if iteration >= KL_FROM)


def reward_curve(metrics: list[dict]) -> list[tuple[int, float]]:
    """(iteration, train reward) for each iteration of the run's history."""
    return [(m["iteration"], m["rollout/reward"]) for m in current_history(metrics) if "rollout/reward" in m]


def training_seconds(metrics: list[dict]) -> float:
    """The run's logged phases (`time/*`), every line: a resumed run's repeated iterations were machine time too
    (emapg/compare.py's work_minutes counts them the same way)."""
    return sum(value for m in metrics for key, value in m.items() if key.startswith("time/"))


def learning_speed(metrics: list[dict], early: int) -> dict:
    """Exploratory, not in the plan (it was added once the final EM was seen at its ceiling): the train reward's
    mean over iterations 1..`early` (None unless each was logged), and the first iteration whose train reward is
    1.0 (None if none)."""
    rewards = dict(reward_curve(metrics))
    window = [rewards[i] for i in range(1, early + 1) if i in rewards]
    return {"early_reward": sum(window) / early if len(window) == early else None,
            "first_full_reward": next((i for i in sorted(rewards) if rewards[i] >= 1.0), None)}


def summary(values: list[float]) -> dict:
    """Mean across seeds with its 95% percentile bootstrap interval (eval/seed_stats.py); empty when no seed."""
    if not values:
        return {"seeds": 0, "mean": None, "ci": None}
    mean, low, high = mean_interval(values)
    return {"seeds": len(values), "mean": mean, "ci": [low, high]}


# --- reading the study folder --------------------------------------------------------------------------------

def load_bridges(path: Path) -> dict[str, str]:
    """Two-hop question text -> its bridge city, from the KB's questions (kb.py's KBQuestion rows)."""
    from experiments.mechanism.kb import load_questions

    bridges: dict[str, str] = {}
    for q in load_questions(path):
        if q.kind != TWO_HOP:
            continue
        key = question_key(q.example.question)
        # A person drawn twice asks the same question twice: same person, same city, so the same bridge.
        if bridges.setdefault(key, q.bridge) != q.bridge:
            raise ValueError(f"{path}: {key!r} has two bridges, {bridges[key]} and {q.bridge}")
    return bridges


def run_dir(study: Path, seed: int, arm: str) -> Path:
    """emapg/compare.py's seed_config + variant_config: <run>/seed-<s>/<method name lowercased>."""
    return study / f"seed-{seed}" / arm.lower()


def final_eval_dir(folder: Path, iterations: int) -> Path:
    return folder / f"eval-{iterations:04d}"


def is_finished(eval_dir: Path) -> bool:
    return (eval_dir / "report.json").exists()


def two_hop_em(eval_dir: Path) -> tuple[float, int]:
    """(EM, n) of the evaluation's kb-2hop row in agent mode (report.json, as eval/harness.py scored it)."""
    report = EvalReport.load(eval_dir / "report.json")
    rows = [r for r in report.results if r.dataset == DATASET and r.mode == MODE]
    if len(rows) != 1:
        raise ValueError(f"{eval_dir / 'report.json'}: expected one {DATASET} row in {MODE} mode, found {len(rows)}")
    return rows[0].em, rows[0].n


def two_hop_trajectories(eval_dir: Path) -> list[Trajectory]:
    return list(load_jsonl(eval_dir / "trajectories" / f"{DATASET}.{MODE}.jsonl"))


def evaluation_seconds(folder: Path) -> float:
    """Every evaluation in a run folder (eval-*/ and eval-anchor-*/): their report.json "seconds"."""
    return sum(EvalReport.load(path).seconds for path in sorted(folder.glob("eval-*/report.json")))


def evaluation_row(eval_dir: Path, bridges: dict[str, str]) -> dict:
    em, n = two_hop_em(eval_dir)
    return {"em": em, "em_n": n, **search_outcomes(two_hop_trajectories(eval_dir), bridges)}


def declared(study: Path) -> tuple[list[str], list[int], list[tuple[str, str]]]:
    """The arms, seeds and comparisons of the study: plan.json's (eval/seed_report.py) where it exists, else the
    plan's five arms and no comparison; seeds found on disk are added (a process may have started a seed after
    plan.json was read)."""
    arms, seeds, comparisons = list(ARMS), set(), []
    if (study / PLAN_FILE).exists():
        plan = read_plan(study)
        # plan.json lists the SFT start and the anchors ("EMA-PG anchor") among its models: keep the arms.
        arms = [m for m in plan["methods"] if m != SFT and not m.endswith(" anchor")]
        seeds = set(plan["seeds"])
        comparisons = [tuple(pair) for pair in plan["comparisons"]]
    seeds |= {int(p.name.removeprefix("seed-")) for p in study.glob("seed-*") if p.name.removeprefix("seed-").isdigit()}
    return arms, sorted(seeds), comparisons


def speed_comparisons(runs: list[dict], comparisons: list[tuple[str, str]]) -> list[dict]:
    """Exploratory: the plan's comparisons on the early train reward, paired by seed (both finished), with the
    exact sign-flip p. Not Holm-corrected and not a claim: the outcome was chosen after a result was seen."""
    by_arm = {}
    for r in runs:
        if r["finished"] and r["early_reward"] is not None:
            by_arm.setdefault(r["arm"], {})[r["seed"]] = r["early_reward"]
    rows = []
    for a, b in comparisons:
        seeds = sorted(by_arm.get(a, {}).keys() & by_arm.get(b, {}).keys())
        if not seeds:
            continue
        c = paired_seeds({s: by_arm[a][s] for s in seeds}, {s: by_arm[b][s] for s in seeds})
        rows.append({"a": a, "b": b, "seeds": list(c.seeds), "mean": c.mean, "ci": list(c.ci), "p": c.p_value,
                     "wins": c.wins, "losses": c.losses, "ties": c.ties})
    return rows


def collect(out: Path, iterations: int) -> dict:
    """Everything the report says, from the study folder `out` (prepare's --out): a JSON-ready dict."""
    study = out / NAME
    bridges = load_bridges(out / "kb" / "questions-test.jsonl")
    arms, seeds, comparisons = declared(study)
    sft_dir = study / "eval-sft"
    sft = evaluation_row(sft_dir, bridges) if is_finished(sft_dir) else None
    runs, curves, rewards = [], {arm: {} for arm in arms}, {arm: {} for arm in arms}
    for arm in arms:
        for seed in seeds:
            folder = run_dir(study, seed, arm)
            metrics = read_metrics(folder / "metrics.jsonl")
            final = final_eval_dir(folder, iterations)
            row = {"arm": arm, "seed": seed, "finished": is_finished(final), "started": folder.exists(),
                   "iterations_logged": len(current_history(metrics)),
                   "training_s": training_seconds(metrics), "evaluation_s": evaluation_seconds(folder),
                   **learning_speed(metrics, early=iterations // 2)}
            if row["finished"]:
                row |= evaluation_row(final, bridges)
                row["kl_grad_share"] = mean_grad_share(metrics)
                row["kl_grad_share_finite"] = finite_grad_share_count(metrics)
                curves[arm][seed] = finite_grad_shares(metrics)
                rewards[arm][seed] = reward_curve(metrics)
            runs.append(row)
    per_arm = {}
    for arm in arms:
        done = [r for r in runs if r["arm"] == arm and r["finished"]]
        per_arm[arm] = {"seeds": [r["seed"] for r in done],
                        "missing_seeds": [r["seed"] for r in runs if r["arm"] == arm and not r["finished"]],
                        "em": summary([r["em"] for r in done]),
                        **{key: summary([r[key] for r in done]) for key in SECONDARY},
                        "kl_grad_share": summary([r["kl_grad_share"] for r in done if r["kl_grad_share"] is not None]),
                        "early_reward": summary([r["early_reward"] for r in done if r["early_reward"] is not None])}
    sft_metrics = read_metrics(study / "sft" / "metrics.jsonl")
    sft_time = {"training_s": training_seconds(sft_metrics),
                "evaluation_s": EvalReport.load(sft_dir / "report.json").seconds if sft else 0.0}
    total_s = sum(r["training_s"] + r["evaluation_s"] for r in runs) + sft_time["training_s"] + sft_time["evaluation_s"]
    return {"study": str(study), "final_iteration": iterations, "arms": arms, "seeds": seeds, "sft": sft,
            "sft_time": sft_time, "runs": runs, "per_arm": per_arm, "kl_grad_share_curves": curves,
            "train_reward_curves": rewards,
            "speed_comparisons": speed_comparisons(runs, comparisons),
            "machine_hours": total_s / 3600}


# --- the report ----------------------------------------------------------------------------------------------

def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def fmt_summary(s: dict, digits: int = 3) -> str:
    if s["mean"] is None:
        return "-"
    return f"{s['mean']:.{digits}f} [{s['ci'][0]:.{digits}f}, {s['ci'][1]:.{digits}f}]"


def per_seed_list(rows: list[dict], key: str) -> str:
    return ", ".join(f"{r['seed']}: {r[key]:.3f}" for r in rows) or "-"


def missing_lines(result: dict) -> list[str]:
    missing = {arm: a["missing_seeds"] for arm, a in result["per_arm"].items() if a["missing_seeds"]}
    if not missing and result["sft"] is not None:
        return ["Every declared run has its final evaluation."]
    lines = ["Missing (no final evaluation yet, left out of every number below):", ""]
    if result["sft"] is None:
        lines.append("- the SFT start's evaluation (eval-sft)")
    lines += [f"- {arm}: seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
              for arm, seeds in missing.items()]
    return lines


def markdown(result: dict) -> str:
    sft, per_arm = result["sft"], result["per_arm"]
    finished = [r for r in result["runs"] if r["finished"]]
    lines = ["# Two-hop study: per-seed results and the secondary outcome", "",
             (f"`{result['study']}`, final iteration {result['final_iteration']}; declared seeds "
              f"{', '.join(map(str, result['seeds'])) or 'none'}; {len(finished)} of {len(result['runs'])} runs "
              "finished. The primary test (sign-flip + Holm over the declared comparisons) is in seeds.md."), "",
             *missing_lines(result), "",
             "## Held-out two-hop EM (kb-2hop, greedy, final iteration)", "",
             "Mean over seeds, 95% percentile bootstrap interval across seeds.", "",
             "| arm | seeds | EM mean [95% CI] | per seed |", "|---|---|---|---|"]
    if sft is not None:
        lines.append(f"| {SFT} (start) | - | {sft['em']:.3f} | (one model) |")
    for arm, a in per_arm.items():
        seeds = [r for r in finished if r["arm"] == arm]
        lines.append(f"| {arm} | {len(seeds)} | {fmt_summary(a['em'])} | "
                     f"{per_seed_list(seeds, 'em')} |")
    lines += ["", "## Secondary outcome: the second search", "",
              ("Shares of the final evaluation's two-hop trajectories: the second search turn's query names the bridge "
               "city's number (as a whole number: kb.py's entities are 4 digits), the trajectory searched at least "
               "twice; and repeated searches over all searches (agent/diagnostics.py). Mean over seeds [95% bootstrap "
               "interval across seeds]."), "",
              "| arm | seeds | " + " | ".join(SECONDARY_TITLES[k] for k in SECONDARY) + " |",
              "|---|---|" + "---|" * len(SECONDARY)]
    if sft is not None:
        lines.append(f"| {SFT} (start) | - | " + " | ".join(f"{sft[k]:.3f}" for k in SECONDARY) + " |")
    for arm, a in per_arm.items():
        lines.append(f"| {arm} | {a['em']['seeds']} | " + " | ".join(fmt_summary(a[k]) for k in SECONDARY) + " |")
    lines += ["", "## Per run", "",
              (f"kl/grad_share: mean over iterations {KL_FROM}-{result['final_iteration']} (at iteration 1 the anchor "
               "equals the policy and the KL gradient is 0), over the iterations with a policy gradient, their "
               "number in brackets (the others' share is infinite: every group of the measured micro-batch had equal "
               "rewards). Bridge | 2 searches: the second search names the bridge, of those that searched twice. "
               "Machine time: the logged phases (`time/*`) plus every evaluation's "
               "seconds (unfinished runs included)."), "",
              ("| arm | seed | iterations logged | EM | 2nd search names bridge | >= 2 searches | bridge \\| 2 searches | "
               "repeated searches | kl/grad_share | machine h |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        if not r["started"]:
            continue
        hours = (r["training_s"] + r["evaluation_s"]) / 3600
        if r["finished"]:
            lines.append(f"| {r['arm']} | {r['seed']} | {r['iterations_logged']} | {r['em']:.3f} | "
                         f"{r['bridge_second_search']:.3f} | {r['two_searches']:.3f} | "
                         f"{fmt(r['bridge_given_two_searches'])} | {r['repeated_search_rate']:.3f} | "
                         f"{fmt(r['kl_grad_share'], 4)} ({r['kl_grad_share_finite']}) | {hours:.2f} |")
        else:
            lines.append(f"| {r['arm']} | {r['seed']} | {r['iterations_logged']} | unfinished | | | | | | "
                         f"{hours:.2f} |")
    lines += ["", "## kl/grad_share per arm", "",
              "| arm | seeds | mean over iterations and seeds [95% CI across seeds] |", "|---|---|---|"]
    lines += [f"| {arm} | {a['kl_grad_share']['seeds']} | {fmt_summary(a['kl_grad_share'], 4)} |"
              for arm, a in per_arm.items()]
    early = result["final_iteration"] // 2
    lines += ["", "## Exploratory: how fast the train reward rose", "",
              (f"Not in the plan: added once the final EM was seen at its ceiling. Early reward: the train reward's "
               f"mean over iterations 1-{early}. The comparisons are the plan's, paired by seed, with the exact "
               "sign-flip p, not Holm-corrected: they describe, they do not decide."), "",
              "| arm | seeds | early reward [95% CI across seeds] | first iteration at train reward 1.0, per seed |",
              "|---|---|---|---|"]
    for arm, a in per_arm.items():
        firsts = ", ".join(f"{r['seed']}: {r['first_full_reward'] or '-'}" for r in finished if r["arm"] == arm)
        lines.append(f"| {arm} | {a['early_reward']['seeds']} | {fmt_summary(a['early_reward'])} | {firsts or '-'} |")
    lines += ["", "| A - B | seeds | mean [95% CI] | wins / losses / ties | sign-flip p |", "|---|---|---|---|---|"]
    lines += [f"| {c['a']} - {c['b']} | {len(c['seeds'])} | {c['mean']:+.3f} [{c['ci'][0]:+.3f}, {c['ci'][1]:+.3f}] | "
              f"{c['wins']} / {c['losses']} / {c['ties']} | {format_p(c['p'])} |" for c in result["speed_comparisons"]]
    t = result["sft_time"]
    lines += ["", "## Machine time", "",
              (f"SFT start: training {t['training_s'] / 3600:.2f} h, evaluation {t['evaluation_s'] / 3600:.2f} h. "
               f"Total, every run made (finished or not) and the SFT start: {result['machine_hours']:.2f} h."), "",
              ("Plots: em_per_seed.png (final two-hop EM per seed and arm, seeds joined across arms; the SFT start "
               "dashed), kl_grad_share.png and train_reward.png (per arm: bold the mean across seeds, thin each seed).")]
    return "\n".join(lines) + "\n"


def plot_em_per_seed(result: dict, path: Path) -> None:
    """Per-seed final EM per arm: a dot per seed, each seed's dots joined faintly across arms (the pairing); the
    arm's mean as a short bar; the SFT start as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = result["arms"]
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(arms), 3.8))
    for i, seed in enumerate(result["seeds"]):
        points = [(x, r["em"]) for x, arm in enumerate(arms) for r in result["runs"]
                  if r["arm"] == arm and r["seed"] == seed and r["finished"]]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, color=f"C{i % 10}", alpha=0.3, linewidth=1)
            ax.scatter(xs, ys, color=f"C{i % 10}", s=22, zorder=3, label=f"seed {seed}")
    for x, arm in enumerate(arms):
        mean = result["per_arm"][arm]["em"]["mean"]
        if mean is not None:
            ax.hlines(mean, x - 0.25, x + 0.25, color="black", linewidth=2, zorder=4)
    if result["sft"] is not None:
        ax.axhline(result["sft"]["em"], color="grey", linestyle="--", label=f"{SFT} start")
    ax.set_xticks(range(len(arms)), arms, rotation=15)
    ax.set(ylabel="held-out two-hop EM", title="final EM per seed (black: mean over seeds)", ylim=(0, None))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mean_curve(per_seed: dict[int, list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Per iteration, the mean across the seeds that logged it."""
    by_iteration: dict[int, list[float]] = {}
    for curve in per_seed.values():
        for iteration, share in curve:
            by_iteration.setdefault(iteration, []).append(share)
    return [(i, sum(v) / len(v)) for i, v in sorted(by_iteration.items())]


def plot_per_arm(curves: dict[str, dict[int, list[tuple[int, float]]]], path: Path, ylabel: str, title: str) -> None:
    """One colour per arm: each seed's curve thin, the mean across seeds bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, (arm, per_seed) in enumerate(curves.items()):
        for curve in per_seed.values():
            ax.plot([it for it, _ in curve], [s for _, s in curve], color=f"C{i}", alpha=0.25, linewidth=0.8)
        mean = mean_curve(per_seed)
        if mean:
            ax.plot([it for it, _ in mean], [s for _, s in mean], color=f"C{i}", linewidth=2, label=arm)
    ax.set(xlabel="iteration", ylabel=ylabel, title=title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def analyse(out: Path, iterations: int) -> dict:
    """Collect, then write study.md, study.json and the two plots into <out>/two-hop; returns what was written."""
    result = collect(out, iterations)
    study = out / NAME
    # JSON keys are strings: the curves as lists.
    curves = {key: {arm: {str(s): c for s, c in per_seed.items()} for arm, per_seed in result[key].items()}
              for key in ("kl_grad_share_curves", "train_reward_curves")}
    (study / "study.json").write_text(json.dumps({**result, **curves}, indent=1) + "\n")
    (study / "study.md").write_text(markdown(result))
    plot_em_per_seed(result, study / "em_per_seed.png")
    plot_per_arm(result["kl_grad_share_curves"], study / "kl_grad_share.png", "kl/grad_share",
                 "KL term's share of the gradient (bold: mean of seeds)")
    plot_per_arm(result["train_reward_curves"], study / "train_reward.png", "train reward",
                 "train reward (bold: mean of seeds)")
    return result


@app.command()
def main(
    out: Annotated[Path, typer.Option(help="the study's folder (prepare's --out)")] = Path("artifacts/two-hop"),
    config: Annotated[Path, typer.Option(help="the study's run config (its train.iterations is the last)")] = CONFIG,
    iterations: Annotated[int | None, typer.Option(help="the final iteration (default: the config's)")] = None,
) -> None:
    """Per-seed two-hop EM, the second-search outcome, kl/grad_share and machine time of the two-hop study."""
    if iterations is None:
        from trainer.config import load_config

        iterations = load_config(config).train.iterations
    result = analyse(out, iterations)
    print(markdown(result))
    print(f"wrote {out / NAME / 'study.md'}, study.json, em_per_seed.png, kl_grad_share.png, train_reward.png")


if __name__ == "__main__":
    app()

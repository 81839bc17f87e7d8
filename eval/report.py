"""Reports, pooled tables and plots: what an evaluation, the demo and a comparison write for people to read.

    EvalReport      one evaluation: EM / cover-EM / F1 and the protocol's rates per dataset and mode
    pooled          one row over all of a report's questions (datasets pooled), EM with its Wilson interval
    stages_markdown the demo's table: a row per stage (base, SFT, SFT + EMA-PG)
    plot_*          em.png (per dataset and mode), curves.png (SFT loss, reward, KL, length), stage and method plots

Pure functions over results and the run folder's JSONL logs: no model, engine or retriever.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class DatasetResult:
    dataset: str
    mode: str
    n: int
    em: float
    em_ci95: tuple[float, float]
    cover_em: float
    f1: float
    answered: float  # fraction with an <answer>
    well_formed: float  # ended in <answer> with no invalid action: the valid-format rate
    text_cover_em: float  # gold answer anywhere in the model's own text, tags or not (does it know, not say?)
    mean_searches: float
    mean_turns: float
    invalid_action_rate: float  # invalid turns / all turns
    mean_response_tokens: float  # model tokens only
    seconds: float  # wall time of the run that held it: a mode's datasets run pooled, so they share one
    # repeated searches / all searches (agent/diagnostics.py: an earlier search's query or documents again); 0.0 in
    # reports from before it was measured
    repeated_search_rate: float = 0.0


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion: honest at 0 and 1 and for small n, unlike p +- 2se."""
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # The interval always contains p; clamped so, since at p = 1 the float arithmetic above gives 0.9999999999999999.
    return (min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half)))


def error_bars(values: list[float], lows: list[float], highs: list[float]) -> list[list[float]]:
    """matplotlib's yerr (distances below and above each value) for intervals that contain their values; the
    distances are floored at 0 because a mean and its interval come from separate float sums (matplotlib refuses a
    negative one, which ended a comparison's report after its runs had finished)."""
    return [[max(0.0, v - low) for v, low in zip(values, lows, strict=True)],
            [max(0.0, high - v) for v, high in zip(values, highs, strict=True)]]


@dataclass
class EvalReport:
    model: str
    subset: str
    results: list[DatasetResult] = field(default_factory=list)
    averages: dict[str, float] = field(default_factory=dict)  # mode -> mean EM over datasets
    seconds: float = 0.0

    def finish(self) -> None:
        modes = dict.fromkeys(r.mode for r in self.results)
        self.averages = {m: sum(r.em for r in self.results if r.mode == m) / sum(r.mode == m for r in self.results)
                         for m in modes}

    def markdown(self) -> str:
        lines = [
            f"model: `{self.model}`; questions: {self.subset}; wall time {self.seconds / 60:.1f} min",
            "",
            "| dataset | mode | n | EM | EM 95% CI | cover-EM | F1 | answered | valid format | gold in text | searches "
            "| repeated searches | turns | invalid | tokens |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.results:
            lines.append(
                f"| {r.dataset} | {r.mode} | {r.n} | {r.em:.3f} | {r.em_ci95[0]:.3f}-{r.em_ci95[1]:.3f} | "
                f"{r.cover_em:.3f} | {r.f1:.3f} | {r.answered:.2f} | {r.well_formed:.2f} | {r.text_cover_em:.2f} | {r.mean_searches:.2f} | "
                f"{r.repeated_search_rate:.2f} | {r.mean_turns:.2f} | "
                f"{r.invalid_action_rate:.2f} | {r.mean_response_tokens:.0f} |"
            )
        lines += ["", "| mode | average EM over datasets |", "|---|---|"]
        lines += [f"| {m} | {em:.3f} |" for m, em in self.averages.items()]
        return "\n".join(lines) + "\n"

    @classmethod
    def load(cls, path: Path) -> EvalReport:
        """A report from its `report.json` (what `save` wrote)."""
        raw = json.loads(Path(path).read_text())
        results = [DatasetResult(**{**r, "em_ci95": tuple(r["em_ci95"])}) for r in raw.pop("results")]
        return cls(**raw, results=results)

    def save(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "report.json").write_text(json.dumps(asdict(self), indent=2))
        (out_dir / "report.md").write_text(self.markdown())
        plot_em(self, out_dir / "em.png")


def plot_em(report: EvalReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r.dataset for r in report.results))
    modes = list(dict.fromkeys(r.mode for r in report.results))
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(datasets), 3.6))
    for j, mode in enumerate(modes):
        rows = {r.dataset: r for r in report.results if r.mode == mode}
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(datasets))]
        ems = [rows[d].em if d in rows else 0.0 for d in datasets]
        err = error_bars(ems, [rows[d].em_ci95[0] if d in rows else 0.0 for d in datasets],
                         [rows[d].em_ci95[1] if d in rows else 0.0 for d in datasets])
        ax.bar(xs, ems, width, yerr=err, capsize=3, label=mode)
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("exact match (95% CI)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{report.model} - {report.subset}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def pooled(report: EvalReport) -> dict[str, float]:
    """One row over all evaluated questions (datasets pooled), with the Wilson 95% CI of EM."""
    n = sum(r.n for r in report.results)

    def mean(attr: str) -> float:
        return sum(getattr(r, attr) * r.n for r in report.results) / max(1, n)

    low, high = wilson_interval(mean("em") * n, n)
    return {"n": n, "em": mean("em"), "em_low": low, "em_high": high, "cover_em": mean("cover_em"),
            "well_formed": mean("well_formed"), "searches": mean("mean_searches"),
            "tokens": mean("mean_response_tokens"), "seconds": report.seconds}


def stages_markdown(stages: dict[str, EvalReport], timings: dict[str, float], subset: str) -> str:
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


def plot_curves(rl_metrics: list[dict], sft_metrics: list[dict], path: Path) -> None:
    """SFT loss per step; EMA-PG reward / EM, KL to the anchor, and response length per iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.4))
    axes[0].plot([m["iteration"] for m in sft_metrics], [m["loss/sft"] for m in sft_metrics])
    axes[0].set(title="SFT loss (model tokens)", xlabel="step")
    it = [m["iteration"] for m in rl_metrics]
    axes[1].plot(it, [m["rollout/reward"] for m in rl_metrics], marker="o", label="reward")
    axes[1].plot(it, [m["rollout/em"] for m in rl_metrics], marker="o", label="EM")
    axes[1].set(title="EMA-PG reward (rollouts)", xlabel="iteration")
    axes[1].legend()
    axes[2].plot(it, [m.get("kl/anchor", 0.0) for m in rl_metrics], marker="o")
    axes[2].set(title="KL estimate, policy to EMA anchor", xlabel="iteration")
    axes[3].plot(it, [m["rollout/response_tokens"] for m in rl_metrics], marker="o")
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
    err = error_bars(ems, [p["em_low"] for p in rows], [p["em_high"] for p in rows])
    ax.bar(list(stages), ems, yerr=err, capsize=4)
    ax.set(ylabel="held-out EM (95% CI)", ylim=(0, 1), title="base -> SFT -> SFT + EMA-PG")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_methods(curves: dict[str, list[dict]], held_out: dict[str, list[tuple[int, dict]]], path: Path) -> None:
    """Training reward per iteration (faint) and its trailing mean, and held-out EM with its CI, one colour a method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(11, 3.8))
    for i, (name, metrics) in enumerate(curves.items()):
        color, it = f"C{i}", [m["iteration"] for m in metrics]
        ax_r.plot(it, [m["rollout/reward"] for m in metrics], color=color, alpha=0.3)
        window = 5  # a trailing mean: single iterations of a few groups are noisy
        smooth = [sum(m["rollout/reward"] for m in metrics[max(0, j - window + 1) : j + 1]) / min(window, j + 1)
                  for j in range(len(metrics))]
        ax_r.plot(it, smooth, color=color, label=f"{name} (faint: per iteration; bold: mean of {window})")
        points = held_out[name]
        shift = 0.15 * (i - (len(curves) - 1) / 2)  # side by side, so equal values stay visible
        ax_e.errorbar([j + shift for j, _ in points], [p["em"] for _, p in points],
                      yerr=error_bars([p["em"] for _, p in points], [p["em_low"] for _, p in points],
                                      [p["em_high"] for _, p in points]),
                      color=color, marker="o", capsize=3, label=name)
    ax_r.set(title="training reward (rollouts)", xlabel="iteration")
    ax_e.set(title="held-out EM (95% CI)", xlabel="iteration", ylim=(0, None))
    ax_r.legend()
    ax_e.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

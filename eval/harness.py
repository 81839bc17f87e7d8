"""The QA benchmark harness: a policy, datasets, modes (direct / rag / agent) -> EM, cover-EM, F1 per dataset.

Writes `report.json`, `report.md`, `em.png` (EM per dataset and mode) and the trajectories of every run.
Greedy decoding, as the papers evaluate.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from agent.backend import RolloutBackend, SamplingParams
from agent.continuous import ContinuousSearchAgent, search_agent
from agent.rollout import Mode, RolloutConfig
from agent.trajectory import Trajectory, save_jsonl
from data.qa import QAExample
from eval.metrics import cover_exact_match, exact_match, f1
from retriever.client import RetrieverClient


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


def wilson_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion: honest at 0 and 1 and for small n, unlike p +- 2se."""
    if n == 0:
        return (0.0, 0.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def score(
    trajectories: list[Trajectory], dataset: str, mode: str, seconds: float, model_texts: list[str]
) -> DatasetResult:
    """`model_texts[i]`: the decoded model tokens of trajectory i (observations excluded)."""
    n = len(trajectories)
    ems = [exact_match(t.answer, t.golden_answers) for t in trajectories]
    turns = [len(t.turns) for t in trajectories]

    def mean(xs) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    return DatasetResult(
        dataset=dataset,
        mode=mode,
        n=n,
        em=mean(ems),
        em_ci95=wilson_interval(sum(ems), n),
        cover_em=mean([cover_exact_match(t.answer, t.golden_answers) for t in trajectories]),
        f1=mean([f1(t.answer, t.golden_answers) for t in trajectories]),
        answered=mean([t.answer is not None for t in trajectories]),
        well_formed=mean([t.well_formed for t in trajectories]),
        text_cover_em=mean([cover_exact_match(text, t.golden_answers) for t, text in zip(trajectories, model_texts,
                                                                                         strict=True)]),
        mean_searches=mean([t.num_searches for t in trajectories]),
        mean_turns=mean(turns),
        invalid_action_rate=sum(t.num_invalid for t in trajectories) / max(1, sum(turns)),
        mean_response_tokens=mean([t.model_tokens for t in trajectories]),
        seconds=seconds,
    )


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
            "| turns | invalid | tokens |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.results:
            lines.append(
                f"| {r.dataset} | {r.mode} | {r.n} | {r.em:.3f} | {r.em_ci95[0]:.3f}-{r.em_ci95[1]:.3f} | "
                f"{r.cover_em:.3f} | {r.f1:.3f} | {r.answered:.2f} | {r.well_formed:.2f} | {r.text_cover_em:.2f} | {r.mean_searches:.2f} | "
                f"{r.mean_turns:.2f} | "
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
        err = [[rows[d].em - rows[d].em_ci95[0] if d in rows else 0 for d in datasets],
               [rows[d].em_ci95[1] - rows[d].em if d in rows else 0 for d in datasets]]
        ax.bar(xs, ems, width, yerr=err, capsize=3, label=mode)
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("exact match (95% CI)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{report.model} - {report.subset}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def model_text(tokenizer, traj: Trajectory) -> str:
    """What the model itself wrote: its tokens only, special tokens dropped."""
    ids = [i for i, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
    return tokenizer.decode(ids, skip_special_tokens=True)


def run_mode(
    backend: RolloutBackend,
    tokenizer,
    retriever: RetrieverClient | None,
    examples: list[QAExample],
    config: RolloutConfig,
    batch_size: int,
    progress: tqdm | None = None,
    retriever_timeout_s: float = 30.0,
) -> list[Trajectory]:
    """Greedy rollouts of `examples`: continuous over all of them on vLLM (at most batch_size in flight), per turn in
    chunks of batch_size on transformers."""
    agent = search_agent(backend, tokenizer, retriever, config, retriever_timeout_s=retriever_timeout_s,
                         max_concurrency=batch_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=config.max_tokens_per_turn)
    chunk = max(1, len(examples)) if isinstance(agent, ContinuousSearchAgent) else batch_size
    trajectories: list[Trajectory] = []
    for start in range(0, len(examples), chunk):
        trajectories += agent.rollout(examples[start : start + chunk], greedy,
                                      on_done=None if progress is None else lambda _: progress.update(1))
    return trajectories


def evaluate(
    backend: RolloutBackend,
    tokenizer,
    retriever: RetrieverClient | None,
    datasets: dict[str, list[QAExample]],
    modes: list[Mode],
    base_config: RolloutConfig,
    *,
    model_name: str,
    subset: str,
    out_dir: Path,
    batch_size: int = 16,
    retriever_timeout_s: float = 30.0,
) -> EvalReport:
    report = EvalReport(model=model_name, subset=subset)
    start = time.perf_counter()
    total = sum(len(v) for v in datasets.values()) * len(modes)
    with tqdm(total=total, desc="eval", unit="q") as progress:
        for mode in modes:
            config = RolloutConfig(**{**asdict(base_config), "mode": mode})
            progress.set_postfix_str(mode)
            t0 = time.perf_counter()
            per_dataset = run_pooled(backend, tokenizer, retriever, datasets, config, batch_size, progress,
                                     retriever_timeout_s)
            seconds = time.perf_counter() - t0
            for name, trajectories in per_dataset.items():
                texts = [model_text(tokenizer, t) for t in trajectories]
                report.results.append(score(trajectories, name, mode, seconds, texts))
                save_jsonl(trajectories, out_dir / "trajectories" / f"{name}.{mode}.jsonl")
    report.seconds = time.perf_counter() - start
    report.finish()
    report.save(out_dir)
    return report


def run_pooled(
    backend: RolloutBackend,
    tokenizer,
    retriever: RetrieverClient | None,
    datasets: dict[str, list[QAExample]],
    config: RolloutConfig,
    batch_size: int,
    progress: tqdm | None = None,
    retriever_timeout_s: float = 30.0,
) -> dict[str, list[Trajectory]]:
    """`run_mode` over all datasets at once, split back per dataset. One continuous run ends on one tail of long
    trajectories instead of one per dataset (benchmarks/eval_concurrency.py: 0.93x the time, the same tokens)."""
    pooled = run_mode(backend, tokenizer, retriever, [e for examples in datasets.values() for e in examples],
                      config, batch_size, progress, retriever_timeout_s)
    bounds = list(itertools.accumulate((len(examples) for examples in datasets.values()), initial=0))
    return {name: pooled[start:end] for name, (start, end) in zip(datasets, itertools.pairwise(bounds), strict=True)}

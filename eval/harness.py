"""The QA benchmark harness: a policy, datasets, modes (direct / rag / agent) -> EM, cover-EM, F1 per dataset.

Writes `report.json`, `report.md`, `em.png` (EM per dataset and mode) and the trajectories of every run.
Greedy decoding, as the papers evaluate.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from agent.backend import SamplingParams
from agent.diagnostics import repeated_search_rates
from agent.rollout import Mode, RolloutAgent
from agent.trajectory import Trajectory, save_jsonl
from data.qa import QAExample
from eval.metrics import cover_exact_match, exact_match, f1
from eval.report import DatasetResult, EvalReport, wilson_interval


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
        repeated_search_rate=repeated_search_rates(trajectories)[0],
    )


def model_text(tokenizer, traj: Trajectory) -> str:
    """What the model itself wrote: its tokens only, special tokens dropped."""
    ids = [i for i, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m]
    return tokenizer.decode(ids, skip_special_tokens=True)


def run_mode(agent: RolloutAgent, examples: list[QAExample], progress: tqdm | None = None) -> list[Trajectory]:
    """Greedy rollouts of `examples`, in calls of the agent's `rows_per_call` (all at once where it has no limit)."""
    greedy = SamplingParams(temperature=0.0)  # the agent sets each turn's token limit
    chunk = agent.rows_per_call or max(1, len(examples))
    trajectories: list[Trajectory] = []
    for start in range(0, len(examples), chunk):
        trajectories += agent.rollout(examples[start : start + chunk], greedy,
                                      on_done=None if progress is None else lambda _: progress.update(1))
    return trajectories


def evaluate(
    agent_for: Callable[[Mode], RolloutAgent],
    tokenizer,
    datasets: dict[str, list[QAExample]],
    modes: list[Mode],
    *,
    model_name: str,
    subset: str,
    out_dir: Path,
) -> EvalReport:
    """Each mode's greedy rollouts over every dataset (pooled into one run), scored per dataset; `agent_for(mode)` is
    the agent of that mode (agent.factory.make_agent), `tokenizer` decodes the model's own text for the report."""
    report = EvalReport(model=model_name, subset=subset)
    start = time.perf_counter()
    total = sum(len(v) for v in datasets.values()) * len(modes)
    with tqdm(total=total, desc="eval", unit="q") as progress:
        for mode in modes:
            progress.set_postfix_str(mode)
            t0 = time.perf_counter()
            per_dataset = run_pooled(agent_for(mode), datasets, progress)
            seconds = time.perf_counter() - t0
            for name, trajectories in per_dataset.items():
                texts = [model_text(tokenizer, t) for t in trajectories]
                report.results.append(score(trajectories, name, mode, seconds, texts))
                save_jsonl(trajectories, out_dir / "trajectories" / f"{name}.{mode}.jsonl")
    report.seconds = time.perf_counter() - start
    report.finish()
    report.save(out_dir)
    return report


def run_pooled(agent: RolloutAgent, datasets: dict[str, list[QAExample]],
               progress: tqdm | None = None) -> dict[str, list[Trajectory]]:
    """`run_mode` over all datasets at once, split back per dataset. One continuous run ends on one tail of long
    trajectories instead of one per dataset (benchmarks/eval_concurrency.py: 0.93x the time, the same tokens)."""
    pooled = run_mode(agent, [e for examples in datasets.values() for e in examples], progress)
    bounds = list(itertools.accumulate((len(examples) for examples in datasets.values()), initial=0))
    return {name: pooled[start:end] for name, (start, end) in zip(datasets, itertools.pairwise(bounds), strict=True)}

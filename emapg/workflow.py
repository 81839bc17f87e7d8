"""The steps the CLI commands, the demo and the comparison share: question sets (answerable subsets, cached),
demonstrations + SFT, the training progress line.

Each step takes the run's TrainConfig and an open retriever client (a Session's, emapg/session.py), so `emapg sft`,
`emapg train`, `emapg demo` and `emapg compare` build their data and train exactly the same way.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from data.qa import QAExample
from emapg.progress import stage_progress

console = Console()
ARTIFACTS = Path(os.environ.get("EMAPG_ARTIFACTS", "artifacts"))


def load_datasets(names: list[str], split: str, flashrag_root: Path | None) -> dict[str, list[QAExample]]:
    from data.qa import load_qa

    return {name: load_qa(name, split, flashrag_root) for name in names}


def answerable(examples: list[QAExample], client, k: int, tag: str, name: str) -> list[QAExample]:
    """The examples whose gold answer is in their top-k passages, cached per index under artifacts/subsets/."""
    from eval.answerable import cached_answerable_subset

    def passages(questions: list[str]) -> list[list[str]]:
        return [[h.contents for h in hits] for hits in client.search(questions, k)]

    path = ARTIFACTS / "subsets" / tag / f"{name}-k{k}.jsonl"
    chosen = cached_answerable_subset(examples, passages, k, tag, path)
    console.print(f"{name}: {chosen.count:,} of {chosen.total:,} answerable (top-{k} of {tag})")
    return chosen.examples


def split_spec(spec: str, default_split: str) -> tuple[str, str]:
    name, _, split = spec.partition(":")
    return name, split or default_split


def question_sets(cfg, specs: list[str], default_split: str, client, tag: str) -> dict[str, list[QAExample]]:
    """Each `dataset:split` of specs: its first data.scan_limit questions, then the answerable subset if asked."""
    if cfg.data.subset == "answerable" and client is None:
        raise ValueError("data.subset=answerable needs a retriever (rollout.mode=direct has none): set data.subset=full")
    out = {}
    for spec in specs:
        name, split = split_spec(spec, default_split)
        data = load_datasets([name], split, cfg.data.flashrag_root)[name][: cfg.data.scan_limit]
        if cfg.data.subset == "answerable":
            scanned = f"-first{cfg.data.scan_limit}" if cfg.data.scan_limit else ""
            data = answerable(data, client, cfg.data.answerable_k, tag, f"{name}-{split}{scanned}")
        out[f"{name}:{split}"] = data
    return out


def train_examples(cfg, client, tag: str) -> list[QAExample]:
    return [ex for data in question_sets(cfg, cfg.data.train, "dev", client, tag).values() for ex in data]


def eval_examples(cfg, client, tag: str) -> dict[str, list[QAExample]]:
    """Per held-out set, its first data.eval_limit questions (answerable ones if asked), keyed by dataset name."""
    sets = question_sets(cfg, cfg.data.eval, "test", client, tag)
    return {key.partition(":")[0]: data[: cfg.data.eval_limit] for key, data in sets.items()}


def build_sft_data(cfg, client, tokenizer, examples: list[QAExample]):
    """Demonstrations from a seeded shuffle of the train questions (so every train set is represented), saved
    beside the SFT checkpoints for `emapg show`."""
    from agent.trajectory import save_jsonl
    from agent.demonstrations import build_demonstrations

    shuffled = random.Random(cfg.seed).sample(examples, len(examples))
    demos, counts = build_demonstrations(shuffled, client, tokenizer, topk=cfg.retriever.topk,
                                         max_obs_tokens=cfg.rollout.max_obs_tokens, limit=cfg.sft.examples)
    save_jsonl(demos, cfg.sft_dir / "demonstrations.jsonl")
    (cfg.sft_dir / "demonstrations.json").write_text(json.dumps(counts, indent=2))
    console.print(f"demonstrations: {counts}")
    return demos


def run_sft(cfg, policy, tokenizer, demos, evaluate: Callable[[int], None] | None = None) -> Path:
    """SFT on the demonstrations with a progress bar (loss, time left); `evaluate(step)`, if given, every
    sft.eval_every steps and after the last one, the bar paused while it runs."""
    from trainer.run.sft import SFTTrainer

    trainer = SFTTrainer(cfg, policy, demos, tokenizer.pad_token_id or 0)
    every = cfg.sft.eval_every
    with stage_progress(console, "SFT", trainer.steps) as progress:

        def show(step: int, m: dict) -> None:
            progress.update(step, f"loss {m['loss/sft']:.3f}")
            if evaluate is not None and (step == trainer.steps or (every and step % every == 0)):
                with progress.paused():
                    evaluate(step)

        path = trainer.run(progress=show)
    console.print(f"SFT: {trainer.steps} steps on {len(demos)} demonstrations -> {path}")
    return path


def train_with_progress(trainer, description: str) -> None:
    """`trainer.run()` with a line per iteration (print_iteration) and, on a terminal, a bar below them with the
    time spent and left (an iteration takes a minute or more on a CPU: the clock shows it is working)."""
    with stage_progress(console, description, trainer.cfg.train.iterations, lines=False,
                        done=trainer.iteration) as progress:

        def show(iteration: int, m: dict) -> None:
            print_iteration(iteration, m)
            progress.update(iteration, f"reward {m['rollout/reward']:.3f}")

        trainer.run(progress=show)


def print_iteration(iteration: int, m: dict) -> None:
    # The learning stats are missing when the guard skipped every optimizer step of the iteration.
    learned = {key: m.get(f"loss/{key}", float("nan")) for key in ("clip_fraction", "entropy", "grad_norm")}
    skipped = f"  skipped steps {m['guard/skipped_steps']:.0f}" if m.get("guard/skipped_steps") else ""
    console.print(
        f"iter {iteration:>4}  reward {m['rollout/reward']:.3f}  em {m['rollout/em']:.3f}  "
        f"format {m['rollout/format']:.2f}  kl {m.get('kl/anchor', 0):.4f}  clip {learned['clip_fraction']:.3f}  "
        f"entropy {learned['entropy']:.2f}  grad {learned['grad_norm']:.2f}  "
        f"len {m['rollout/response_tokens']:.0f}  searches {m['rollout/searches']:.2f}  "
        f"rollout {m['time/rollout_s']:.0f}s update {m['time/update_s']:.0f}s{skipped}"
    )

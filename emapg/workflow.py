"""The steps the CLI commands, the demo and the comparison share: question sets (answerable subsets, cached),
demonstrations + SFT, the training progress line, agent-mode evaluation of an in-memory policy.

Each step takes the run's TrainConfig and an open retriever client, so `emapg sft`, `emapg train`, `emapg demo`
and `emapg compare` build their data and train exactly the same way.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from rich.console import Console

from data.qa import QAExample

console = Console()
ARTIFACTS = Path(os.environ.get("EMAPG_ARTIFACTS", "artifacts"))


def index_tag(health: dict) -> str:
    """A name for the served index, recorded with every answerable subset made from it."""
    encoder = (health.get("encoder") or "bm25").split("/")[-1]
    dtype = health.get("passage_dtype")
    precision = f"-{dtype}" if dtype not in (None, "float32") else ""  # fp32 tags predate this field
    return f"{health['kind']}-{encoder}-{health.get('index_factory') or 'bm25'}{precision}-{health['num_docs']}"


def served_index_tag(urls: list[str]) -> str:
    """The index tag of the retriever replicas at `urls`, from their /health. The replicas that answer must serve
    the same index (another index would give other passages for the same query); one that is down is skipped,
    as the client fails over from it."""
    import httpx

    from retriever.client import RetrieverUnavailable

    tags: dict[str, str] = {}
    down: list[str] = []
    for url in urls:
        try:
            tags[url] = index_tag(httpx.get(url + "/health", timeout=10).raise_for_status().json())
        except httpx.HTTPError as e:
            down.append(f"{url}: {type(e).__name__}: {e}")
    if not tags:
        raise RetrieverUnavailable(f"no retriever answers /health: {'; '.join(down)}")
    if len(set(tags.values())) > 1:
        served = ", ".join(f"{url} has {tag}" for url, tag in tags.items())
        raise ValueError(f"retriever replicas serve different indexes: {served}")
    return next(iter(tags.values()))


@contextmanager
def connect_retriever(cfg, log: Path | None = None) -> Iterator[tuple]:
    """(client, index tag) for a run: the server (or replicas) at cfg.retriever.url, else one started on
    cfg.retriever.index for the duration (its output to `log`); (None, "none") when rollout.mode is direct."""
    from retriever.client import RetrieverClient
    from retriever.process import running_server

    if cfg.rollout.mode == "direct":
        yield None, "none"
        return
    server = nullcontext(cfg.retriever.url) if cfg.retriever.url else running_server(cfg.retriever.index, log=log)
    with server as urls, RetrieverClient(urls, topk=cfg.retriever.topk, timeout_s=cfg.retriever.timeout_s) as client:
        yield client, served_index_tag(client.urls)


def load_datasets(names: list[str], split: str, flashrag_root: Path | None) -> dict[str, list[QAExample]]:
    from data.qa import load_flashrag, load_packaged

    out = {}
    for name in names:
        if flashrag_root is None and name in ("nq", "triviaqa"):
            out[name] = load_packaged(name, split)  # type: ignore[arg-type]
        else:
            out[name] = load_flashrag(name, None if split == "auto" else split, root=flashrag_root)
    return out


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
    from trainer.demonstrations import build_demonstrations

    shuffled = random.Random(cfg.seed).sample(examples, len(examples))
    demos, counts = build_demonstrations(shuffled, client, tokenizer, topk=cfg.retriever.topk,
                                         max_obs_tokens=cfg.rollout.max_obs_tokens, limit=cfg.sft.examples)
    save_jsonl(demos, cfg.sft_dir / "demonstrations.jsonl")
    (cfg.sft_dir / "demonstrations.json").write_text(json.dumps(counts, indent=2))
    console.print(f"demonstrations: {counts}")
    return demos


def run_sft(cfg, policy, tokenizer, demos) -> Path:
    from rich.progress import Progress

    from trainer.sft import SFTTrainer

    trainer = SFTTrainer(cfg, policy, demos, tokenizer.pad_token_id or 0)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("SFT", total=trainer.steps)

        def show(step: int, m: dict) -> None:
            bar.update(task, completed=step, description=f"SFT loss {m['sft_loss']:.3f}")

        path = trainer.run(progress=show)
    console.print(f"SFT: {trainer.steps} steps on {len(demos)} demonstrations -> {path}")
    return path


def print_iteration(iteration: int, m: dict) -> None:
    # The learning stats are missing when the guard skipped every optimizer step of the iteration.
    learned = {key: m.get(key, float("nan")) for key in ("clip_fraction", "entropy", "grad_norm")}
    skipped = f"  skipped steps {m['guard_skipped_steps']:.0f}" if m.get("guard_skipped_steps") else ""
    console.print(
        f"iter {iteration:>4}  reward {m['reward']:.3f}  em {m['em']:.3f}  format {m['format']:.2f}  "
        f"kl {m.get('kl', 0):.4f}  clip {learned['clip_fraction']:.3f}  entropy {learned['entropy']:.2f}  "
        f"grad {learned['grad_norm']:.2f}  len {m['response_tokens']:.0f}  searches {m['searches']:.2f}  "
        f"rollout {m['time_rollout_s']:.0f}s update {m['time_update_s']:.0f}s{skipped}"
    )


def run_eval(cfg, policy, tokenizer, client, datasets: dict[str, list[QAExample]], name: str, out_dir: Path,
             subset: str, backend):
    """Agent-mode greedy evaluation of an in-memory policy with the run's rollout settings, on the process's rollout
    engine (`backend`; the policy's weights are copied into it first: vLLM samples from its own copy)."""
    from eval.harness import evaluate
    from trainer.engine import rollout_config

    backend.load_weights(policy.named_parameters())
    r = cfg.rollout
    # evaluate() sets the mode ("agent") itself; the rest is the run's rollout shape.
    return evaluate(backend, tokenizer, client, datasets, ["agent"], rollout_config(cfg), model_name=name,
                    subset=subset, out_dir=out_dir, batch_size=r.batch_size,
                    retriever_timeout_s=cfg.retriever.timeout_s)

"""`emapg`: build corpora and indexes, serve and query the retriever, run the demo."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="EMA-PG search agents: retrieval service, rollouts, training, evaluation.", no_args_is_help=True)
console = Console()

ARTIFACTS = Path(os.environ.get("EMAPG_ARTIFACTS", "artifacts"))
PACKAGED_CORPUS = ARTIFACTS / "corpus" / "wiki-summaries.jsonl"
DEFAULT_INDEX = ARTIFACTS / "indexes" / "wiki-minilm-flat"
DEMO_QUESTIONS = [
    "who wrote pride and prejudice",
    "what is the capital of australia",
    "who painted the mona lisa",
    "when did the berlin wall fall",
    "what is the largest planet in the solar system",
]


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


@app.command()
def corpus(out: Annotated[Path, typer.Option(help="JSONL file to write")] = PACKAGED_CORPUS) -> None:
    """Write the packaged 10,033 Wikipedia summaries as a Search-R1 JSONL corpus."""
    from data.corpus import packaged_wiki_passages, write_jsonl

    try:
        n = write_jsonl(packaged_wiki_passages(), out)
    except FileNotFoundError as e:
        _fail(str(e))
    console.print(f"wrote {n:,} passages to {out}")


@app.command()
def index(
    out: Annotated[Path, typer.Option(help="index folder to create")] = DEFAULT_INDEX,
    corpus_path: Annotated[
        Path | None, typer.Option("--corpus", help="JSONL corpus; default: the packaged Wikipedia summaries")
    ] = None,
    kind: Annotated[str, typer.Option(help="dense (FAISS) or bm25")] = "dense",
    encoder: Annotated[str, typer.Option(help="preset (minilm, e5-base-v2), hub id or local folder")] = "minilm",
    factory: Annotated[str, typer.Option(help="FAISS index factory string: Flat, HNSW32, IVF4096,PQ64, ...")] = "Flat",
    batch_size: Annotated[int, typer.Option(min=1)] = 128,
    train_size: Annotated[int, typer.Option(min=1, help="vectors sampled to train IVF/PQ indexes")] = 100_000,
    copy_corpus: Annotated[bool, typer.Option(help="copy the corpus into the index folder (off for wiki-18)")] = True,
    device: Annotated[str, typer.Option(help="encoder device: cpu, cuda")] = "cpu",
    dtype: Annotated[str, typer.Option(help="passage encoder dtype: float32, or bfloat16 (~2x faster)")] = "float32",
    overwrite: Annotated[bool, typer.Option(help="replace an existing index folder")] = False,
) -> None:
    """Build an index folder from a JSONL corpus."""
    if kind not in ("dense", "bm25"):
        _fail(f"--kind must be 'dense' or 'bm25', got {kind!r}")
    if dtype not in ("float32", "bfloat16"):
        _fail(f"--dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if corpus_path is None:
        corpus_path = PACKAGED_CORPUS
        if not corpus_path.exists():
            corpus(corpus_path)
    try:
        if kind == "bm25":
            from retriever.bm25 import build_bm25_index

            manifest = build_bm25_index(corpus_path, out, copy_corpus=copy_corpus, overwrite=overwrite)
        else:
            from retriever.dense import build_dense_index

            manifest = build_dense_index(
                corpus_path, out, encoder=encoder, factory=factory, batch_size=batch_size, train_size=train_size,
                copy_corpus=copy_corpus, overwrite=overwrite, device=device, dtype=dtype,
            )
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    console.print(f"built {manifest.kind} index of {manifest.corpus.num_docs:,} passages in {out}")


@app.command()
def serve(
    index_dir: Annotated[Path, typer.Option("--index", help="index folder")] = DEFAULT_INDEX,
    encoder: Annotated[str | None, typer.Option(help="must match the index's encoder; default: the index's")] = None,
    host: Annotated[str, typer.Option(help="bind address; 0.0.0.0 exposes it (set EMAPG_RETRIEVER_TOKEN)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    topk: Annotated[int, typer.Option(min=1, help="topk when a request sends null")] = 3,
    max_topk: Annotated[int, typer.Option(min=1)] = 100,
    max_queries: Annotated[int, typer.Option(min=1, help="queries per request")] = 1024,
    max_query_chars: Annotated[int, typer.Option(min=1)] = 2048,
    batching: Annotated[bool, typer.Option(help="coalesce concurrent requests into one encode+search")] = True,
    max_batch_queries: Annotated[int, typer.Option(min=1)] = 256,
    max_wait_ms: Annotated[float, typer.Option(min=0.0, help="how long a batch waits for more requests")] = 2.0,
    cache_size: Annotated[int, typer.Option(min=0, help="LRU entries of query results; 0 turns the cache off")] = 100_000,
    search_threads: Annotated[int, typer.Option(min=1)] = 1,
    device: Annotated[str, typer.Option(help="query encoder device: cpu, cuda")] = "cpu",
    query_dtype: Annotated[str, typer.Option(help="query encoder dtype: float32 or bfloat16")] = "float32",
    gpu: Annotated[bool, typer.Option(help="shard the FAISS index over all GPUs in fp16 (needs faiss-gpu)")] = False,
    search_params: Annotated[str | None, typer.Option(help="FAISS search parameters, e.g. nprobe=64")] = None,
) -> None:
    """Serve Search-R1's POST /retrieve over an index folder."""
    from pydantic import ValidationError

    from retriever.manifest import EncoderMismatchError
    from retriever.server import ServerSettings, serve as run_server

    try:
        settings = ServerSettings(
            index=index_dir, encoder=encoder, host=host, port=port, default_topk=topk, max_topk=max_topk,
            max_queries=max_queries, max_query_chars=max_query_chars, batching=batching,
            max_batch_queries=max_batch_queries, max_wait_ms=max_wait_ms, cache_size=cache_size,
            search_threads=search_threads, device=device, query_dtype=query_dtype, gpu_index=gpu,
            search_params=search_params,
        )
        run_server(settings)
    except ValidationError as e:
        _fail(" ".join(f"--{'-'.join(map(str, err['loc'])).replace('_', '-')}: {err['msg']}" for err in e.errors()))
    except (EncoderMismatchError, FileNotFoundError, ValueError, RuntimeError) as e:
        _fail(str(e))


def print_hits(question: str, hits: list) -> None:
    from data.corpus import split_contents

    table = Table(title=question, title_justify="left", show_lines=False)
    table.add_column("#", justify="right")
    table.add_column("score", justify="right")
    table.add_column("title")
    table.add_column("text")
    for i, hit in enumerate(hits, 1):
        title, text = split_contents(hit.contents)
        table.add_row(str(i), f"{hit.score:.3f}", title, text[:90] + ("..." if len(text) > 90 else ""))
    console.print(table)


@app.command()
def search(
    queries: Annotated[list[str], typer.Argument(help="one or more questions")],
    url: Annotated[str, typer.Option(help="retriever URL")] = "http://127.0.0.1:8000",
    topk: Annotated[int, typer.Option(min=1)] = 3,
) -> None:
    """Query a running retriever and print the hits."""
    from retriever.client import RetrieverClient, RetrieverError

    try:
        with RetrieverClient(url, topk=topk, token=os.environ.get("EMAPG_RETRIEVER_TOKEN"), retries=2) as client:
            results = client.search(queries)
    except RetrieverError as e:
        _fail(str(e))
    for q, hits in zip(queries, results, strict=True):
        print_hits(q, hits)


@app.command()
def demo(
    index_dir: Annotated[Path, typer.Option("--index", help="index folder (built if missing)")] = DEFAULT_INDEX,
    topk: Annotated[int, typer.Option(min=1)] = 3,
) -> None:
    """Build the packaged-Wikipedia index, start the server, ask real questions, print the hits, stop."""
    from retriever.client import RetrieverClient
    from retriever.process import running_server

    if not (index_dir / "manifest.json").exists():
        console.rule("building the index (once)")
        index(out=index_dir)
    console.rule("starting the retrieval server")
    log = ARTIFACTS / "logs" / "demo-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with running_server(index_dir, log=log) as url:
        console.print(f"server at {url} (log: {log})")
        with RetrieverClient(url, topk=topk) as client:
            for question, hits in zip(DEMO_QUESTIONS, client.search(DEMO_QUESTIONS), strict=True):
                print_hits(question, hits)
    console.print("server stopped")


def index_tag(health: dict) -> str:
    """A name for the served index, recorded with every answerable subset made from it."""
    encoder = (health.get("encoder") or "bm25").split("/")[-1]
    return f"{health['kind']}-{encoder}-{health.get('index_factory') or 'bm25'}-{health['num_docs']}"


def load_datasets(names: list[str], split: str, flashrag_root: Path | None) -> dict[str, list]:
    from data.qa import load_flashrag, load_packaged

    out = {}
    for name in names:
        if flashrag_root is None and name in ("nq", "triviaqa"):
            out[name] = load_packaged(name, split)  # type: ignore[arg-type]
        else:
            out[name] = load_flashrag(name, None if split == "auto" else split, root=flashrag_root)
    return out


@app.command()
def show(
    path: Annotated[Path, typer.Argument(help="trajectories JSONL (from eval or training)")],
    index: Annotated[int, typer.Option(min=0, help="which trajectory (0-based)")] = 0,
    model: Annotated[str, typer.Option(help="whose tokenizer decodes the ids")] = "smollm2-135m-instruct",
) -> None:
    """Print one trajectory as the model saw it; masked spans (observations, invalid-action messages) dimmed."""
    import itertools

    from rich.text import Text

    from agent.policy import load_tokenizer
    from agent.trajectory import MASK_CLOSE, MASK_OPEN, load_jsonl

    if not path.is_file():
        _fail(f"{path} does not exist")
    traj = next(itertools.islice(load_jsonl(path), index, None), None)
    if traj is None:
        _fail(f"{path} has no trajectory {index}")
    text = Text()
    for i, part in enumerate(traj.render(load_tokenizer(model)).replace(MASK_CLOSE, MASK_OPEN).split(MASK_OPEN)):
        text.append(part, style="dim cyan" if i % 2 else "")
    console.print(text)
    console.rule(f"{traj.uid}: answer {traj.answer!r}, gold {traj.golden_answers}, {len(traj.turns)} turns, "
                 f"{traj.num_searches} searches, {traj.model_tokens} model / {traj.observation_tokens} masked tokens")


@app.command("eval")
def eval_command(
    model: Annotated[str, typer.Option(help="policy: smollm2-135m-instruct (packaged), a folder or a hub id")] = (
        "smollm2-135m-instruct"
    ),
    datasets: Annotated[str, typer.Option(help="comma-separated: nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, "
                                          "musique, bamboogle")] = "nq,triviaqa",
    split: Annotated[str, typer.Option(help="test, dev, or auto (test if the set has one, else dev)")] = "test",
    flashrag_root: Annotated[Path | None, typer.Option(help="folder of FlashRAG JSONL files (<set>/<split>.jsonl)")] = None,
    subset: Annotated[str, typer.Option(help="answerable (gold answer in the top-k passages) or full")] = "answerable",
    answerable_k: Annotated[int, typer.Option(min=1)] = 5,
    limit: Annotated[int, typer.Option(min=1, help="questions per dataset (the first N)")] = 100,
    modes: Annotated[str, typer.Option(help="comma-separated: direct, rag, agent")] = "direct,rag,agent",
    retriever_url: Annotated[str | None, typer.Option(help="a running retriever; default: start one on --index")] = None,
    index_dir: Annotated[Path, typer.Option("--index", help="index to serve when no --retriever-url")] = DEFAULT_INDEX,
    max_turns: Annotated[int, typer.Option(min=0)] = 4,
    max_tokens_per_turn: Annotated[int, typer.Option(min=1)] = 500,
    max_obs_tokens: Annotated[int, typer.Option(min=1)] = 500,
    topk: Annotated[int, typer.Option(min=1)] = 3,
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    out: Annotated[Path, typer.Option(help="report folder")] = ARTIFACTS / "eval" / "latest",
) -> None:
    """Exact match of a policy on QA benchmarks in direct, RAG and agent modes; writes a report and a chart."""
    from contextlib import nullcontext

    import httpx

    from agent.hf_backend import TransformersBackend
    from agent.policy import load_policy, load_tokenizer
    from agent.rollout import RolloutConfig
    from eval.answerable import cached_answerable_subset
    from eval.harness import evaluate
    from retriever.client import RetrieverClient
    from retriever.process import running_server

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    for m in mode_list:
        if m not in ("direct", "rag", "agent"):
            _fail(f"--modes: unknown mode {m!r} (direct, rag, agent)")
    if subset not in ("answerable", "full"):
        _fail(f"--subset must be 'answerable' or 'full', got {subset!r}")
    try:
        data = load_datasets([d.strip() for d in datasets.split(",") if d.strip()], split, flashrag_root)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        _fail(str(e))
    server = nullcontext(retriever_url) if retriever_url else running_server(index_dir)
    with server as url, RetrieverClient(url, topk=topk, timeout_s=60) as client:
        tag = index_tag(httpx.get(url + "/health", timeout=10).json())
        if subset == "answerable":
            def passages(questions: list[str]) -> list[list[str]]:
                return [[h.contents for h in hits] for hits in client.search(questions, answerable_k)]

            for name in data:
                path = ARTIFACTS / "subsets" / tag / f"{name}-{split}-k{answerable_k}.jsonl"
                chosen = cached_answerable_subset(data[name], passages, answerable_k, tag, path)
                console.print(f"{name}: {chosen.count:,} of {chosen.total:,} answerable (top-{answerable_k} of {tag})")
                data[name] = chosen.examples
        data = {name: examples[:limit] for name, examples in data.items()}
        tokenizer = load_tokenizer(model)
        backend = TransformersBackend(load_policy(model), tokenizer, max_batch_size=batch_size)
        config = RolloutConfig(max_turns=max_turns, max_tokens_per_turn=max_tokens_per_turn,
                               max_obs_tokens=max_obs_tokens, topk=topk)
        label = f"{subset} subset (top-{answerable_k} of {tag}), first {limit}" if subset == "answerable" else (
            f"full {split} set, first {limit}")
        report = evaluate(backend, tokenizer, client, data, mode_list, config, model_name=model, subset=label,
                          out_dir=out, batch_size=batch_size)
    print(report.markdown())  # the Markdown source: readable as is, and wide tables do not get squeezed
    console.print(f"report: {out / 'report.md'}, chart: {out / 'em.png'}, trajectories: {out / 'trajectories'}")


def load_train_examples(cfg, client, tag: str) -> list:
    """The training questions: cfg.data.train (dataset:split), reduced to the answerable subset when asked."""
    from eval.answerable import cached_answerable_subset

    if cfg.data.subset == "answerable" and client is None:
        _fail("data.subset=answerable needs a retriever (rollout.mode=direct has none): set data.subset=full")
    examples = []
    for spec in cfg.data.train:
        name, _, split = spec.partition(":")
        data = load_datasets([name], split or "dev", cfg.data.flashrag_root)[name]
        if cfg.data.subset == "answerable":
            def passages(questions: list[str]) -> list[list[str]]:
                return [[h.contents for h in hits] for hits in client.search(questions, cfg.data.answerable_k)]

            path = ARTIFACTS / "subsets" / tag / f"{name}-{split or 'dev'}-k{cfg.data.answerable_k}.jsonl"
            data = cached_answerable_subset(data, passages, cfg.data.answerable_k, tag, path).examples
        examples += data
    return examples


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option(help="YAML config (configs/cpu_demo.yaml, ...)")] = None,
    resume: Annotated[bool, typer.Option(help="continue the run from its latest checkpoint")] = False,
    init: Annotated[Path | None, typer.Option(help="start from this checkpoint's policy (e.g. SFT); anchor = it")] = None,
) -> None:
    """EMA-PG training. Overrides follow the options as key=value, e.g. `kl.beta=0.01 ema.tau=1.0`."""
    import httpx

    from agent.policy import load_policy, load_tokenizer
    from retriever.client import RetrieverClient
    from trainer.checkpoint import CheckpointError
    from trainer.config import ConfigError, load_config
    from trainer.loop import Trainer, resume_or_start, retriever_context, seed_everything

    try:
        cfg = load_config(config, list(ctx.args))
    except ConfigError as e:
        _fail(str(e))
    seed_everything(cfg.seed)
    with retriever_context(cfg) as url:
        client = RetrieverClient(url, topk=cfg.retriever.topk, timeout_s=cfg.retriever.timeout_s) if url else None
        tag = index_tag(httpx.get(url + "/health", timeout=10).json()) if url else "none"
        examples = load_train_examples(cfg, client, tag)
        console.print(f"{len(examples):,} training questions; run folder {cfg.run_dir}")
        tokenizer = load_tokenizer(cfg.model)
        policy = load_policy(cfg.model, dtype=cfg.dtype)
        trainer = Trainer(cfg, policy, tokenizer, examples, retriever=client)
        try:
            resume_or_start(trainer, resume, init)
        except (CheckpointError, FileNotFoundError, ValueError) as e:
            _fail(str(e))

        def show(iteration: int, m: dict) -> None:
            console.print(
                f"iter {iteration:>4}  reward {m['reward']:.3f}  em {m['em']:.3f}  kl {m.get('kl', 0):.4f}  "
                f"clip {m['clip_fraction']:.3f}  entropy {m['entropy']:.2f}  grad {m['grad_norm']:.2f}  "
                f"len {m['response_tokens']:.0f}  searches {m['searches']:.2f}  "
                f"rollout {m['time_rollout_s']:.0f}s update {m['time_update_s']:.0f}s"
            )

        trainer.run(progress=show)
    console.print(f"done: {cfg.run_dir} (metrics.jsonl, tb/, checkpoints/)")


if __name__ == "__main__":
    app()

"""`emapg`: build corpora and indexes, serve and query the retriever, run the demo."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn, get_args

import typer
from rich.console import Console
from rich.table import Table

from agent.settings import Mode, RolloutSettings
from emapg.workflow import ARTIFACTS
from trainer.config import RetrieverConfig

app = typer.Typer(help="EMA-PG search agents: retrieval service, rollouts, training, evaluation.", no_args_is_help=True)
console = Console()
stderr = Console(stderr=True)  # for `emapg mcp`, whose stdout may be the MCP stdio channel

PACKAGED_CORPUS = ARTIFACTS / "corpus" / "wiki-summaries.jsonl"
DEFAULT_INDEX = ARTIFACTS / "indexes" / "wiki-minilm-flat"


def _log_to(folder: Path) -> None:
    """The engine's logs into the run's folder (made here), unless the console is verbose (emapg/console.py)."""
    from emapg.console import log_to

    folder.mkdir(parents=True, exist_ok=True)
    log_to(folder)


def _fail(message: str, to: Console = console) -> NoReturn:
    to.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


def _default(settings: type, name: str):
    """A typed settings field's default: the CLI shows and uses it, and never keeps a copy of its own."""
    return settings.model_fields[name].default


def _settings(settings: type, options: dict):
    """`settings` validated from CLI options (those left None take the model's own defaults); a refused value fails
    naming its option (--max-turns), with pydantic's reason."""
    from pydantic import ValidationError

    try:
        return settings(**{name: value for name, value in options.items() if value is not None})
    except ValidationError as e:
        error = e.errors()[0]
        _fail(f"--{str(error['loc'][0]).replace('_', '-')}: {error['msg']}")


@app.callback()
def global_options(
    verbose: Annotated[bool, typer.Option("--verbose", envvar="EMAPG_VERBOSE", help="show the engine's (vLLM's) "
                                          "logs on the console; by default they go to the run folder's emapg.log")] = False,
) -> None:
    """EMA-PG search agents: retrieval service, rollouts, training, evaluation."""
    from emapg.console import setup

    setup(verbose)


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
    kind: Annotated[str, typer.Option(help="dense (FAISS), bm25, or another kind of retriever/kinds.py")] = "dense",
    encoder: Annotated[str, typer.Option(help="preset (minilm, e5-base-v2), hub id or local folder")] = "minilm",
    factory: Annotated[str, typer.Option(help="FAISS index factory string: Flat, HNSW32, IVF4096,PQ64, ...")] = "Flat",
    batch_size: Annotated[int | None, typer.Option(min=1, help="passages per encoder call; default 32 on a CPU, "
                                                   "128 on a GPU")] = None,
    train_size: Annotated[int, typer.Option(min=1, help="vectors sampled to train IVF/PQ indexes")] = 100_000,
    copy_corpus: Annotated[bool, typer.Option(help="copy the corpus into the index folder (off for wiki-18)")] = True,
    device: Annotated[str, typer.Option(help="encoder device: cpu, cuda")] = "cpu",
    dtype: Annotated[str, typer.Option(help="passage encoder dtype: float32, bfloat16 (~2x faster where native), or "
                                       "auto (bfloat16 on GPUs and CPUs with AVX512-BF16/AMX, torch and openvino "
                                       "backends)")] = "auto",
    encoder_backend: Annotated[str, typer.Option(help="what runs the encoder: torch, onnx, onnx-int8, openvino "
                                                 "(CPU), or auto (the fastest one that keeps retrieval on a CPU, "
                                                 "torch on a GPU)")] = "auto",
    overwrite: Annotated[bool, typer.Option(help="replace an existing index folder")] = False,
    target_recall: Annotated[float | None, typer.Option(min=0.01, max=1.0, help="choose the cheapest search "
                             "parameters (nprobe, efSearch, k_factor_rf) reaching this recall@k against exact search; "
                             "recorded in the manifest, applied by `serve`")] = None,
    tune_k: Annotated[int, typer.Option(min=1, help="the k of --target-recall")] = 10,
) -> None:
    """Build an index folder from a JSONL corpus."""
    from retriever.encoder import resolve_backend, resolve_dtype
    from retriever.kinds import index_kind

    try:
        chosen_kind = index_kind(kind)
    except ValueError as e:
        _fail(f"--kind: {e}")

    try:
        encoder_backend = resolve_backend(encoder_backend, device, dtype)
    except ValueError as e:
        _fail(f"--encoder-backend: {e}")
    try:
        dtype = resolve_dtype(dtype, device, encoder_backend)
    except ValueError as e:
        _fail(f"--dtype: {e}")
    if corpus_path is None:
        corpus_path = PACKAGED_CORPUS
        if not corpus_path.exists():
            corpus(corpus_path)
    try:
        manifest = chosen_kind.build(corpus_path, out, copy_corpus=copy_corpus, overwrite=overwrite, encoder=encoder,
                                     factory=factory, batch_size=batch_size, train_size=train_size, device=device,
                                     dtype=dtype, backend=encoder_backend, target_recall=target_recall, tune_k=tune_k)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    console.print(f"built {manifest.kind} index of {manifest.corpus.num_docs:,} passages in {out}")
    if manifest.tuning is not None:
        t = manifest.tuning
        console.print(f"search parameters {t.params or '(none)'}: recall@{t.k} {t.recall} on {t.queries} queries"
                      + ("" if t.reached else f", below the target {t.target_recall} even at the most expensive"))


@app.command()
def adopt(
    faiss_file: Annotated[Path, typer.Argument(help="FAISS index built elsewhere, e.g. Search-R1's e5_Flat.index")],
    corpus_path: Annotated[Path, typer.Option("--corpus", help="the JSONL corpus it was built from (row i = line i), "
                                              "e.g. wiki-18.jsonl")],
    encoder: Annotated[str, typer.Option(help="the encoder that built it: preset (e5-base-v2, minilm), hub id or "
                                         "local folder; a folder named like e5 or bge gets Search-R1's prefixes")],
    out: Annotated[Path, typer.Option(help="index folder to create")],
    link: Annotated[str, typer.Option(help="how the folder holds the FAISS file: symlink (no copy; the file must "
                                      "stay where it is), hardlink (same filesystem), or copy")] = "symlink",
    copy_corpus: Annotated[bool, typer.Option(help="copy the corpus into the folder (default: reference it)")] = False,
    sample: Annotated[int, typer.Option(min=1, help="passages re-encoded and compared with their stored "
                                        "vectors")] = 64,
    query_prefix: Annotated[str | None, typer.Option(help="override the encoder's query prefix")] = None,
    passage_prefix: Annotated[str | None, typer.Option(help="override the encoder's passage prefix")] = None,
    device: Annotated[str, typer.Option(help="encoder device for the sample: cpu, cuda")] = "cpu",
    encoder_backend: Annotated[str, typer.Option(help="what runs the encoder: torch, onnx, onnx-int8, openvino "
                                                 "(CPU), or auto")] = "auto",
    overwrite: Annotated[bool, typer.Option(help="replace an existing index folder")] = False,
) -> None:
    """Adopt a FAISS index built elsewhere (Search-R1's wiki-18 e5 index): write our manifest beside it without
    re-encoding the corpus, after checking vector count, dimension, norms and a re-encoded sample; a mismatch is
    refused by name (docs/retriever.md)."""
    from retriever.adopt import AdoptionRefused, Check, adopt_faiss_index

    def show(check: Check) -> None:
        from rich.markup import escape

        mark = "[green]ok[/]" if check.ok else "[bold red]MISMATCH[/]"
        console.print(f"{mark} {check.name}: {escape(check.found)}", highlight=False)

    try:
        manifest = adopt_faiss_index(
            faiss_file, corpus_path, out, encoder=encoder, query_prefix=query_prefix, passage_prefix=passage_prefix,
            link=link, copy_corpus=copy_corpus, sample=sample, device=device, backend=encoder_backend,
            overwrite=overwrite, on_check=show,
        )
    except AdoptionRefused as e:
        _fail(f"{e}; nothing was written to {out}")
    except (FileExistsError, FileNotFoundError, ValueError, RuntimeError) as e:
        _fail(str(e))
    console.print(f"adopted {manifest.corpus.num_docs:,} vectors into {out}: index.faiss is a {manifest.adopted.link}"
                  f"{' of' if manifest.adopted.link == 'copy' else ' to'} {manifest.adopted.source}; serve it with "
                  f"`emapg serve --index {out}`")


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
    max_wait_ms: Annotated[float, typer.Option(min=0.0, help="how long a batch waits for more requests (0: none; "
                                               "requests that arrive while one batch encodes form the next)")] = 0.0,
    cache_size: Annotated[int, typer.Option(min=0, help="LRU entries of query results; 0 turns the cache off")] = 100_000,
    search_threads: Annotated[int, typer.Option(min=1)] = 1,
    device: Annotated[str, typer.Option(help="query encoder device: cpu, cuda")] = "cpu",
    query_dtype: Annotated[str, typer.Option(help="query encoder dtype: float32 or bfloat16")] = "float32",
    encoder_backend: Annotated[str, typer.Option(help="what runs the query encoder: torch, onnx, onnx-int8, openvino "
                                                 "(CPU), or auto (the fastest one that keeps retrieval on a CPU)")] = "auto",
    gpu: Annotated[bool, typer.Option(help="shard the FAISS index over all GPUs in fp16 (needs faiss-gpu)")] = False,
    search_params: Annotated[str | None, typer.Option(help="FAISS search parameters, e.g. nprobe=64; default: "
                                                         "those `emapg index --target-recall` chose, if any")] = None,
    workers: Annotated[int, typer.Option(min=1, help="server processes on this port, each with its own encoder and "
                                         "batcher; the FAISS index is memory-mapped, so they share one copy of it; "
                                         "/metrics and /health are per process")] = 1,
    access_log: Annotated[bool, typer.Option(help="log one line per request (off: /metrics counts them)")] = False,
) -> None:
    """Serve Search-R1's POST /retrieve over an index folder. To scale out past one machine, run replicas (this
    command on other ports or hosts, same index) and give clients all their URLs: `emapg eval --retriever-url A
    --retriever-url B`, `retriever.url=[A,B]` in a run config, or RetrieverClient([A, B]); requests are spread
    round-robin and move to another replica when one fails."""
    from pydantic import ValidationError

    from retriever.manifest import EncoderMismatchError
    from retriever.server import ServerSettings
    from retriever.server import serve as run_server

    try:
        settings = ServerSettings(
            index=index_dir, encoder=encoder, host=host, port=port, default_topk=topk, max_topk=max_topk,
            max_queries=max_queries, max_query_chars=max_query_chars, batching=batching,
            max_batch_queries=max_batch_queries, max_wait_ms=max_wait_ms, cache_size=cache_size,
            search_threads=search_threads, device=device, query_dtype=query_dtype, encoder_backend=encoder_backend,
            gpu_index=gpu,
            search_params=search_params, workers=workers, access_log=access_log,
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
    url: Annotated[list[str] | None, typer.Option(help="retriever URL (default http://127.0.0.1:8000); repeat it for "
                                                  "replicas of one index")] = None,
    topk: Annotated[int, typer.Option(min=1)] = 3,
) -> None:
    """Query a running retriever and print the hits."""
    from retriever.client import RetrieverClient, RetrieverError

    try:  # the client sends EMAPG_RETRIEVER_TOKEN from the environment itself
        with RetrieverClient(url or "http://127.0.0.1:8000", topk=topk, retries=2) as client:
            results = client.search(queries)
    except ValueError as e:
        _fail(f"--url: {e}")
    except RetrieverError as e:
        _fail(str(e))
    for q, hits in zip(queries, results, strict=True):
        print_hits(q, hits)


def _served_limits(urls: str | list[str], to: Console = console, timeout_s: float = 30.0):
    """The search limits of the retriever at `urls` (its /health); a CLI error if none answers."""
    from retriever.client import RetrieverClient, RetrieverError

    try:
        with RetrieverClient(urls, timeout_s=timeout_s, retries=2) as client:
            return client.health().limits
    except ValueError as e:
        _fail(f"--url: {e}", to)
    except RetrieverError as e:
        _fail(str(e), to)


@app.command()
def mcp(
    url: Annotated[list[str] | None, typer.Option(help="retriever URL (default http://127.0.0.1:8000); repeat it for "
                                                  "replicas of one index")] = None,
    transport: Annotated[str, typer.Option(help="stdio (a desktop agent starts this command) or http (streamable "
                                           "HTTP at http://HOST:PORT/mcp, for remote agents)")] = "stdio",
    host: Annotated[str, typer.Option(help="http: bind address; 0.0.0.0 exposes it (set EMAPG_MCP_TOKEN)")] = (
        "127.0.0.1"),
    port: Annotated[int, typer.Option(min=1, max=65535, help="http: port")] = 8001,
    timeout_s: Annotated[float, typer.Option(min=0.1, help="per request to the retriever")] = 30.0,
    retries: Annotated[int, typer.Option(min=0, help="rounds of retries over the retriever replicas")] = 5,
) -> None:
    """Serve the retriever to MCP clients (Claude Desktop, agent frameworks): a `search` tool (query, topk) and an
    `emapg://index` resource, forwarded to a running `emapg serve`. With EMAPG_MCP_TOKEN set, the http transport
    needs `Authorization: Bearer <token>`; EMAPG_RETRIEVER_TOKEN is sent to the retriever."""
    import os

    from agent.protocol import format_hits
    from retriever.mcp_server import MCP_TOKEN_ENV, create_mcp_server

    if transport not in ("stdio", "http"):
        _fail(f"--transport must be 'stdio' or 'http', got {transport!r}", stderr)
    urls = url or "http://127.0.0.1:8000"
    limits = _served_limits(urls, stderr, timeout_s)  # the tool's argument limits are the retriever's own
    token = os.environ.get(MCP_TOKEN_ENV) or None
    server = create_mcp_server(urls, limits, render_hits=format_hits, http_token=token, timeout_s=timeout_s,
                               retries=retries)
    if transport == "stdio":
        server.run("stdio")
    else:
        if token is None and host not in ("127.0.0.1", "localhost", "::1"):
            stderr.print(f"[yellow]warning:[/] {host} without {MCP_TOKEN_ENV}: whoever reaches the port can search")
        stderr.print(f"MCP over streamable HTTP at http://{host}:{port}/mcp" + (" (bearer token)" if token else ""))
        server.run("streamable-http", host=host, port=port)


@app.command("tool-schema")
def tool_schema(
    url: Annotated[str | None, typer.Option(help="a running retriever, whose limits the schema takes; default: "
                                            "the default limits")] = None,
) -> None:
    """Print the search tool's OpenAI function-calling schema (what `GET /tool` serves): put it in a chat
    completion's `tools` and run each call as `POST /retrieve`."""
    from retriever.api import SearchLimits, openai_tool

    limits = SearchLimits() if url is None else _served_limits(url)
    print(openai_tool(limits).model_dump_json(indent=2))


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
    retriever_url: Annotated[list[str] | None, typer.Option(help="a running retriever (repeat it for replicas of one "
                                                      "index); default: start one on --index")] = None,
    index_dir: Annotated[Path, typer.Option("--index", help="index to serve when no --retriever-url")] = DEFAULT_INDEX,
    max_turns: Annotated[int, typer.Option(help="turns that may search")] = _default(RolloutSettings, "max_turns"),
    max_tokens_per_turn: Annotated[int, typer.Option()] = _default(RolloutSettings, "max_tokens_per_turn"),
    max_obs_tokens: Annotated[int, typer.Option()] = _default(RolloutSettings, "max_obs_tokens"),
    topk: Annotated[int, typer.Option(help="documents per search")] = _default(RetrieverConfig, "topk"),
    max_in_flight: Annotated[int, typer.Option(help="trajectories generating at once: a transformers batch, or "
                                               "questions in flight on vLLM (rollout.max_in_flight)")] = _default(
        RolloutSettings, "max_in_flight"),
    backend: Annotated[str | None, typer.Option(help="rollout engine: vllm (continuous rollouts; the default where it "
                                                "is installed) or transformers (the per-turn loop)")] = None,
    out: Annotated[Path, typer.Option(help="report folder")] = ARTIFACTS / "eval" / "latest",
    checkpoint: Annotated[Path | None, typer.Option(help="a training checkpoint (or run folder) whose policy weights "
                                                   "replace --model's")] = None,
    wandb_mode: Annotated[str, typer.Option(help="Weights & Biases: disabled, offline (files under --out/wandb) or "
                                            "online; the report, chart and EM per set and mode attached")] = "disabled",
    wandb_project: Annotated[str, typer.Option(help="the W&B project")] = "emapg",
) -> None:
    """Exact match of a policy on QA benchmarks in direct, RAG and agent modes; writes a report and a chart."""
    arguments = {name: str(value) if isinstance(value, Path) else value for name, value in locals().items()}
    from pydantic import ValidationError

    from emapg.session import open_session
    from emapg.workflow import answerable, load_datasets
    from retriever.client import retrieve_endpoints
    from trainer.run.checkpoint import CheckpointError, load_policy_weights
    from trainer.config import TrainConfig, WandbSection
    from trainer.run.wandb_logger import attach_reports

    try:
        wandb = WandbSection(mode=wandb_mode, project=wandb_project)
    except ValidationError as e:
        _fail(f"--wandb-mode: {e.errors()[0]['msg']}")
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    for m in mode_list:
        if m not in get_args(Mode):
            _fail(f"--modes: unknown mode {m!r} ({', '.join(get_args(Mode))})")
    if subset not in ("answerable", "full"):
        _fail(f"--subset must be 'answerable' or 'full', got {subset!r}")
    if retriever_url:
        try:
            retrieve_endpoints(retriever_url)
        except ValueError as e:
            _fail(f"--retriever-url: {e}")
    rollout = _settings(RolloutSettings, {"max_turns": max_turns, "max_tokens_per_turn": max_tokens_per_turn,
                                          "max_obs_tokens": max_obs_tokens, "max_in_flight": max_in_flight,
                                          "backend": backend})
    retriever = _settings(RetrieverConfig, {"url": retriever_url or None, "index": index_dir, "topk": topk})
    try:
        data = load_datasets([d.strip() for d in datasets.split(",") if d.strip()], split, flashrag_root)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        _fail(str(e))
    # The evaluation's whole configuration: the session opens what it names (a started server on --index without
    # --retriever-url; the policy only where it is sampled from in memory or carries a checkpoint).
    cfg = TrainConfig(model=model, retriever=retriever, rollout=rollout)
    _ensure_index(index_dir, retriever_url)  # after every option is checked: building the default takes minutes
    _log_to(out)
    with open_session(cfg) as session:
        tag = session.index_tag
        if subset == "answerable":
            data = {name: answerable(examples, session.client, answerable_k, tag, f"{name}-{split}")
                    for name, examples in data.items()}
        data = {name: examples[:limit] for name, examples in data.items()}
        policy = None  # vLLM loads --model itself
        if checkpoint is not None:
            policy = session.policy
            try:
                policy.load_state_dict(load_policy_weights(checkpoint))
            except (CheckpointError, RuntimeError) as e:
                _fail(f"--checkpoint: {e}")
        label = f"{subset} subset (top-{answerable_k} of {tag}), first {limit}" if subset == "answerable" else (
            f"full {split} set, first {limit}")
        report = session.evaluate(data, name=model, out_dir=out, subset=label, modes=mode_list, policy=policy)
    attach_reports(out, wandb, out.name, arguments, [out / "report.md", out / "report.json", out / "em.png"],
                   summary={f"em/{r.dataset}/{r.mode}": r.em for r in report.results}, job_type="eval")
    print(report.markdown())  # the Markdown source: readable as is, and wide tables do not get squeezed
    console.print(f"report: {out / 'report.md'}, chart: {out / 'em.png'}, trajectories: {out / 'trajectories'}")


def _run_config(ctx: typer.Context, config: Path | None):
    from transformers import set_seed

    from trainer.config import ConfigError, load_config

    try:
        cfg = load_config(config, list(ctx.args))
    except ConfigError as e:
        _fail(str(e))
    set_seed(cfg.seed)
    return cfg


def _train_questions(cfg, client, tag: str) -> list:
    from emapg.workflow import train_examples

    try:
        return train_examples(cfg, client, tag)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))


# MiniLM passages per second on 2 cores with the default encoder (openvino) by the dtype `auto` gives: fp32 on CPUs
# without native bf16 (torch fp32 encodes ~21/s on CPUs without AVX-512, and the exported graph 1.2-1.5x that), bf16
# where native (~100/s on an AVX512-BF16 EPYC; docs/benchmarks.md, "Encoder backends").
DEFAULT_INDEX_RATE = {"float32": 32, "bfloat16": 100}
PACKAGED_PASSAGES = 10_033


def _ensure_index(index_dir: Path, retriever_url=None, needs_retriever: bool = True) -> None:
    """Make sure the run can start its retriever: nothing to do when it is given a running one (`retriever_url`) or
    needs none; the packaged-Wikipedia index is built once at the default place, saying first how long that takes;
    any other missing index is an error."""
    if retriever_url or not needs_retriever or (index_dir / "manifest.json").exists():
        return
    if index_dir.resolve() not in (DEFAULT_INDEX.resolve(), RetrieverConfig().index.resolve()):
        _fail(f"no index at {index_dir} (no manifest.json): build it with `emapg index --out {index_dir}` or give a "
              "running retriever's URL")
    from retriever.encoder import resolve_backend, resolve_dtype

    backend = resolve_backend("auto", "cpu", "auto")
    dtype = resolve_dtype("auto", "cpu", backend)
    minutes = PACKAGED_PASSAGES / DEFAULT_INDEX_RATE[dtype] / 60
    console.rule(f"building the MiniLM index of {PACKAGED_PASSAGES:,} packaged Wikipedia passages in {index_dir} "
                 f"({backend}, {dtype}): about {minutes:.0f} minutes on 2 cores, once; later runs reuse it")
    index(out=index_dir)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def sft(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option(help="YAML config (configs/cpu_demo.yaml, ...); its sft section")] = None,
) -> None:
    """Warm start: build protocol demonstrations with the real retriever, then supervised training on their model
    tokens. Writes <run>/sft/checkpoints/ for `emapg train --init`. Overrides as key=value, e.g. `sft.lr=1e-5`."""
    from agent.policy import load_policy
    from emapg.session import open_session
    from emapg.workflow import build_sft_data, run_sft

    cfg = _run_config(ctx, config)
    if cfg.rollout.mode != "agent":
        _fail("sft builds search demonstrations: rollout.mode must be agent")
    _ensure_index(cfg.retriever.index, cfg.retriever.url)
    _log_to(cfg.sft_dir)
    with open_session(cfg) as session:
        examples = _train_questions(cfg, session.client, session.index_tag)
        tokenizer = session.tokenizer
        demos = build_sft_data(cfg, session.client, tokenizer, examples)
    if not demos:
        _fail("no demonstrations: no train question's retrieved documents show its gold answer")
    path = run_sft(cfg, load_policy(cfg.model, dtype=cfg.dtype), tokenizer, demos)
    console.print(f"done: {path}; start RL with `emapg train --init {cfg.sft_dir}`")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option(help="YAML config (configs/cpu_demo.yaml, ...)")] = None,
    resume: Annotated[bool, typer.Option(help="continue the run from its latest checkpoint")] = False,
    init: Annotated[Path | None, typer.Option(help="start from this checkpoint's (or run folder's latest) policy, "
                                              "e.g. SFT's; the anchor starts equal to it")] = None,
) -> None:
    """EMA-PG training. Overrides follow the options as key=value, e.g. `kl.beta=0.01 ema.tau=1.0`."""
    from emapg.session import open_session
    from emapg.workflow import print_iteration
    from trainer.run.checkpoint import CheckpointError
    from trainer.run.guard import GuardError, events_markdown
    from trainer.run.loop import Trainer, resume_or_start

    cfg = _run_config(ctx, config)
    _ensure_index(cfg.retriever.index, cfg.retriever.url, cfg.rollout.mode != "direct")
    _log_to(cfg.run_dir)
    with open_session(cfg) as session:
        client = session.client
        examples = _train_questions(cfg, client, session.index_tag)
        console.print(f"{len(examples):,} training questions; run folder {cfg.run_dir}")
        if cfg.distributed.backend == "ray":
            from trainer.run.ray_workers import RayWorkers

            # The actors reach the same retriever(s) as this driver: the URLs in use, including a started server's.
            cfg.retriever.url = client.urls if client is not None else None
            try:
                engine = RayWorkers(cfg)
            except NotImplementedError as e:
                _fail(str(e))
            close = engine.close
        else:  # the session closes its engine
            engine, close = session.local_engine(), lambda: None
        trainer = Trainer(cfg, engine, session.tokenizer, examples)
        try:
            try:
                resume_or_start(trainer, resume, init)
            except (CheckpointError, FileNotFoundError, ValueError) as e:
                _fail(str(e))
            try:
                trainer.run(progress=print_iteration)
            except GuardError as e:
                _fail(f"{e} (events: {trainer.guard.events_path})")
        finally:
            close()
    console.print("\n".join(events_markdown(cfg.run_dir)))
    console.print(f"done: {cfg.run_dir} (metrics.jsonl, guard_events.jsonl, tb/, checkpoints/)")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def demo(
    ctx: typer.Context,
    config: Annotated[Path, typer.Option(help="the run's config")] = Path("configs/cpu_demo.yaml"),
    index_dir: Annotated[Path | None, typer.Option("--index", help="index folder (built if missing); default: "
                                                   "the config's retriever.index")] = None,
) -> None:
    """The whole job on the CPU default: index, serve, evaluate the base model, SFT warm start, evaluate, EMA-PG,
    evaluate, report (table with 95% CIs, training curves). Overrides as key=value."""
    from emapg.demo import run_demo

    cfg = _run_config(ctx, config)
    cfg.retriever.index = index_dir or cfg.retriever.index
    _ensure_index(cfg.retriever.index, cfg.retriever.url)
    report = run_demo(cfg)
    console.print(f"report: {report}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def compare(
    ctx: typer.Context,
    config: Annotated[Path, typer.Option(help="the run's config")] = Path("configs/cpu_compare.yaml"),
    init: Annotated[Path | None, typer.Option(help="SFT checkpoint or run folder every method starts from; "
                                              "default: the run's own SFT (made first if missing)")] = None,
    eval_every: Annotated[int, typer.Option(min=1, help="held-out evaluation every N iterations and at the end")] = 10,
    methods: Annotated[str, typer.Option(help="comma-separated methods to run: GRPO (fixed reference, k3), EMA-k3 "
                                         "(EMA anchor, k3), EMA-PG (EMA anchor, Top-k)")] = "GRPO,EMA-k3,EMA-PG",
    index_dir: Annotated[Path | None, typer.Option("--index", help="index folder (built if missing); default: "
                                                   "the config's retriever.index")] = None,
    seeds: Annotated[str, typer.Option(help="comma-separated training seeds (e.g. 0,1,2,3): every method once per "
                                       "seed, and a report testing the methods across seeds (exact sign-flip, "
                                       "bootstrap, Holm); default: one run at the config's seed")] = "",
    comparisons: Annotated[str, typer.Option("--compare", help="with --seeds: the comparisons declared before the "
                                             "first run, A:B pairs, e.g. EMA-PG:GRPO,EMA-k3:GRPO; default: every "
                                             "later method against every earlier one")] = "",
) -> None:
    """The paper's rows from the same SFT checkpoint, same seeds and budget: GRPO (fixed reference, k3 KL), EMA-k3
    (EMA anchor, k3) and EMA-PG (EMA anchor, Top-k KL); held-out EM over training, the EMA anchors at the end, and
    paired tests against SFT and between methods. Resumes if run again. Overrides as key=value."""
    from emapg.compare import run_compare
    from trainer.methods import chosen_methods

    try:
        chosen = [method.name for method in chosen_methods(methods)]
        seed_list = [int(seed) for seed in seeds.split(",") if seed.strip()]
        declared = [tuple(pair.split(":")) for pair in comparisons.split(",") if pair.strip()]
    except ValueError as e:
        _fail(f"--methods/--seeds: {e}")
    if len(set(seed_list)) != len(seed_list):
        _fail(f"--seeds: {seeds!r} names a seed twice")
    if declared and not seed_list:
        _fail("--compare declares comparisons across seeds: give --seeds too")
    for pair in declared:
        if len(pair) != 2 or not set(pair) <= set(chosen) or pair[0] == pair[1]:
            _fail(f"--compare: {':'.join(pair)!r} must be A:B, two different methods of {chosen}")
    cfg = _run_config(ctx, config)
    cfg.retriever.index = index_dir or cfg.retriever.index
    _ensure_index(cfg.retriever.index, cfg.retriever.url, cfg.rollout.mode != "direct")
    _log_to(cfg.run_dir)
    try:
        report = run_compare(cfg, init, eval_every, chosen, seed_list or None, declared or None)
    except ValueError as e:  # e.g. a plan.json that declares another family
        _fail(str(e))
    console.print(f"report: {report}")


@app.command()
def export(
    source: Annotated[Path, typer.Argument(help="a run folder (its latest checkpoint) or a checkpoint folder")],
    out: Annotated[Path, typer.Option(help="the Hugging Face model folder to write")],
    anchor: Annotated[bool, typer.Option("--anchor", help="the run's EMA anchor (its KL reference) instead of its "
                                         "policy")] = False,
    base: Annotated[Path | None, typer.Option(help="LoRA runs: the full-weight checkpoint or run folder the run "
                                              "started from (its `train --init`), when it is neither the run's "
                                              "model nor found beside the run")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an existing non-empty --out")] = False,
) -> None:
    """Write a checkpoint's policy (or EMA anchor) as a plain Hugging Face model folder (safetensors, config,
    tokenizer, generation config, a model card with the run's method, config and held-out EM) that transformers,
    vLLM and the Hub load as it is; LoRA adapters are merged into the base weights."""
    from emapg.export import CheckpointError, ExportError
    from emapg.export import export as export_model

    try:
        exported = export_model(source, out, anchor=anchor, base=base, overwrite=overwrite)
    except (CheckpointError, ExportError) as e:
        _fail(str(e))
    held_out = f"held-out EM from {exported.evaluation}" if exported.evaluation else "held-out EM: not evaluated"
    console.print(f"wrote the {exported.which} of {exported.checkpoint} (iteration {exported.iteration}) to "
                  f"{exported.folder}" + (f", LoRA merged on {exported.lora_base}" if exported.lora_base else "")
                  + f"; {held_out}")


@app.command()
def view(
    run_dirs: Annotated[list[Path], typer.Argument(help="run folders (a demo's, a comparison's, an evaluation's)")],
    host: Annotated[str, typer.Option(help="bind address; the page serves the runs' files to whoever reaches it")] = (
        "127.0.0.1"),
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8050,
    tokenizer: Annotated[str | None, typer.Option(help="decodes the trajectories' token ids; default: each run's "
                                                  "model (its config), else the packaged SmolLM2")] = None,
) -> None:
    """A local web page over run folders: training curves, every rollout and evaluation trajectory turn by turn
    (queries, returned documents, answers), filters, and two runs side by side on the same questions."""
    from emapg.view import serve

    missing = [str(d) for d in run_dirs if not d.is_dir()]
    if missing:
        _fail(f"not a run folder: {', '.join(missing)}")
    if host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]warning:[/] {host}: whoever reaches the port can read these runs' trajectories")
    console.print(f"emapg view: http://{host}:{port}/ over {', '.join(map(str, run_dirs))} (Ctrl-C stops it)")
    serve(run_dirs, host=host, port=port, tokenizer_name=tokenizer)


if __name__ == "__main__":
    app()

"""`emapg`'s retrieval-service commands: build a corpus and an index (or adopt one built elsewhere), serve it, and
its clients (search, the MCP server, the tool schema)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from emapg.cli_common import DEFAULT_INDEX, PACKAGED_CORPUS, app, console, fail, stderr

Overwrite = Annotated[bool, typer.Option(help="replace an existing index folder")]
RetrieverUrls = Annotated[list[str] | None, typer.Option(help="retriever URL (default http://127.0.0.1:8000); repeat "
                                                         "it for replicas of one index")]

@app.command()
def corpus(out: Annotated[Path, typer.Option(help="JSONL file to write")] = PACKAGED_CORPUS) -> None:
    """Write the packaged 10,033 Wikipedia summaries as a Search-R1 JSONL corpus."""
    from data.corpus import packaged_wiki_passages, write_jsonl

    try:
        n = write_jsonl(packaged_wiki_passages(), out)
    except FileNotFoundError as e:
        fail(str(e))
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
    overwrite: Overwrite = False,
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
        fail(f"--kind: {e}")

    try:
        encoder_backend = resolve_backend(encoder_backend, device, dtype)
    except ValueError as e:
        fail(f"--encoder-backend: {e}")
    try:
        dtype = resolve_dtype(dtype, device, encoder_backend)
    except ValueError as e:
        fail(f"--dtype: {e}")
    if corpus_path is None:
        corpus_path = PACKAGED_CORPUS
        if not corpus_path.exists():
            corpus(corpus_path)
    try:
        manifest = chosen_kind.build(corpus_path, out, copy_corpus=copy_corpus, overwrite=overwrite, encoder=encoder,
                                     factory=factory, batch_size=batch_size, train_size=train_size, device=device,
                                     dtype=dtype, backend=encoder_backend, target_recall=target_recall, tune_k=tune_k)
    except (FileExistsError, FileNotFoundError, ValueError) as e:
        fail(str(e))
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
    sample: Annotated[str, typer.Option(help="passages re-encoded and compared with their stored vectors (plus "
                                        "the first and last), or `all`: every row (docs/retriever.md)")] = "64",
    query_prefix: Annotated[str | None, typer.Option(help="override the encoder's query prefix")] = None,
    passage_prefix: Annotated[str | None, typer.Option(help="override the encoder's passage prefix")] = None,
    device: Annotated[str, typer.Option(help="encoder device for the sample: cpu, cuda")] = "cpu",
    encoder_backend: Annotated[str, typer.Option(help="what runs the encoder: torch, onnx, onnx-int8, openvino "
                                                 "(CPU), or auto")] = "auto",
    overwrite: Overwrite = False,
) -> None:
    """Adopt a FAISS index built elsewhere (Search-R1's wiki-18 e5 index): write our manifest beside it without
    re-encoding the corpus, after checking vector count, dimension, norms and a re-encoded sample; a mismatch is
    refused by name (docs/retriever.md)."""
    from retriever.adopt import AdoptionRefused, Check, adopt_faiss_index, sample_size

    def show(check: Check) -> None:
        from rich.markup import escape

        mark = "[green]ok[/]" if check.ok else "[bold red]MISMATCH[/]"
        console.print(f"{mark} {check.name}: {escape(check.found)}", highlight=False)

    try:
        manifest = adopt_faiss_index(
            faiss_file, corpus_path, out, encoder=encoder, query_prefix=query_prefix, passage_prefix=passage_prefix,
            link=link, copy_corpus=copy_corpus, sample=sample_size(sample), device=device, backend=encoder_backend,
            overwrite=overwrite, on_check=show,
        )
    except AdoptionRefused as e:
        fail(f"{e}; nothing was written to {out}")
    except (FileExistsError, FileNotFoundError, ValueError, RuntimeError) as e:
        fail(str(e))
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
        fail(" ".join(f"--{'-'.join(map(str, err['loc'])).replace('_', '-')}: {err['msg']}" for err in e.errors()))
    except (EncoderMismatchError, FileNotFoundError, ValueError, RuntimeError) as e:
        fail(str(e))


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
    url: RetrieverUrls = None,
    topk: Annotated[int, typer.Option(min=1)] = 3,
) -> None:
    """Query a running retriever and print the hits."""
    from retriever.client import RetrieverClient, RetrieverError

    try:  # the client sends EMAPG_RETRIEVER_TOKEN from the environment itself
        with RetrieverClient(url or "http://127.0.0.1:8000", topk=topk, retries=2) as client:
            results = client.search(queries)
    except ValueError as e:
        fail(f"--url: {e}")
    except RetrieverError as e:
        fail(str(e))
    for q, hits in zip(queries, results, strict=True):
        print_hits(q, hits)


def _served_limits(urls: str | list[str], to: Console = console, timeout_s: float = 30.0):
    """The search limits of the retriever at `urls` (its /health); a CLI error if none answers."""
    from retriever.client import RetrieverClient, RetrieverError

    try:
        with RetrieverClient(urls, timeout_s=timeout_s, retries=2) as client:
            return client.health().limits
    except ValueError as e:
        fail(f"--url: {e}", to)
    except RetrieverError as e:
        fail(str(e), to)


@app.command()
def mcp(
    url: RetrieverUrls = None,
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
        fail(f"--transport must be 'stdio' or 'http', got {transport!r}", stderr)
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

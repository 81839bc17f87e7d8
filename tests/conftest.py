"""Shared fixtures: a small real corpus cut from the packaged Wikipedia, real indexes over it, a real server."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from data.corpus import packaged_wiki_passages, write_jsonl

SMALL_CORPUS_DOCS = 400  # MiniLM encodes this in a few seconds on 2 cores


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """The first 400 packaged Wikipedia summaries plus 'Pride and Prejudice' and 'Jane Austen'."""
    passages = list(itertools.islice(packaged_wiki_passages(), SMALL_CORPUS_DOCS))
    wanted = {"Pride and Prejudice", "Jane Austen"}
    passages += [p for p in packaged_wiki_passages() if p.title in wanted]
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl"
    write_jsonl(iter(passages), path)
    return path


@pytest.fixture(scope="session")
def dense_index_dir(small_corpus, tmp_path_factory) -> Path:
    from retriever.dense import build_dense_index

    out = tmp_path_factory.mktemp("indexes") / "minilm-flat"
    build_dense_index(small_corpus, out, encoder="minilm", factory="Flat")
    return out


@pytest.fixture(scope="session")
def bm25_index_dir(small_corpus, tmp_path_factory) -> Path:
    from retriever.bm25 import build_bm25_index

    out = tmp_path_factory.mktemp("indexes") / "bm25"
    build_bm25_index(small_corpus, out)
    return out


@pytest.fixture(scope="session")
def dense_index(dense_index_dir):
    from retriever.index import load_index

    return load_index(dense_index_dir)


@pytest.fixture(scope="session")
def server_url(dense_index_dir, tmp_path_factory):
    """The real server as a child process on a free loopback port, with small limits to test them."""
    from retriever.process import running_server

    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server(
        dense_index_dir, "--max-queries", "300", "--max-query-chars", "500", "--max-topk", "50", log=log
    ) as url:
        yield url


def copy_index(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def edit_manifest(folder: Path, **changes) -> None:
    path = folder / "manifest.json"
    m = json.loads(path.read_text())
    for dotted, value in changes.items():
        node = m
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    path.write_text(json.dumps(m))


@pytest.fixture(scope="session")
def tokenizer():
    """The real SmolLM2 tokenizer (converted once from the packaged GGUF)."""
    from agent.policy import load_tokenizer

    return load_tokenizer()


def tiny_llama(tokenizer, hidden: int = 64, heads: int = 4, kv_heads: int = 2):
    """A 2-layer random Llama over SmolLM2's vocabulary (seed 0): real shapes and tokenizer, seconds on CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return tiny_llama(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model, tokenizer, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    tiny_model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def memorise_search_trajectory(model, tokenizer, url: str, question: str, searches: list[str], answer: str,
                               max_obs_tokens: int = 500):
    """A copy of `model` trained until it reproduces one real trajectory (search -> the server's <information> ->
    ... -> answer) greedily: tiny random models then make multi-turn rollouts through the real server."""
    import copy

    import torch
    import torch.nn.functional as F

    from agent.protocol import format_hits, observation_ids, prompt_ids, prompt_text
    from retriever.client import RetrieverClient

    with RetrieverClient(url) as client:
        observations = [format_hits(hits) for hits in client.search(searches, 3)]
    ids = prompt_ids(tokenizer, prompt_text(question))
    mask = [0] * len(ids)
    for query, observation in zip(searches, observations, strict=True):
        turn = tokenizer.encode(f"<search> {query} </search>", add_special_tokens=False)
        obs = observation_ids(tokenizer, observation, max_obs_tokens)
        ids, mask = ids + turn + obs, mask + [1] * len(turn) + [0] * len(obs)
    final = tokenizer.encode(f"<answer> {answer} </answer>", add_special_tokens=False)
    ids, mask = torch.tensor([ids + final]), torch.tensor(mask + [1] * len(final))
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    targets = mask[1:].bool()  # positions whose next token is the model's own
    for _ in range(500):
        hidden = model.get_decoder()(ids).last_hidden_state[0, :-1][targets]
        loss = F.cross_entropy(model.get_output_embeddings()(hidden), ids[0, 1:][targets])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    return model.eval()


def local_engine(cfg, policy, tokenizer, backend=None, retriever=None):
    """A LocalWorkers as a Session makes one: the backend (the configured one unless given) and the agent from
    agent.factory."""
    from agent.factory import make_agent, open_backend
    from trainer.run.workers import LocalWorkers

    backend = backend or open_backend(cfg.rollout, cfg.model, tokenizer, policy, dtype=cfg.dtype, seed=cfg.seed)
    agent = make_agent(backend, tokenizer, retriever, cfg.rollout, retriever_timeout_s=cfg.retriever.timeout_s)
    return LocalWorkers(cfg, policy, backend, agent)


# Markers that say what a test starts, so the edit loop can leave those out (`make test-fast`). They are read off
# what the test (and every fixture it uses) calls, not declared by hand: a test that starts a server is marked however
# it was written. `make test` runs every test whatever its markers.
STARTS = {
    "server": ("server_url", "running_server(", "start_server(", "viewer_url", "serve_in_thread", "\"serve\"",
               "'serve'", "\"view\", str("),
    "engine": ("vllm", "VLLM", "start_ray", "ray.init", "RayWorkers", "RolloutWorker", "mechanism.run",
               "init_process_group"),
    "browser": ("chromium", "page(viewer_url", " = page("),
    "process": ("subprocess.run(", "subprocess.Popen(", "Popen(", "check_output(", "mp.spawn", "multiprocessing"),
}


def _sources(item) -> str:
    """The test's source, its fixtures' and that of the module's own functions either calls (one level down: a
    helper that starts the server is read too)."""
    import inspect

    functions = [getattr(item, "function", None)]
    for defs in item._fixtureinfo.name2fixturedefs.values():
        functions += [d.func for d in defs]
    module = getattr(item, "module", None)
    for fn in list(functions):
        for name in getattr(getattr(fn, "__code__", None), "co_names", ()):
            helper = getattr(module, name, None)
            if inspect.isfunction(helper) and helper.__module__ == getattr(module, "__name__", None):
                functions.append(helper)
    texts = []
    for fn in functions:
        try:
            texts.append(inspect.getsource(fn))
        except (OSError, TypeError):
            continue
    return "\n".join(texts)


def pytest_configure(config):
    for name, about in (("server", "starts a retrieval or viewer server"), ("engine", "starts vLLM, Ray or a "
                        "process group"), ("browser", "renders a page in headless Chromium"),
                        ("process", "starts another Python process (the CLI, a benchmark, an experiment)")):
        config.addinivalue_line("markers", f"{name}: {about} (set by tests/conftest.py from what the test calls)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        source = _sources(item)
        for marker, signals in STARTS.items():
            if any(signal in source for signal in signals):
                item.add_marker(marker)

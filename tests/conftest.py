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


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    """A 2-layer random Llama over SmolLM2's vocabulary: real shapes and tokenizer, seconds on CPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model, tokenizer, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    tiny_model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

import os
import subprocess
import sys

import pytest

from retriever.index import load_index


@pytest.fixture(scope="module")
def bm25(bm25_index_dir):
    return load_index(bm25_index_dir)


def title_of(hit) -> str:
    return hit.contents.partition("\n")[0].strip('"')


def test_exact_title_query_ranks_that_page_first(bm25):
    for title in ["Pride and Prejudice", "Jane Austen"]:
        (hits,) = bm25.search([title], 3)
        assert title_of(hits[0]) == title
    # A generic title ("Islamic architecture") can lose to a page that repeats its words more often, as in any
    # BM25; over the whole small corpus the exact-title page must still come first for the large majority.
    titles = [bm25.docstore.get(i).title for i in range(len(bm25.docstore))]
    first = [bool(hits) and title_of(hits[0]) == t for hits, t in zip(bm25.search(titles, 1), titles, strict=True)]
    assert sum(first) / len(first) >= 0.85


def test_no_shared_term_means_no_hit(bm25):
    (hits,) = bm25.search(["zzqxj wvvkp"], 5)
    assert hits == []
    (hits,) = bm25.search(["jane austen"], 1000)  # k above the corpus size is clamped, not an error
    assert 0 < len(hits) <= len(bm25.docstore)
    assert all(a.score >= b.score > 0 for a, b in zip(hits, hits[1:]))


def test_bm25_index_takes_no_encoder(bm25_index_dir):
    with pytest.raises(ValueError, match="takes no encoder"):
        load_index(bm25_index_dir, encoder="minilm")


def test_bm25s_is_imported_with_jax_kept_on_the_cpu_unless_the_caller_chose():
    # On a GPU machine with JAX installed, bm25s's import made JAX preallocate 75% of the GPU in the trainer and in
    # the retrieval server, and the policy's first step ran out of memory (an H200, docs/benchmarks.md).
    probe = ("import os; from retriever.bm25 import BM25Manifest, tokenize; "
             "tokenize(['a b'], BM25Manifest()); print(os.environ['JAX_PLATFORMS'])")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    chosen = subprocess.run([sys.executable, "-c", probe], env={**env, "JAX_PLATFORMS": "cuda"}, capture_output=True,
                            text=True, check=True)
    default = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert (default.stdout.strip(), chosen.stdout.strip()) == ("cpu", "cuda")

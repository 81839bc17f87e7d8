import numpy as np
import pytest

import faiss

from retriever.dense import BLAS_MIN_QUERIES, new_faiss_index, train_faiss_index, use_blas_from


def numpy_topk(queries: np.ndarray, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    scores = queries @ vectors.T
    rows = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, rows, axis=1), rows


def unit_rows(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_flat_index_equals_brute_force_numpy_topk():
    rng = np.random.default_rng(0)
    vectors, queries = unit_rows(rng, 5000, 64), unit_rows(rng, 50, 64)
    index = new_faiss_index(64, "Flat")
    index.add(vectors)
    scores, rows = index.search(queries, 10)
    want_scores, want_rows = numpy_topk(queries, vectors, 10)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-5)


@pytest.mark.parametrize("min_queries", [1, 10_000])
def test_flat_search_through_blas_and_per_query_scan_both_equal_numpy(min_queries):
    """FAISS's two exhaustive paths (BLAS for batches from `min_queries` up, else one scan per query) give numpy's
    top-k: the server's choice of path changes speed, never results."""
    rng = np.random.default_rng(1)
    vectors, queries = unit_rows(rng, 5000, 64), unit_rows(rng, 50, 64)
    index = new_faiss_index(64, "Flat")
    index.add(vectors)
    before = faiss.cvar.distance_compute_blas_threshold
    try:
        use_blas_from(min_queries, 64)
        assert faiss.cvar.distance_compute_blas_threshold == min_queries * 64
        scores, rows = index.search(queries, 10)
    finally:
        faiss.cvar.distance_compute_blas_threshold = before
    want_scores, want_rows = numpy_topk(queries, vectors, 10)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-5)


def test_loading_an_index_sends_batches_of_blas_min_queries_through_blas(dense_index_dir):
    from retriever.index import load_index

    faiss.cvar.distance_compute_blas_threshold = 128_000  # faiss-cpu 1.15.1's default
    index = load_index(dense_index_dir)
    assert faiss.cvar.distance_compute_blas_threshold == BLAS_MIN_QUERIES * index.faiss_index.d


def test_real_encoder_search_equals_brute_force_over_its_own_embeddings(dense_index):
    """The served path (encode -> FAISS -> docstore) returns numpy's top-k over the same MiniLM vectors."""
    store = dense_index.docstore
    passages = [store.get(i).contents for i in range(len(store))]
    vectors = dense_index.encoder.encode_passages(passages)
    questions = ["who wrote pride and prejudice", "largest city in the world", "a famous painting"]
    want_scores, want_rows = numpy_topk(dense_index.encoder.encode_queries(questions), vectors, 5)
    for hits, rows, scores in zip(dense_index.search(questions, 5), want_rows, want_scores, strict=True):
        assert [h.id for h in hits] == [store.get(int(r)).id for r in rows]
        np.testing.assert_allclose([h.score for h in hits], scores, atol=1e-4)


def test_pride_and_prejudice_finds_austens_novel(dense_index):
    (hits,) = dense_index.search(["who wrote pride and prejudice"], 3)
    assert hits[0].contents.startswith('"Pride and Prejudice"')


@pytest.mark.parametrize("factory", ["HNSW32", "IVF16,Flat", "IVF16,PQ8x4"])
def test_approximate_indexes_train_and_find_exact_neighbours(factory):
    rng = np.random.default_rng(1)
    vectors = unit_rows(rng, 3000, 32)
    index = new_faiss_index(32, factory)
    if not index.is_trained:
        train_faiss_index(index, vectors, factory)
    index.add(vectors)
    _, rows = index.search(vectors[:20], 1)
    assert (rows[:, 0] == np.arange(20)).mean() >= 0.9  # a stored vector is its own nearest neighbour


def test_bad_factory_and_too_little_training_data_are_clear_errors():
    with pytest.raises(ValueError, match="NotAnIndex"):
        new_faiss_index(32, "NotAnIndex")
    index = new_faiss_index(32, "IVF1024,Flat")
    with pytest.raises(ValueError, match="at least 1024 training vectors"):
        train_faiss_index(index, np.zeros((100, 32), np.float32), "IVF1024,Flat")


def test_gpu_flag_without_faiss_gpu_is_a_clear_error():
    import faiss

    from retriever.dense import to_all_gpus

    if faiss.get_num_gpus() > 0:
        pytest.skip("this machine has GPUs for faiss")
    with pytest.raises(RuntimeError, match="needs faiss-gpu"):
        to_all_gpus(new_faiss_index(8, "Flat"))


def test_auto_dtype_is_bf16_only_where_native_and_bad_names_are_refused(monkeypatch):
    import pytest

    from emapg.session import index_tag
    from retriever.api import Health
    from retriever import encoder

    monkeypatch.setattr(encoder, "native_bf16", lambda device="cpu": True)
    assert encoder.resolve_dtype("auto") == "bfloat16"
    monkeypatch.setattr(encoder, "native_bf16", lambda device="cpu": False)
    assert encoder.resolve_dtype("auto") == "float32" and encoder.resolve_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="float16"):
        encoder.resolve_dtype("float16")
    # Answerable subsets are cached per index tag: a bf16-encoded index must not share an fp32 index's cache.
    health = {"kind": "dense", "encoder": "x/MiniLM", "index_factory": "Flat", "num_docs": 5, "corpus_sha256": "0",
              "batching": True, "cache_entries": 0, "limits": {}}

    def tag(passage_dtype):
        return index_tag(Health.model_validate({**health, "passage_dtype": passage_dtype}))

    assert tag("float32") == tag(None) == "dense-MiniLM-Flat-5"
    assert tag("bfloat16") == "dense-MiniLM-Flat-bfloat16-5"

"""Recall against exact search and the parameter search (retriever/tuning.py), each against a brute-force reference;
then `emapg index --target-recall` end to end: the chosen nprobe is recorded, applied by the server and shown in
/health."""

from __future__ import annotations

import json

import faiss
import numpy as np
import pytest

from retriever.tuning import ExactTopK, first_reaching, parameter_values, recall_at_k, tune_search


def unit_rows(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_recall_at_k_counts_shared_rows_over_k_and_a_missing_row_as_a_miss():
    rng = np.random.default_rng(0)
    for _ in range(50):
        k = int(rng.integers(1, 8))
        truth = np.stack([rng.choice(100, size=k + 2, replace=False) for _ in range(6)])
        found = np.stack([rng.choice(100, size=k + 2, replace=False) for _ in range(6)])
        found[rng.random(found.shape) < 0.2] = -1
        want = np.mean([len({int(r) for r in f[:k] if r >= 0} & set(t[:k].tolist())) / k
                        for f, t in zip(found, truth, strict=True)])
        assert recall_at_k(found, truth, k) == pytest.approx(want)
    with pytest.raises(ValueError, match="recall@3"):
        recall_at_k(np.zeros((2, 3)), np.zeros((2, 2)), 3)


def test_streamed_exact_top_k_equals_numpy_over_all_vectors_at_once():
    rng = np.random.default_rng(1)
    vectors, queries = unit_rows(rng, 2500, 16), unit_rows(rng, 30, 16)
    exact = ExactTopK(queries, 7)
    for start, size in ((0, 3), (3, 1000), (1003, 5), (1008, 1492)):
        exact.add(vectors[start:start + size])
    scores = queries @ vectors.T
    want = np.argsort(-scores, axis=1, kind="stable")[:, :7]
    np.testing.assert_array_equal(exact.rows, want)
    np.testing.assert_allclose(exact.scores, np.take_along_axis(scores, want, 1), rtol=1e-6)
    assert exact.seen == 2500


def test_first_reaching_is_the_linear_scans_answer_in_few_measurements():
    rng = np.random.default_rng(2)
    for _ in range(300):
        values = np.sort(rng.random(int(rng.integers(1, 40))))
        target = float(rng.random() * 1.1)
        calls = []

        def measure(i):
            calls.append(i)
            return float(values[i])

        index, value, reached = first_reaching(list(range(len(values))), measure, target)
        linear = next((i for i, v in enumerate(values) if v >= target), None)
        if linear is None:
            assert (index, reached) == (len(values) - 1, False)
        else:
            assert (index, value, reached) == (linear, values[linear], True)
        assert len(calls) == len(set(calls)) <= int(np.ceil(np.log2(len(values)))) + 2
    with pytest.raises(ValueError, match="no candidates"):
        first_reaching([], float, 0.5)


def test_tuned_nprobe_is_the_smallest_reaching_the_target_by_a_full_scan():
    rng = np.random.default_rng(3)
    vectors = unit_rows(rng, 4000, 32)
    queries = unit_rows(rng, 60, 32)
    index = faiss.index_factory(32, "IVF32,Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(vectors)
    index.add(vectors)
    exact = ExactTopK(queries, 10)
    exact.add(vectors)
    nprobes = parameter_values(index)["nprobe"]
    assert nprobes[-1] == 32 and nprobes == sorted(nprobes)

    def recall_at(nprobe):
        faiss.extract_index_ivf(index).nprobe = nprobe
        return recall_at_k(index.search(queries, 10)[1], exact.rows, 10)

    scanned = [recall_at(v) for v in nprobes]
    assert scanned == sorted(scanned) and scanned[-1] == 1.0  # all lists: exact
    for target in (0.5, 0.8, 0.95, 1.0):
        tuning = tune_search(index, queries, exact.rows, 10, target, "random unit vectors")
        want = next(v for v, r in zip(nprobes, scanned, strict=True) if r >= target)
        assert tuning.params == f"nprobe={want}" and tuning.reached and tuning.recall >= target


def test_refine_and_hnsw_expose_their_parameters_and_flat_has_none():
    assert parameter_values(faiss.index_factory(8, "Flat", faiss.METRIC_INNER_PRODUCT)) == {}
    refine = faiss.index_factory(16, "IVF8,PQ4x4,Refine(SQfp16)", faiss.METRIC_INNER_PRODUCT)
    assert list(parameter_values(refine)) == ["nprobe", "k_factor_rf"]
    assert list(parameter_values(faiss.index_factory(8, "HNSW8", faiss.METRIC_INNER_PRODUCT))) == ["efSearch"]


def test_index_with_a_target_recall_records_and_serves_the_chosen_nprobe(small_corpus, tmp_path):
    from fastapi.testclient import TestClient
    from typer.testing import CliRunner

    from emapg.cli import app
    from retriever.index import load_index
    from retriever.server import ServerSettings, create_app

    out = tmp_path / "ivf"
    result = CliRunner().invoke(app, ["index", "--corpus", str(small_corpus), "--out", str(out), "--factory",
                                      "IVF16,Flat", "--target-recall", "0.9", "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    tuning = json.loads((out / "manifest.json").read_text())["tuning"]
    assert tuning["params"].startswith("nprobe=") and tuning["recall"] >= 0.9 and tuning["reached"]
    assert "recall@10" in result.output
    index = load_index(out)
    assert index.search_params == tuning["params"]
    assert faiss.extract_index_ivf(index.faiss_index).nprobe == int(tuning["params"].split("=")[1])
    assert load_index(out, search_params="nprobe=16").search_params == "nprobe=16"  # the server's option wins
    with TestClient(create_app(index, ServerSettings(index=out))) as client:
        assert client.get("/health").json()["search_params"] == tuning["params"]
        assert client.post("/retrieve", json={"queries": ["Jane Austen"], "topk": 3}).status_code == 200
    with pytest.raises(ValueError, match="do not apply"):
        load_index(out, search_params="efSearch=16")

"""The FAISS file of an index folder (retriever/faiss_file.py): streamed builds write FAISS's own bytes; a truncated,
garbage or replaced file is refused at load naming the file; an index larger than the memory available is served
memory-mapped with a warning naming the cost."""

from __future__ import annotations

import json
import logging
import shutil

import faiss
import numpy as np
import pytest

from retriever.faiss_file import FaissFileWriter, stream_layout


def unit_rows(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("factory,streamed", [("Flat", True), ("SQ8", True), ("SQfp16", True), ("PQ4x4", True),
                                              ("IVF8,Flat", False), ("IVF8,PQ4x4,Refine(SQfp16)", False)])
def test_written_file_is_what_faiss_writes_streamed_for_flat_codes(factory, streamed, tmp_path):
    rng = np.random.default_rng(0)
    vectors = unit_rows(rng, 1500, 16)
    index = faiss.index_factory(16, factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        index.train(vectors)
    reference = faiss.clone_index(index)
    reference.add(vectors)
    with FaissFileWriter(index, tmp_path / "index.faiss") as writer:
        for start in range(0, 1500, 400):
            writer.add(vectors[start:start + 400])
    assert writer.streamed is streamed and writer.ntotal == 1500
    assert (tmp_path / "index.faiss").read_bytes() == faiss.serialize_index(reference).tobytes()


def test_streaming_needs_an_empty_trained_flat_code_index_and_vectors_of_its_dim(tmp_path):
    index = faiss.index_factory(8, "Flat", faiss.METRIC_INNER_PRODUCT)
    index.add(np.eye(8, dtype=np.float32))
    assert stream_layout(index) is None  # not empty: added in memory, as FAISS would
    with FaissFileWriter(faiss.index_factory(8, "Flat", faiss.METRIC_INNER_PRODUCT), tmp_path / "x") as writer:
        with pytest.raises(ValueError, match="dim 8"):
            writer.add(np.zeros((2, 9), np.float32))


@pytest.fixture
def index_copy(dense_index_dir, tmp_path):
    from conftest import copy_index

    return copy_index(dense_index_dir, tmp_path / "index")


def test_the_manifest_records_the_faiss_file(index_copy):
    record = json.loads((index_copy / "manifest.json").read_text())["index_file"]
    assert record["name"] == "index.faiss" and record["num_bytes"] == (index_copy / "index.faiss").stat().st_size
    assert len(record["ends_sha256"]) == 64


def test_a_truncated_file_is_refused_naming_it(index_copy):
    from retriever.index import load_index

    path = index_copy / "index.faiss"
    path.write_bytes(path.read_bytes()[:-4096])
    with pytest.raises(ValueError, match=r"index\.faiss is [\d,]+ bytes, the manifest records [\d,]+ \(truncated"):
        load_index(index_copy)


def test_a_garbage_file_of_the_same_size_is_refused_naming_it(index_copy):
    from retriever.index import load_index

    path = index_copy / "index.faiss"
    path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size))
    with pytest.raises(ValueError, match=r"index\.faiss is not the file this index was built with"):
        load_index(index_copy)


def test_another_index_in_its_place_is_refused_by_the_manifest(index_copy, tmp_path):
    """Same size, another index (the corpus's vectors in reverse order): only the checksum tells them apart."""
    from retriever.index import load_index

    path = index_copy / "index.faiss"
    index = faiss.read_index(str(path))
    other = faiss.index_factory(index.d, "Flat", faiss.METRIC_INNER_PRODUCT)
    other.add(index.reconstruct_n(0, index.ntotal)[::-1].copy())
    faiss.write_index(other, str(path))
    assert path.stat().st_size == json.loads((index_copy / "manifest.json").read_text())["index_file"]["num_bytes"]
    with pytest.raises(ValueError, match="not the file this index was built with"):
        load_index(index_copy)


def test_without_a_record_faiss_read_errors_still_name_the_file(index_copy):
    """Manifests from before the record (and adopted folders) are read unchecked; FAISS's own error is re-raised
    with the file's name."""
    from retriever.index import load_index

    manifest = json.loads((index_copy / "manifest.json").read_text())
    del manifest["index_file"]
    (index_copy / "manifest.json").write_text(json.dumps(manifest))
    path = index_copy / "index.faiss"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"index\.faiss is not a FAISS index .* can read \(corrupt or truncated\?\)"):
        load_index(index_copy)
    path.write_bytes(b"not a faiss index at all")
    with pytest.raises(ValueError, match=r"index\.faiss is not a FAISS index"):
        load_index(index_copy)
    path.unlink()
    with pytest.raises(ValueError, match=r"index\.faiss is missing"):
        load_index(index_copy)


def test_an_index_larger_than_available_memory_is_served_from_disk_with_a_warning(index_copy, monkeypatch, caplog):
    """A fake MemAvailable smaller than the file (a unit test's fake: the real condition needs a machine fuller
    than this one): the index still loads, memory-mapped, and searches; the warning names both sizes and the cost."""
    from retriever import faiss_file
    from retriever.index import load_index

    def fake_small_memory():
        return 100 << 10

    monkeypatch.setattr(faiss_file, "available_bytes", fake_small_memory)
    with caplog.at_level(logging.WARNING, logger="retriever.faiss_file"):
        index = load_index(index_copy)
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "retriever.faiss_file"]
    assert "index.faiss is 0.6 MiB, more than the 0.1 MiB of memory available" in warning
    assert "searches will read from disk" in warning
    assert index.search(["who wrote pride and prejudice"], 1)[0][0].contents.startswith('"Pride and Prejudice"')


def test_a_corrupt_index_stops_serve_with_its_name(index_copy):
    """`emapg serve` exits with the error, before serving anything."""
    from typer.testing import CliRunner

    from emapg.cli import app

    path = index_copy / "index.faiss"
    path.write_bytes(path.read_bytes()[:100])
    for workers in ("1", "2"):  # in the process that serves, or before uvicorn starts any worker
        result = CliRunner().invoke(app, ["serve", "--index", str(index_copy), "--port", "1", "--workers", workers])
        assert result.exit_code != 0 and "index.faiss is 100 bytes" in " ".join(result.output.split())
    shutil.rmtree(index_copy)


def test_an_in_memory_build_larger_than_available_memory_is_refused_before_adding(monkeypatch, tmp_path):
    """IVF codes are added in memory: with a fake MemAvailable below what 10M vectors would take, the writer refuses
    up front, naming the estimate; a streamed Flat build of the same count is not refused."""
    from retriever import faiss_file

    def fake_small_memory():
        return 64 << 20

    monkeypatch.setattr(faiss_file, "available_bytes", fake_small_memory)
    rng = np.random.default_rng(0)
    ivf = faiss.index_factory(16, "IVF8,Flat", faiss.METRIC_INNER_PRODUCT)
    ivf.train(unit_rows(rng, 500, 16))
    assert faiss_file.in_memory_bytes_per_vector(ivf) == pytest.approx(16 * 4 + 8, abs=1)  # codes and id
    with pytest.raises(ValueError, match=r"over 10,000,000 vectors holds ~6[89]\d.\d MiB in memory .* 64.0 MiB available"):
        FaissFileWriter(ivf, tmp_path / "ivf.faiss", expected=10_000_000)
    with FaissFileWriter(faiss.index_factory(16, "Flat", faiss.METRIC_INNER_PRODUCT), tmp_path / "flat.faiss",
                         expected=10_000_000) as writer:
        assert writer.streamed


@pytest.fixture(scope="module")
def minilm_manifest():
    from retriever.encoder import Encoder, resolve_encoder
    from retriever.manifest import encoder_manifest

    return encoder_manifest(Encoder(resolve_encoder("minilm")))


# PQ codes fine enough to put a vector's own code among 64 x k candidates in random 384-dim data (PQ16x4 is not).
@pytest.mark.parametrize("factory", ["SQ8", "SQfp16", "IVF16,Flat", "IVF16,PQ48x4,Refine(SQfp16)",
                                     "OPQ16_64,IVF16,PQ16x4,Refine(SQ8)"])
def test_each_index_type_for_scale_builds_loads_memory_mapped_and_finds_its_own_vectors(factory, minilm_manifest,
                                                                                      tmp_path):
    """The types docs/scale.md measures, through the same build and load code as `emapg index` / `emapg serve`
    (random unit vectors, a numbered corpus): tuned for recall@1 >= 0.9 (in random 384-dim data the 2nd to 10th
    neighbours are near-ties that coarse PQ codes cannot order, so recall@10 would test the data, not the code), loaded
    memory-mapped and searched with the tuned parameters, it gives the recall the manifest records."""
    from retriever.dense import TuningRequest, build_dense_from_vectors
    from retriever.index import load_index
    from retriever.memory import process_memory
    from retriever.tuning import ExactTopK, recall_at_k

    rng = np.random.default_rng(0)
    vectors = unit_rows(rng, 3000, minilm_manifest.dim)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"P{i}"\n{i}'}) + "\n" for i in range(3000)))
    queries = vectors[:40] + 0.2 * unit_rows(rng, 40, minilm_manifest.dim)
    manifest = build_dense_from_vectors(corpus, tmp_path / "index", (vectors[i:i + 1000] for i in range(0, 3000, 1000)),
                                        encoder=minilm_manifest, factory=factory, train_vectors=vectors,
                                        tuning=TuningRequest(queries, 0.9, 1, "noisy copies of stored vectors"))
    assert manifest.tuning.reached and manifest.tuning.recall >= 0.9
    index = load_index(tmp_path / "index")
    assert index.search_params == (manifest.tuning.params or None)
    exact = ExactTopK(queries, 1)
    exact.add(vectors)
    _, rows = index.search_vectors(queries, 1)  # served as tuned: the recall the manifest records
    assert recall_at_k(rows, exact.rows, 1) == pytest.approx(manifest.tuning.recall, abs=1e-4)
    (mapped,) = process_memory(index_files=index.index_files).index_files
    assert mapped.resident_bytes > 0  # searched through the file mapping


def test_vectors_that_do_not_match_the_corpus_are_refused(minilm_manifest, tmp_path):
    from retriever.dense import build_dense_from_vectors

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f'"P{i}"\n{i}'}) + "\n" for i in range(10)))
    vectors = unit_rows(np.random.default_rng(0), 9, minilm_manifest.dim)
    with pytest.raises(ValueError, match=r"9 vectors for the 10 passages of"):
        build_dense_from_vectors(corpus, tmp_path / "index", [vectors], encoder=minilm_manifest)
    assert not (tmp_path / "index").exists()

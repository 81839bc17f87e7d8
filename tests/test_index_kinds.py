"""A new retrieval backend is one file: a fake backend defined in this test module (word overlap, a fake named as
one) registers itself with `register_index_kind`, is built through `emapg index --kind`, recorded in the manifest,
loaded by `load_index` and served by the server's own app (in this process: the fake lives here), whose `GET /health`
names its kind and whose `POST /retrieve` answers with it; nothing outside this file lists it. An unknown kind is
refused by name, at the CLI, in a manifest and in a /health answer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from data.corpus import read_jsonl
from retriever.api import Health
from retriever.build import add_corpus, building_folder, finish_build
from retriever.kinds import INDEX_KINDS, IndexKind, register_index_kind
from retriever.manifest import Manifest


def build_overlap_index(corpus: Path, out: Path, *, copy_corpus: bool = True, overwrite: bool = False) -> Manifest:
    """The fake backend's builder: nothing to compute beyond the corpus itself."""
    tmp = building_folder(Path(out), overwrite)
    corpus_manifest, docstore = add_corpus(tmp, corpus, copy_corpus)
    docstore.close()
    manifest = Manifest(kind="overlap", metric="word_overlap", params={"lowercase": True}, corpus=corpus_manifest)
    finish_build(tmp, Path(out), manifest)
    return manifest


class FakeOverlapIndex:
    """The fake backend's searcher: passages ranked by how many of the query's words they contain."""

    def __init__(self, manifest, docstore):
        self.manifest, self.docstore = manifest, docstore
        self.words = [set(re.findall(r"\w+", p.contents.lower())) for p in read_jsonl(docstore.corpus_path)]

    @classmethod
    def load(cls, folder, manifest, docstore):
        return cls(manifest, docstore)

    def search(self, queries: list[str], k: int):
        results = []
        for query in queries:
            wanted = set(re.findall(r"\w+", query.lower()))
            scores = [(len(wanted & words), row) for row, words in enumerate(self.words)]
            best = sorted((s for s in scores if s[0] > 0), key=lambda s: (-s[0], s[1]))[:k]
            results.append([self.docstore.hit(row, float(score)) for score, row in best])
        return results


@pytest.fixture
def overlap_kind():
    # What a new backend's module does to be served:
    register_index_kind("overlap", IndexKind(__name__, "build_overlap_index", "FakeOverlapIndex", "word_overlap"))
    yield
    del INDEX_KINDS["overlap"]  # the registry is process-wide; other tests must not see the fake


def test_a_backend_registered_by_one_line_is_built_by_the_cli_loaded_and_served(overlap_kind, small_corpus, tmp_path):
    from typer.testing import CliRunner

    from emapg.cli import app
    from retriever.index import load_index
    from fastapi.testclient import TestClient

    from retriever.server import ServerSettings, create_app

    out = tmp_path / "overlap"
    result = CliRunner().invoke(app, ["index", "--kind", "overlap", "--corpus", str(small_corpus), "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["kind"], manifest["metric"], manifest["params"]) == ("overlap", "word_overlap", {"lowercase": True})
    index = load_index(out)
    assert isinstance(index, FakeOverlapIndex)
    assert index.search(["Pride and Prejudice Jane Austen"], 1)[0][0].contents.startswith('"Pride')
    with pytest.raises(ValueError, match="it takes no encoder"):
        load_index(out, encoder="minilm")
    with TestClient(create_app(index, ServerSettings(index=out))) as client:
        response = client.post("/retrieve", json={"queries": ["Jane Austen novel"], "topk": 2})
        health = client.get("/health")
    assert response.status_code == 200, response.text
    assert len(response.json()["result"][0]) == 2
    assert health.status_code == 200, health.text
    assert Health.model_validate(health.json()).kind == "overlap"  # as a client reads it
    assert health.json()["num_docs"] == manifest["corpus"]["num_docs"] and health.json()["index_factory"] is None
    with pytest.raises(ValueError, match="already registered"):
        register_index_kind("overlap", IndexKind("elsewhere", "build", "Searcher", "word_overlap"))


def test_an_unknown_kind_is_refused_by_name(small_corpus, tmp_path):
    from typer.testing import CliRunner

    from emapg.cli import app

    result = CliRunner().invoke(app, ["index", "--kind", "splade", "--corpus", str(small_corpus), "--out",
                                      str(tmp_path / "x")])
    assert result.exit_code == 2 and "unknown index kind 'splade'" in " ".join(result.output.split())
    with pytest.raises(ValueError, match="unknown index kind 'splade'"):
        Manifest(kind="splade", metric="x", corpus={"path": "c", "sha256": "0", "num_bytes": 1, "num_docs": 1})
    health = {"kind": "splade", "num_docs": 1, "index_factory": None, "encoder": None, "passage_dtype": None,
              "corpus_sha256": "0", "batching": True, "cache_entries": 0, "limits": {}}
    with pytest.raises(ValueError, match="unknown index kind 'splade'"):
        Health.model_validate(health)
    assert Health.model_validate({**health, "kind": "bm25"}).kind == "bm25"

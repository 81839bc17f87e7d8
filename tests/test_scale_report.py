"""benchmarks/scale_report.py: the bytes a vector takes in each measured index type, checked against the files FAISS
writes; the wiki-18 projection against hand arithmetic; the tables from a record (last line wins, skipped rows
said)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from scale_report import (  # noqa: E402
    SEARCHES_PER_STEP, WIKI18_PASSAGES, code_bytes_per_vector, latest_rows, project_wiki18, result_table, wiki18_table,
)

FACTORIES = ["Flat", "SQfp16", "SQ8", "IVF16,Flat", "IVF16,PQ48,Refine(SQfp16)", "IVF16,PQ48,Refine(SQ8)",
             "OPQ48_{dim},IVF16,PQ48x4,Refine(SQfp16)", "IVF16,PQ12x6,Refine(SQ8)"]


def cheap_training(index: faiss.Index) -> None:
    """Skip training work that does not change what a vector adds to the file: polysemous codes, OPQ's iterations."""
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexPreTransform):
        for i in range(index.chain.size()):
            transform = faiss.downcast_VectorTransform(index.chain.at(i))
            if isinstance(transform, faiss.OPQMatrix):
                transform.niter = 1
        cheap_training(index.index)
    elif isinstance(index, faiss.IndexRefine):
        cheap_training(index.base_index)
    elif isinstance(index, faiss.IndexIVFPQ):
        index.do_polysemous_training = False


@pytest.mark.parametrize("factory", FACTORIES)
def test_code_bytes_per_vector_is_what_faiss_files_grow_by(factory):
    dim = 96
    factory = factory.format(dim=dim)
    rng = np.random.default_rng(0)
    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    cheap_training(index)
    index.train(rng.standard_normal((1000, dim)).astype(np.float32))
    sizes = []
    for n in (1000, 2000):  # FAISS's own file: everything but the vectors' codes is the same at both counts
        index.add(rng.standard_normal((n - index.ntotal, dim)).astype(np.float32))
        sizes.append(faiss.serialize_index(index).size)
    assert sizes[1] - sizes[0] == 1000 * code_bytes_per_vector(factory, dim)


def test_unknown_factory_part_is_refused_by_name():
    with pytest.raises(ValueError, match="HNSW32"):
        code_bytes_per_vector("HNSW32,Flat", 96)


def row(kind: str, factory: str, vectors: int = WIKI18_PASSAGES, **extra) -> dict:
    return {"set": "synthetic", "kind": kind, "factory": factory, "vectors": vectors, "dim": 384,
            "file_bytes": 1_000_000_000, "recall@3": 0.96, "recall@10": 0.95, "startup_s": 3.0, "build_s": 100.0,
            "search_params": None, "search_only": {"batch_queries_per_s": 600.0, "single_queries_per_s": 50.0},
            "machine": {"kind": "Intel Xeon with AMX", "cores": 2, "other_cores_busy": 0.05}, "commit": "abc1234",
            "date": "2026-12-07", "memory_at_start": {"rss_bytes": 1e9, "pss_bytes": 1e9, "private_bytes": 1e8},
            "memory_under_load_peak": {"rss_bytes": 2e9, "pss_bytes": 2e9, "private_bytes": 2e8},
            "load": {s: {"queries_per_s": 100.0, "p99_ms": 50.0} for s in ("c1", "c32", "c256", "b256")}, **extra}


def test_wiki18_projection_by_hand():
    p = project_wiki18(row("sq8", "SQ8"))
    assert p["file_bytes"] == pytest.approx(2_000_000_000)  # SQ8: 1 byte a dim, 768 / 384
    assert p["batch_per_core"] == pytest.approx(600 / 2 / 2)  # half the speed at twice the dims, over 2 cores
    assert p["single_ms"] == pytest.approx(1000 / 25)
    assert p["core_s_per_step"] == pytest.approx(SEARCHES_PER_STEP / 150)
    ivfpq = project_wiki18(row("ivf-pq-refine-sq8", "IVF16384,PQ48,Refine(SQ8)"))
    assert ivfpq["file_bytes"] == pytest.approx(1e9 * (8 + 48 + 768) / (8 + 48 + 384))
    with pytest.raises(ValueError, match="21,015,324"):
        project_wiki18(row("sq8", "SQ8", vectors=1_000_000))


def test_tables_take_the_last_line_per_type_and_say_what_was_skipped():
    lines = [json.dumps(row("sq8", "SQ8", **{"recall@3": 0.5})), json.dumps(row("sq8", "SQ8")),
             json.dumps({"set": "synthetic", "kind": "ivf-flat", "skipped": "needs 32.3 GB, 20.1 GB available"})]
    rows = latest_rows(lines)
    table = result_table(rows, "synthetic")
    assert "| sq8 | - | 0.960 |" in table and "0.500" not in table
    assert "| ivf-flat | skipped: needs 32.3 GB, 20.1 GB available |" in table
    assert "Intel Xeon with AMX, 2 cores" in table and "while each type was measured: 0.05-0.05 (0: alone)" in table
    wiki18 = wiki18_table(rows)
    assert "| synthetic | sq8 | - | 2.00 | 3.0 | 0.960 | 150.0 | 40.0 | 68 |" in wiki18 and "ivf-flat" not in wiki18
    assert "measured at commit abc1234: sq8;" in table


def test_a_tuning_that_missed_its_target_is_said_so_in_both_tables():
    tuning = {"params": "nprobe=16384,k_factor_rf=64", "k": 10, "target_recall": 0.95, "recall": 0.7966,
              "reached": False}
    rows = latest_rows([json.dumps(row("ivf-pq-refine-sq8", "IVF16384,PQ48,Refine(SQ8)", tuning=tuning,
                                       search_params=tuning["params"]))])
    assert ("| ivf-pq-refine-sq8 | nprobe=16384,k_factor_rf=64 (the most expensive; target not reached, 0.7966 on "
            "tuning queries) |") in result_table(rows, "synthetic")
    assert "| synthetic | ivf-pq-refine-sq8 | nprobe=16384,k_factor_rf=64 (no) |" in wiki18_table(rows)


def test_the_wiki18_table_takes_both_21m_sets_perturbed_first():
    rows = latest_rows([json.dumps(row("sq8", "SQ8")), json.dumps({**row("sq8", "SQ8"), "set": "perturbed"}),
                        json.dumps({**row("sq8", "SQ8", vectors=1_000_000), "set": "real"})])
    lines = wiki18_table(rows).splitlines()[2:]
    assert [ln.split(" | ")[0] for ln in lines] == ["| perturbed", "| synthetic"]

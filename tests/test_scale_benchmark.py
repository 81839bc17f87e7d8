"""`benchmarks/scale.py --small` end to end (4k real MiniLM vectors, 20k synthetic and 20k perturbed, Flat and
IVF-Flat, 100 queries, real servers under a short load): every result line has the documented fields, recalls are in
[0, 1], Flat is exact (recall 1.0 against the streamed exact top-k), the IVF index was tuned to the target and served
with its tuned nprobe, and each step left its cache on disk so a rerun resumes. Checks the benchmark's shape, not its
figures; run after `--prepare`, whose caches it must resume from. Then the perturbed set's two calibrations against
direct computation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from scale import covariance_factor, neighbour_cosine, perturb, perturb_scale  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"benchmark", "set", "vectors", "dim", "kind", "factory", "build_s", "file_bytes", "tuning", "queries",
          "recall@3", "recall@10", "search_params", "startup_s", "memory_at_start", "memory_under_load_peak", "load",
          "window_s", "rounds", "machine", "commit", "date", "small"}
MEMORY = {"rss_bytes", "pss_bytes", "private_bytes", "index_resident_bytes"}
LOAD = {"queries_per_s", "p50_ms", "p99_ms", "requests", "errors"}


def _scale(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--small", "--out", str(out), *args],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_small_scale_benchmark_prepares_then_prints_and_appends_one_line_per_set_and_type(tmp_path):
    out = tmp_path / "scale"
    # `--prepare` (run beside other work) leaves the encoded vectors and exact top-k, and no index or result.
    prepared = _scale(out, "--prepare")
    assert [json.loads(line)["set"] for line in prepared.stdout.splitlines()] == ["real", "synthetic", "perturbed"]
    for name in ("real-4000", "synthetic-20000", "perturbed-20000"):
        assert (out / name / "exact-top10.npy").exists() and not (out / name / "indexes").exists()
    assert not (out / "results.jsonl").exists()
    cached = {p: p.stat().st_mtime_ns for p in out.glob("*/*.npy")} | {p: p.stat().st_mtime_ns for p in
                                                                       out.glob("*/vectors/part-*.npy")}

    printed = [json.loads(line) for line in _scale(out).stdout.splitlines() if line.startswith("{")]
    appended = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert printed == appended
    assert [(r["set"], r["kind"]) for r in printed] == [(s, k) for s in ("real", "synthetic", "perturbed")
                                                        for k in ("flat", "ivf-flat")]
    for row in printed:
        assert FIELDS <= set(row), FIELDS - set(row)
        assert 0.0 <= row["recall@3"] <= 1.0 and 0.0 <= row["recall@10"] <= 1.0
        assert set(row["search_only"]) == {"batch_queries_per_s", "single_queries_per_s"}
        assert all(v > 0 for v in row["search_only"].values())
        assert set(row["memory_at_start"]) == MEMORY and set(row["memory_under_load_peak"]) == MEMORY
        assert set(row["load"]) == {"c1", "c32", "c256", "b256"}
        assert all(set(s) == LOAD and s["errors"] == 0 for s in row["load"].values())
        assert row["load"]["c1"]["requests"] > 0 and row["file_bytes"] > 0 and row["startup_s"] > 0
        # Every figure names its machine kind and whether the machine was loaded when it was taken.
        assert set(row["machine"]) == {"kind", "cores", "memory_bytes", "other_cores_busy"} and row["machine"]["kind"]
        assert 0.0 <= row["machine"]["other_cores_busy"] <= row["machine"]["cores"]
        # Under load the whole index was paged in through the memory map.
        assert row["memory_under_load_peak"]["index_resident_bytes"] >= 0.9 * row["file_bytes"]
    flats = [r for r in printed if r["kind"] == "flat"]
    assert all(r["recall@3"] == r["recall@10"] == 1.0 and r["tuning"] is None for r in flats)
    for ivf in (r for r in printed if r["kind"] == "ivf-flat"):
        assert ivf["factory"].startswith("IVF") and ivf["search_params"] == ivf["tuning"]["params"]
        assert ivf["tuning"]["reached"] and ivf["tuning"]["recall"] >= 0.95
    # The run resumed from what `--prepare` left (encoded parts, queries, exact top-k untouched), and cached its own
    # steps: a rerun would skip them.
    assert cached and all(p.stat().st_mtime_ns == mtime for p, mtime in cached.items())
    for name in ("real-4000", "synthetic-20000", "perturbed-20000"):
        assert len(list((out / name / "results").glob("*.json"))) == 2
    assert not list((out / "real-4000" / "indexes").glob("*/manifest.json"))  # measured indexes are deleted


def _clustered_unit_vectors(n: int, dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((20, dim))[rng.integers(0, 20, n)] + 0.3 * rng.standard_normal((n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_neighbour_cosine_is_the_median_cosine_to_the_rank_th_nearest_other_vector():
    vectors = _clustered_unit_vectors(3000, 16, seed=0)
    sample = np.random.default_rng(3).choice(len(vectors), size=200, replace=False)
    cosines = np.sort(vectors[sample] @ vectors.T, axis=1)[:, ::-1]  # column 0: the vector itself
    for rank in (1, 10):
        assert neighbour_cosine(vectors, rank, sample=200) == pytest.approx(float(np.median(cosines[:, rank])))


@pytest.mark.parametrize("cosine", [0.95, 0.8, 0.5])
def test_perturbed_vectors_keep_the_median_cosine_to_their_origin(cosine):
    """The scale found on one sample gives the asked median cosine on fresh draws, and perturbed vectors are unit."""
    vectors = _clustered_unit_vectors(5000, 32, seed=1)
    factor = covariance_factor(vectors)
    scale = perturb_scale(vectors, factor, cosine)
    rng = np.random.default_rng(7)
    origins = vectors[rng.integers(0, len(vectors), 20_000)]
    moved = perturb(origins, rng.standard_normal((20_000, len(factor))), factor, scale)
    assert np.allclose(np.linalg.norm(moved, axis=1), 1.0, atol=1e-5)
    assert float(np.median((moved * origins).sum(1))) == pytest.approx(cosine, abs=0.01)

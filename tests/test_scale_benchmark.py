"""`benchmarks/scale.py --small` end to end (4k real MiniLM vectors, 20k synthetic, Flat and IVF-Flat, 100 queries,
real servers under a short load): every result line has the documented fields, recalls are in [0, 1], Flat is exact
(recall 1.0 against the streamed exact top-k), the IVF index was tuned to the target and served with its tuned
nprobe, and each step left its cache on disk so a rerun resumes. Checks the benchmark's shape, not its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"benchmark", "set", "vectors", "dim", "kind", "factory", "build_s", "file_bytes", "tuning", "queries",
          "recall@3", "recall@10", "search_params", "startup_s", "memory_at_start", "memory_under_load_peak", "load",
          "window_s", "rounds", "machine", "commit", "date", "small"}
MEMORY = {"rss_bytes", "pss_bytes", "private_bytes", "index_resident_bytes"}
LOAD = {"queries_per_s", "p50_ms", "p99_ms", "requests", "errors"}


def test_small_scale_benchmark_prints_and_appends_one_line_per_set_and_type(tmp_path):
    out = tmp_path / "scale"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--small", "--out", str(out)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    printed = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    appended = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert printed == appended
    assert [(r["set"], r["kind"]) for r in printed] == [("real", "flat"), ("real", "ivf-flat"),
                                                        ("synthetic", "flat"), ("synthetic", "ivf-flat")]
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
    # Each step's output is cached: a rerun would skip it.
    for name in ("real-4000", "synthetic-20000"):
        assert (out / name / "exact-top10.npy").exists() and len(list((out / name / "results").glob("*.json"))) == 2
    assert list((out / "real-4000" / "vectors").glob("part-*.npy"))
    assert not list((out / "real-4000" / "indexes").glob("*/manifest.json"))  # measured indexes are deleted


def test_prepare_computes_the_sets_and_builds_nothing(tmp_path):
    """`--prepare` (run beside other work) leaves the encoded vectors and exact top-k, and no index or result."""
    out = tmp_path / "scale"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale.py"), "--small", "--prepare", "--out",
                          str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [json.loads(line)["set"] for line in run.stdout.splitlines()] == ["real", "synthetic"]
    for name in ("real-4000", "synthetic-20000"):
        assert (out / name / "exact-top10.npy").exists() and not (out / name / "indexes").exists()
    assert not (out / "results.jsonl").exists()

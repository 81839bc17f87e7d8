"""benchmarks/front_door_times.py's pure pieces (what `make times` writes into README and docs/benchmarks.md), on
constructed inputs: no command is run and no file is written."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Loaded by path: putting benchmarks/ on sys.path would let its file names shadow modules for other tests.
_spec = importlib.util.spec_from_file_location("front_door_times", ROOT / "benchmarks" / "front_door_times.py")
times = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(times)


def cpuinfo(vendor: str, model: str, flags: str, processors: int = 2) -> str:
    one = f"vendor_id\t: {vendor}\nmodel name\t: {model}\nflags\t\t: fpu sse2 avx2 {flags}\n"
    return "\n".join(f"processor\t: {i}\n" + one for i in range(processors))


@pytest.mark.parametrize("vendor, model, flags, kind", [
    ("GenuineIntel", "Intel(R) Xeon(R) Platinum 8480+", "avx512f avx512_bf16 amx_bf16 amx_tile", "Intel Xeon with AMX"),
    ("GenuineIntel", "Intel(R) Xeon(R) Platinum 8380", "avx512f avx512_bf16", "Intel Xeon with AVX512-BF16, no AMX"),
    ("GenuineIntel", "Intel(R) Xeon(R) Gold 6248", "avx512f", "Intel Xeon with AVX-512, no AVX512-BF16"),
    ("AuthenticAMD", "AMD EPYC 9R14 96-Core Processor", "avx512f avx512_bf16", "AMD EPYC with AVX512-BF16, no AMX"),
    ("AuthenticAMD", "AMD EPYC 7R13 Processor", "", "AMD EPYC without AVX-512"),
    ("ARM", "Neoverse-V2", "", "Neoverse-V2"),
])
def test_the_machine_kind_comes_from_vendor_model_and_flags(vendor, model, flags, kind):
    assert times.machine_kind(cpuinfo(vendor, model, flags)) == kind
    assert times.cores(cpuinfo(vendor, model, flags, processors=4)) == 4


def test_pytest_s_summary_line_gives_the_counts_and_seconds():
    output = ("tests/test_x.py ....\n= 15 slowest durations =\n"
              "===== 765 passed, 2 skipped, 3 deselected, 12 warnings in 763.21s (0:12:43) =====\n")
    summary = times.parse_pytest_summary(output)
    assert summary == {"line": "765 passed, 2 skipped, 3 deselected, 12 warnings in 763.21s (0:12:43)",
                       "counts": {"passed": 765, "skipped": 2, "deselected": 3, "warning": 12}, "seconds": 763.21}
    assert times.parse_pytest_summary("606 passed in 124.0s\n")["counts"] == {"passed": 606}
    assert times.parse_pytest_summary("=== 1 failed, 2 errors in 3.5s ===")["counts"] == {"failed": 1, "error": 2}
    with pytest.raises(ValueError):
        times.parse_pytest_summary("make: *** [test] Error 1\n")


RECORD = {"date": "2026-12-07", "commit": "abc1234", "dirty": False, "machine": "Intel Xeon with AMX", "cores": 2,
          "test": {"wall_s": 690.0, "line": "765 passed in 600.00s (0:10:00)", "counts": {"passed": 765},
                   "seconds": 600.0},
          "demo": {"wall_s": 540.0}}


def test_the_rows_carry_the_figures_the_machine_the_date_and_the_commit():
    assert times.readme_row(RECORD) == ("| Intel Xeon with AMX | 2 | 11.5 min | 765 passed, pytest 600 s | 9.0 min | "
                                        "2026-12-07, abc1234 |")
    test_row, demo_row = times.benchmarks_rows(RECORD)
    assert test_row == ("| `make test`, wall clock | 11.5 min (765 passed in 600.00s (0:10:00)) | `make times` | abc1234 | "
                        "Intel Xeon with AMX, 2 cores | 2026-12-07 |")
    assert demo_row.startswith("| `make demo`, wall clock, installed, index built | 9.0 min | `make times` |")
    dirty = {**RECORD, "dirty": True}
    assert "abc1234 (uncommitted changes)" in times.readme_row(dirty)
    assert all("abc1234 (uncommitted changes)" in row for row in times.benchmarks_rows(dirty))
    assert len(times.benchmarks_rows({**RECORD, "demo": None})) == 1


PAGE = """intro
<!-- times:begin -->
| machine | cores | make test | tests | make demo | measured |
|---|---|---|---|---|---|
| AMD EPYC with AVX512-BF16, no AMX | 2 | 12-16 min | - | 12-17 min | 2026-12-03 |
| Intel Xeon with AMX | 2 | 9.4 min | 690 passed, pytest 566 s | ~9 min | 2026-12-05 |
<!-- times:end -->
after
"""


def test_a_measurement_replaces_its_machine_s_row_and_keeps_the_others_and_the_rest_of_the_page():
    new = times.update(PAGE, "times", "Intel Xeon with AMX", [times.readme_row(RECORD)])
    lines = new.splitlines()
    assert lines[0] == "intro" and lines[-1] == "after"
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert rows == [times.readme_row(RECORD), "| AMD EPYC with AVX512-BF16, no AMX | 2 | 12-16 min | - | 12-17 min | "
                    "2026-12-03 |"]
    assert times.update(new, "times", "Intel Xeon with AMX", [times.readme_row(RECORD)]) == new
    # benchmarks.md's rows name the machine with its cores ("Intel Xeon with AMX, 2 cores"): the same machine kind
    table = "| what | value |\n|---|---|\n| `make test` | 9 min | Intel Xeon with AMX, 2 cores |\n"
    assert times.upsert_rows(table, "Intel Xeon with AMX", ["| new |"]).splitlines()[2:] == ["| new |"]


def test_a_page_without_the_markers_is_refused():
    with pytest.raises(ValueError):
        times.replace_block("no markers here", "times", "| row |")


def test_readme_and_benchmarks_have_the_blocks_the_script_writes():
    assert times.block((ROOT / "README.md").read_text(), times.README_BLOCK)
    assert times.block((ROOT / "docs" / "benchmarks.md").read_text(), times.BENCHMARKS_BLOCK)

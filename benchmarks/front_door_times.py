"""README's time table, from a measurement: `make test` and `make demo` timed on this machine (wall clock, run from
the repository root on an environment already set up, so no installs are counted), then written back.

    make times                     # or: python benchmarks/front_door_times.py [--skip-demo] [--no-write]

It prints one JSON line (date, commit, whether the tree was dirty, the machine kind and its cores, each command's wall
seconds, pytest's summary line and test count), appends it to docs/evidence/front_door_times.jsonl, and rewrites this
machine kind's rows in two generated blocks: README's (between `<!-- times:begin -->` and `<!-- times:end -->`) and
docs/benchmarks.md's current figures (between `<!-- times-current:begin -->` and `<!-- times-current:end -->`).
Rows of other machine kinds stay as they are. The machine kind comes from /proc/cpuinfo (`machine_kind`).

Both commands take ~35 minutes in all on 2 cores: run it alone on the machine, or the figures mean nothing.
Only the standard library is used.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
RECORD = ROOT / "docs" / "evidence" / "front_door_times.jsonl"
STAMP = ROOT / ".venv" / ".installed-stamp"
README_BLOCK = "times"
BENCHMARKS_BLOCK = "times-current"

SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in ([\d.]+)s(?: \([\d:]+\))?\s*=*\s*$")
COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)")


def machine_kind(cpuinfo: str) -> str:
    """The CPU kind the figures belong to, from /proc/cpuinfo's text: vendor and model, and the instruction sets that
    change our speed (AMX, AVX512-BF16, AVX-512). "Intel Xeon with AMX", "AMD EPYC with AVX512-BF16",
    "AMD EPYC without AVX-512", ...; an unknown vendor gives its model name."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    vendor, model = fields.get("vendor_id", ""), fields.get("model name", "")
    flags = set(fields.get("flags", "").split())
    if vendor == "GenuineIntel":
        name = "Intel Xeon" if "Xeon" in model else "Intel"
    elif vendor == "AuthenticAMD":
        name = "AMD EPYC" if "EPYC" in model else "AMD"
    else:
        return model or vendor or "unknown CPU"
    if flags & {"amx_bf16", "amx_tile"}:
        return f"{name} with AMX"
    if "avx512_bf16" in flags:
        return f"{name} with AVX512-BF16, no AMX"
    if "avx512f" in flags:
        return f"{name} with AVX-512, no AVX512-BF16"
    return f"{name} without AVX-512"


def cores(cpuinfo: str) -> int:
    return sum(1 for line in cpuinfo.splitlines() if line.split(":")[0].strip() == "processor")


def parse_pytest_summary(output: str) -> dict:
    """pytest's last summary line ("===== 765 passed, 2 skipped in 763.21s (0:12:43) =====", or -q's bare form):
    the line, each count by outcome, and pytest's own seconds. Raises ValueError when there is none."""
    for line in reversed(output.splitlines()):
        match = SUMMARY.match(line.strip())
        if match:
            counts = {}
            for number, outcome in COUNT.findall(match.group(1)):
                counts[outcome.rstrip("s") if outcome in ("errors", "warnings") else outcome] = int(number)
            return {"line": line.strip().strip("=").strip(), "counts": counts, "seconds": float(match.group(2))}
    raise ValueError("no pytest summary line in the output")


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def measured(record: dict) -> str:
    """Date, commit, and a warning when the tree had uncommitted changes."""
    return f"{record['date']}, {record['commit']}" + (" (uncommitted changes)" if record["dirty"] else "")


def readme_row(record: dict) -> str:
    """README's row for one machine kind: | machine, cores | make test | tests | make demo | measured |."""
    test, demo = record["test"], record.get("demo")
    demo_cell = minutes(demo["wall_s"]) if demo else "-"
    return (f"| {record['machine']} | {record['cores']} | {minutes(test['wall_s'])} | "
            f"{test['counts'].get('passed', 0)} passed, pytest {test['seconds']:.0f} s | {demo_cell} | "
            f"{measured(record)} |")


def benchmarks_rows(record: dict) -> list[str]:
    """docs/benchmarks.md's current-figure rows: | what | value | command | commit | machine | date |."""
    test, demo = record["test"], record.get("demo")
    machine = f"{record['machine']}, {record['cores']} cores"
    commit = record["commit"] + (" (uncommitted changes)" if record["dirty"] else "")
    rows = [f"| `make test`, wall clock | {minutes(test['wall_s'])} ({test['line']}) | `make times` | {commit} | "
            f"{machine} | {record['date']} |"]
    if demo:
        rows.append(f"| `make demo`, wall clock, installed, index built | {minutes(demo['wall_s'])} | `make times` | "
                    f"{commit} | {machine} | {record['date']} |")
    return rows


def _block_span(text: str, name: str) -> tuple[int, int]:
    """Where the block's body starts and ends: between `<!-- name:begin -->` and `<!-- name:end -->`."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"no {begin} ... {end} block")
    return start + len(begin), stop


def block(text: str, name: str) -> str:
    start, stop = _block_span(text, name)
    return text[start:stop].strip("\n")


def replace_block(text: str, name: str, body: str) -> str:
    """The text with the block's body replaced by body."""
    start, stop = _block_span(text, name)
    return text[:start] + "\n" + body.strip("\n") + "\n" + text[stop:]


def upsert_rows(table: str, machine: str, rows: list[str]) -> str:
    """A markdown table (header, separator, rows) with the rows naming this machine kind (a cell that is it, or starts
    with it and a comma) replaced by new rows, put first; other machines' rows and any text after the table kept."""
    lines = table.splitlines()
    separator = next(i for i, line in enumerate(lines) if re.match(r"^\|[-| :]+\|$", line.strip()))

    def names_machine(line: str) -> bool:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        return any(cell == machine or cell.startswith(machine + ",") for cell in cells)

    kept = [line for line in lines[separator + 1:] if not (line.startswith("|") and names_machine(line))]
    return "\n".join(lines[:separator + 1] + rows + kept)


def update(text: str, name: str, machine: str, rows: list[str]) -> str:
    return replace_block(text, name, upsert_rows(block(text, name), machine, rows))


def run_timed(target: str) -> tuple[float, str]:
    """`make TARGET` from the repository root: wall seconds and its output (echoed as it comes)."""
    start = time.monotonic()
    process = subprocess.Popen(["make", target], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    for line in process.stdout:
        sys.stdout.write(line)
        output.append(line)
    if process.wait() != 0:
        raise SystemExit(f"make {target} failed (exit {process.returncode}); nothing written")
    return time.monotonic() - start, "".join(output)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-demo", action="store_true", help="time `make test` only")
    parser.add_argument("--no-write", action="store_true", help="print the JSON line and rows; change no file")
    args = parser.parse_args()
    if not STAMP.exists():
        raise SystemExit("set the environment up first (`make setup`): its installs are not part of these figures")
    cpuinfo = Path("/proc/cpuinfo").read_text()
    record = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain")),
              "machine": machine_kind(cpuinfo), "cores": cores(cpuinfo) or os.cpu_count()}
    wall, output = run_timed("test")
    record["test"] = {"wall_s": round(wall, 1), **parse_pytest_summary(output)}
    if not args.skip_demo:
        wall, _ = run_timed("demo")
        record["demo"] = {"wall_s": round(wall, 1)}
    print(json.dumps(record))
    rows = benchmarks_rows(record)
    print(readme_row(record), *rows, sep="\n")
    if args.no_write:
        return
    with RECORD.open("a") as f:
        f.write(json.dumps(record) + "\n")
    README.write_text(update(README.read_text(), README_BLOCK, record["machine"], [readme_row(record)]))
    BENCHMARKS.write_text(update(BENCHMARKS.read_text(), BENCHMARKS_BLOCK, record["machine"], rows))


if __name__ == "__main__":
    main()

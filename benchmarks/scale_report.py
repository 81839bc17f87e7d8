"""docs/scale.md's tables, written from the scale benchmark's record (benchmarks/scale.py's JSON lines), so no figure
is copied by hand:

    python benchmarks/scale_report.py                 # print the tables
    python benchmarks/scale_report.py --write         # and replace docs/scale.md's generated blocks

Blocks (between `<!-- NAME:begin -->` and `<!-- NAME:end -->`): `scale-real`, `scale-synthetic` and
`scale-perturbed` (one row per index type measured, the last line per (set, type) winning), and `scale-wiki18`:
wiki-18 (21,015,324 passages, e5-base-v2, 768 dims) projected from the 21M rows of both sets, by the rules in
`project_wiki18`.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from front_door_times import replace_block

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs" / "evidence" / "scale" / "results.jsonl"
DOC = ROOT / "docs" / "scale.md"
WIKI18_PASSAGES = 21_015_324
WIKI18_DIM = 768
# The paper's recipe: 512 prompts x 5 rollouts, up to 4 searches each, per training step.
SEARCHES_PER_STEP = 512 * 5 * 4
KIND_ORDER = ("flat", "sqfp16", "sq8", "ivf-flat", "ivf-pq-refine", "ivf-pq-refine-sq8", "opq-ivf-pq-refine",
              "search_r1_flat")


def latest_rows(lines: list[str]) -> dict[tuple[str, str], dict]:
    """(set, kind) -> its last result line (a rerun replaces a row); skipped lines are kept as such."""
    rows: dict[tuple[str, str], dict] = {}
    for line in lines:
        if line.strip():
            row = json.loads(line)
            rows[(row["set"], row["kind"])] = row
    return rows


def code_bytes_per_vector(factory: str, dim: int) -> float:
    """Bytes one vector's codes take in a FAISS file of this factory string at `dim` dimensions: Flat 4 per dim, SQfp16
    2, SQ8 1; IVF lists add an 8-byte id; PQ{m}x{nbits} adds m x nbits / 8 bytes; Refine(X) adds X's codes. OPQ's matrix is per index,
    not per vector."""
    parts = [p for p in factory.split(",") if not p.startswith("OPQ")]
    per_dim = {"Flat": 4, "SQfp16": 2, "SQ8": 1}
    total = 0.0
    for part in parts:
        if part.startswith("IVF"):
            total += 8
        elif m := re.fullmatch(r"PQ(\d+)(?:x(\d+))?", part):
            total += -(-int(m.group(1)) * int(m.group(2) or 8) // 8)  # m codes of nbits bits, whole bytes
        elif m := re.fullmatch(r"Refine\((\w+)\)", part):
            total += per_dim[m.group(1)] * dim
        elif part in per_dim:
            total += per_dim[part] * dim
        else:
            raise ValueError(f"unknown factory part {part!r} in {factory!r}")
    return total


def project_wiki18(row: dict) -> dict:
    """wiki-18 with e5-base-v2 from one row measured at wiki-18's count (21,015,324 vectors) but `dim` dims:
    - file (and the memory to hold it resident): the measured file times code bytes per vector at 768 dims over
      those at the measured dims (`code_bytes_per_vector`);
    - search speed: the measured search alone (pre-encoded queries, no HTTP) times dim / 768, since a scan's work
      grows with the dims (PQ codes' scan does not, so for PQ types this understates their speed). Batch queries/s
      per core divides by the measured cores (FAISS spreads a batch over all of them); a single query runs on one;
    - the paper recipe's 10,240 searches a step, sent a turn's queries at a time as Search-R1's rollout does: the
      core-seconds of search a step takes at the batch rate.
    Query encoding (e5-base-v2) is not in these figures: it is the encoder's cost, on the GPU with `--gpu` or on CPU
    cores of its own. Recall is not projected: it is the measured set's (the Gaussian set has no neighbourhoods, the
    perturbed set the real 1M set's, wiki-18's its own)."""
    if row["vectors"] != WIKI18_PASSAGES:
        raise ValueError(f"{row['kind']}: measured at {row['vectors']:,} vectors; the projection needs wiki-18's "
                         f"{WIKI18_PASSAGES:,}")
    dim, factory, slower = row["dim"], row["factory"], row["dim"] / WIKI18_DIM
    size = row["file_bytes"] * code_bytes_per_vector(factory, WIKI18_DIM) / code_bytes_per_vector(factory, dim)
    batch_per_core = row["search_only"]["batch_queries_per_s"] * slower / row["machine"]["cores"]
    return {"kind": row["kind"], "factory": factory, "file_bytes": size, "batch_per_core": batch_per_core,
            "single_ms": 1000 / (row["search_only"]["single_queries_per_s"] * slower),
            "core_s_per_step": SEARCHES_PER_STEP / batch_per_core, "recall@3": row["recall@3"],
            "startup_s": row["startup_s"]}


def gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def load_cells(row: dict) -> list[str]:
    load = row["load"]
    return [num(load[s]["queries_per_s"]) for s in ("c1", "c32", "c256", "b256")] + [num(load["c32"]["p99_ms"], 0)]


def result_table(rows: dict[tuple[str, str], dict], set_name: str) -> str:
    head = ("| kind | params (tuned) | recall@3 | recall@10 | build s | file GB | start-up s | RSS / PSS / private at "
            "start GB | peak RSS / PSS / private under load GB | search alone q/s, batch / single | c1 q/s | c32 q/s | "
            "c256 q/s | b256 q/s | c32 p99 ms |")
    lines = [head, "|" + "---|" * 15]
    for kind in KIND_ORDER:
        row = rows.get((set_name, kind))
        if row is None:
            continue
        if "skipped" in row:
            lines.append(f"| {kind} | skipped: {row['skipped']} |" + " |" * 13)
            continue
        if kind == "search_r1_flat":
            lines.append("| Search-R1's server, Flat | - | - | - | - | - | - | - | - | - | "
                         + " | ".join(load_cells(row)) + " |")
            continue
        start, peak = row["memory_at_start"], row["memory_under_load_peak"]
        memory = [" / ".join(gb(m[f]) for f in ("rss_bytes", "pss_bytes", "private_bytes")) for m in (start, peak)]
        params = row["search_params"] or "-"
        if row.get("tuning") and not row["tuning"]["reached"]:
            params += f" (the most expensive; target not reached, {row['tuning']['recall']} on tuning queries)"
        lines.append(f"| {kind} | {params} | {row['recall@3']:.3f} | {row['recall@10']:.3f} | "
                     f"{num(row['build_s'], 0)} | {gb(row['file_bytes'])} | {num(row['startup_s'])} | {memory[0]} | "
                     f"{memory[1]} | {num(row['search_only']['batch_queries_per_s'], 0)} / "
                     f"{num(row['search_only']['single_queries_per_s'], 0)} | " + " | ".join(load_cells(row)) + " |")
    measured = [r for r in rows.values() if r["set"] == set_name and "machine" in r]
    if measured:
        r = next(x for x in measured if "dim" in x)
        others = sorted(x["machine"]["other_cores_busy"] for x in measured)
        by_commit: dict[str, list[str]] = {}
        for x in measured:
            by_commit.setdefault(x["commit"], []).append(x["kind"])
        commits = "; ".join(f"{c}: {', '.join(kinds)}" for c, kinds in sorted(by_commit.items()))
        lines.append("")
        lines.append(f"{r['vectors']:,} vectors of {r['dim']} dims; {r['machine']['kind']}, {r['machine']['cores']} "
                     f"cores; measured at commit {commits}; {', '.join(sorted({x['date'] for x in measured}))}; cores "
                     f"kept busy by other processes while each type was measured: {others[0]}-{others[-1]} (0: alone).")
    return "\n".join(lines)


def wiki18_table(rows: dict[tuple[str, str], dict]) -> str:
    lines = ["| 21M set | kind | search params (tuning target reached on that set?) | file (= memory to hold it "
             "resident) GB | start-up s (measured, 384 dims) | recall@3 (that set) | search q/s per core, batches | "
             "one query ms | core-s of search per step |",
             "|" + "---|" * 9]
    for set_name in ("perturbed", "synthetic"):
        for kind in KIND_ORDER:
            row = rows.get((set_name, kind))
            if row is None or "skipped" in row or row["vectors"] != WIKI18_PASSAGES:
                continue
            p = project_wiki18(row)
            tuning = row.get("tuning")
            params = "-" if not tuning else f"{tuning['params']} ({'yes' if tuning['reached'] else 'no'})"
            lines.append(f"| {set_name} | {kind} | {params} | {gb(p['file_bytes'])} | {num(p['startup_s'])} | "
                         f"{p['recall@3']:.3f} | {num(p['batch_per_core'])} | {num(p['single_ms'])} | "
                         f"{num(p['core_s_per_step'], 0)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", type=Path, default=RECORD)
    ap.add_argument("--write", action="store_true", help=f"replace the generated blocks in {DOC.relative_to(ROOT)}")
    args = ap.parse_args()
    rows = latest_rows(args.record.read_text().splitlines())
    blocks = {f"scale-{name}": result_table(rows, name) for name in ("real", "synthetic", "perturbed")}
    blocks["scale-wiki18"] = wiki18_table(rows)
    for name, body in blocks.items():
        print(f"## {name}\n{body}\n")
    if args.write:
        text = DOC.read_text()
        for name, body in blocks.items():
            text = replace_block(text, name, body)
        DOC.write_text(text)


if __name__ == "__main__":
    main()

"""Did a refactor change what a run does? Two run folders of `emapg demo` (e.g. one made by the code before a change,
one after, with the same settings) compared: every evaluation's greedy trajectories token for token, the SFT loss
at every step, and the RL iterations' losses (older runs' flat metric names read under today's names).

    python benchmarks/same_behaviour.py BEFORE_RUN AFTER_RUN

Prints one JSON line; `identical` is true only when every trajectory and every compared number is equal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The RL iteration's learning numbers compared (today's names; trainer.run.metrics_log.read_metrics maps older ones).
RL_KEYS = ("rollout/reward", "rollout/em", "rollout/response_tokens", "loss/total", "loss/policy", "kl/anchor",
           "loss/entropy", "loss/grad_norm", "loss/clip_fraction")


def trajectories(folder: Path) -> dict[str, list[tuple]]:
    """file name -> per trajectory (uid, response ids, loss mask, answer)."""
    out = {}
    for path in sorted((folder / "trajectories").glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out[path.name] = [(r["uid"], r["response_ids"], r["loss_mask"], r.get("answer")) for r in rows]
    return out


def same_number(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    args = ap.parse_args()

    from trainer.run.metrics_log import read_metrics

    result: dict = {"benchmark": "same_behaviour", "before": str(args.before), "after": str(args.after),
                    "evaluations": {}}
    for folder in sorted(args.before.glob("eval-*")):
        old, new = trajectories(folder), trajectories(args.after / folder.name)
        pairs = [(a, b) for name in old for a, b in zip(old[name], new.get(name, []), strict=False)]
        result["evaluations"][folder.name] = {
            "trajectories": sum(map(len, old.values())), "compared": len(pairs),
            "token_identical": sum(a == b for a, b in pairs), "same_files": sorted(old) == sorted(new)}
    sft = [read_metrics(run / "sft" / "metrics.jsonl") for run in (args.before, args.after)]
    losses = [[m.get("loss/sft") for m in rows] for rows in sft]
    result["sft_steps"] = [len(x) for x in losses]
    result["sft_losses_equal"] = len(losses[0]) > 0 and all(
        same_number(a, b) for a, b in zip(*losses, strict=True))
    rl = [read_metrics(run / "metrics.jsonl") for run in (args.before, args.after)]
    compared = {}
    for key in RL_KEYS:
        values = [[m[key] for m in rows if key in m] for rows in rl]
        if values[0] or values[1]:
            compared[key] = {"before": values[0], "after": values[1],
                             "equal": len(values[0]) == len(values[1]) and all(
                                 same_number(a, b) for a, b in zip(*values, strict=True))}
    result["rl_iterations"] = compared
    result["identical"] = (all(e["same_files"] and e["token_identical"] == e["trajectories"] == e["compared"]
                               for e in result["evaluations"].values()) and bool(result["evaluations"])
                           and result["sft_losses_equal"] and all(c["equal"] for c in compared.values()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()

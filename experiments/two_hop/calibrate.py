"""The two-hop study's beta rule, applied once (docs/study_two_hop_plan.md, "The beta rule").

    python -m experiments.two_hop.calibrate --out artifacts/two-hop        # after prepare; resumes

For every candidate beta, GRPO-k3c (the arm whose anchor stays at the start: trainer/methods.py) trains 5 iterations
from the study's SFT start at seed 0 (`emapg train`, one process after another: each run is a prefix of a full run,
the schedule being constant), into <out>/calibration/beta-<b>/. The KL term's share of the gradient, `kl/grad_share`,
is averaged over iterations 2-5 (at iteration 1 the anchor equals the policy and every KL gradient is exactly 0),
leaving out iterations without a policy gradient (every group's rewards equal: the share is infinite there).
beta* is the smallest candidate whose mean share lies in [0.10, 0.30]; if none does, the one closest to 0.2 on a log
scale. Writes <out>/calibration/calibration.json and .md: every candidate's shares, iteration times and the choice.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from trainer.run.metrics_log import read_metrics
from trainer.methods import METHODS

app = typer.Typer(add_completion=False)
CANDIDATES = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
BAND = (0.10, 0.30)
ITERATIONS = 5
READ_FROM = 2  # the first iteration whose share is read
ARM = "GRPO-k3c"


def iteration_shares(metrics: list[dict]) -> list[float] | None:
    """kl/grad_share of iterations READ_FROM..ITERATIONS (each iteration's last line), None if one is missing."""
    last = {m["iteration"]: m for m in metrics}
    shares = [last[i].get("kl/grad_share") for i in range(READ_FROM, ITERATIONS + 1) if i in last]
    if len(shares) < ITERATIONS - READ_FROM + 1 or any(s is None for s in shares):
        return None
    return shares


def mean_share(shares: list[float]) -> float:
    """The mean over the iterations with a policy gradient. When every trajectory of an iteration's first micro-batch
    has advantage 0 (its group's rewards all equal), the policy-gradient part is 0 and the share infinite: they say nothing
    about the KL term's weight against the policy gradient and are left out (the plan did not foresee them; its
    deviations section says so). nan when no iteration had a policy gradient."""
    finite = [s for s in shares if math.isfinite(s)]
    return sum(finite) / len(finite) if finite else math.nan


def choose_beta(shares: dict[float, float]) -> tuple[float, str]:
    """The plan's rule over the measured mean shares: (beta*, why)."""
    measured = {b: s for b, s in shares.items() if math.isfinite(s)}
    if not measured:
        raise ValueError("no candidate had an iteration with a policy gradient: no share to choose by")
    inside = sorted(b for b, s in measured.items() if BAND[0] <= s <= BAND[1])
    if inside:
        return inside[0], f"the smallest candidate with a mean share in [{BAND[0]}, {BAND[1]}]"
    closest = min(measured, key=lambda b: abs(math.log(max(measured[b], 1e-12)) - math.log(0.2)))
    return closest, "no candidate in the band: the one closest to 0.2 on a log scale"


def train_candidate(beta: float, run_dir: Path, config: Path, init: Path, out: Path) -> None:
    overrides = [f"{key}={value}" for key, value in METHODS[ARM].overrides.items()]
    command = [sys.executable, "-m", "emapg.cli", "train", "--config", str(config), "--init", str(init),
               *overrides, f"kl.beta={beta}", f"train.iterations={ITERATIONS}", "seed=0",
               f"out_dir={run_dir.parent}", f"name={run_dir.name}", f"retriever.index={out / 'index'}",
               f"data.flashrag_root={out / 'flashrag'}", f"checkpoint.every={ITERATIONS}"]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)


@app.command()
def main(
    out: Annotated[Path, typer.Option(help="the study's folder (prepare's --out)")] = Path("artifacts/two-hop"),
    config: Annotated[Path, typer.Option(help="the study's run config")] = Path("configs/two_hop.yaml"),
) -> None:
    """Train GRPO-k3c 5 iterations at each candidate beta and apply the plan's rule to kl/grad_share."""
    init = out / "two-hop" / "sft"
    rows = []
    for beta in CANDIDATES:
        run_dir = out / "calibration" / f"beta-{beta:g}"
        metrics = read_metrics(run_dir / "metrics.jsonl")
        if iteration_shares(metrics) is None:
            train_candidate(beta, run_dir, config, init, out)
            metrics = read_metrics(run_dir / "metrics.jsonl")
        shares = iteration_shares(metrics)
        if shares is None:
            raise SystemExit(f"{run_dir}: no kl/grad_share for iterations {READ_FROM}-{ITERATIONS}")
        last = {m["iteration"]: m for m in metrics}
        rows.append({"beta": beta, "mean_share": mean_share(shares),
                     "iterations_with_policy_gradient": sum(math.isfinite(s) for s in shares),
                     "shares": [last[i]["kl/grad_share"] for i in range(1, ITERATIONS + 1)],
                     "kl": [last[i].get("kl/anchor") for i in range(1, ITERATIONS + 1)],
                     "reward": [last[i].get("rollout/reward") for i in range(1, ITERATIONS + 1)],
                     "zero_variance_groups": [last[i].get("rollout/zero_variance_groups")
                                              for i in range(1, ITERATIONS + 1)],
                     "iteration_s": [sum(v for k, v in last[i].items() if k.startswith("time/"))
                                     for i in range(1, ITERATIONS + 1)]})
    beta, why = choose_beta({r["beta"]: r["mean_share"] for r in rows})
    result = {"arm": ARM, "iterations": ITERATIONS, "read_from": READ_FROM, "band": BAND, "candidates": rows,
              "beta": beta, "why": why}
    folder = out / "calibration"
    (folder / "calibration.json").write_text(json.dumps(result, indent=1))
    lines = [f"beta* = {beta:g} ({why}); {ARM}, seed 0, from the SFT start, {ITERATIONS} iterations per candidate",
             "", ("| beta | mean kl/grad_share, it. 2-5 with a policy gradient | of 4 | per iteration (1-5) | "
                  "equal-reward groups (1-5) | s / iteration |"), "|---|---|---|---|---|---|"]
    lines += [f"| {r['beta']:g} | {r['mean_share']:.4f} | {r['iterations_with_policy_gradient']} | "
              f"{', '.join(f'{s:.4f}' for s in r['shares'])} | "
              f"{', '.join(f'{z:.2f}' for z in r['zero_variance_groups'])} | "
              f"{sum(r['iteration_s']) / len(r['iteration_s']):.0f} |" for r in rows]
    (folder / "calibration.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    app()

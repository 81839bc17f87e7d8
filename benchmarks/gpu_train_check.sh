#!/usr/bin/env bash
# A short real training run on one GPU: the two-hop study's EMA-PG arm at seed 1 (configs/two_hop.yaml: SmolLM2-135M
# from its SFT start, the real BM25 retrieval server, 16 iterations, held-out two-hop EM at 8 and 16 and of the
# anchor), with the policy, the learner and the EMA anchor on the GPU. The rollout engine is vLLM where it is installed,
# else transformers on the GPU. Read it against the CPU study's seed-1 EMA-PG run (docs/study_two_hop_plan.md).
#   bash benchmarks/gpu_train_check.sh [OUT_DIR]    # default artifacts/gpu-two-hop; PYTHON=... picks the interpreter
# Prints one JSON line at the end: wall times, the engine, per-iteration times and the held-out EM.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
OUT_DIR=${1:-artifacts/gpu-two-hop}
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo '{"benchmark": "gpu_train_check", "error": "torch sees no CUDA device"}'; exit 1; }

start=$(date +%s.%N)
# The KB, its sets and BM25 index, the SFT start (on the GPU: trainer/run/sft.py trains where the policy is).
"$PYTHON" -m experiments.two_hop.prepare --out "$OUT_DIR"
prepared=$(date +%s.%N)
"$PYTHON" -m emapg.cli compare --config configs/two_hop.yaml --index "$OUT_DIR/index" --eval-every 8 --methods EMA-PG \
  seed=1 out_dir="$OUT_DIR" data.flashrag_root="$OUT_DIR/flashrag"
done_at=$(date +%s.%N)

"$PYTHON" - "$OUT_DIR" "$start" "$prepared" "$done_at" <<'PY'
import json, statistics, sys
from pathlib import Path

import torch

from agent.settings import installed_rollout_backend

out, start, prepared, done_at = Path(sys.argv[1]), *map(float, sys.argv[2:])
metrics_path = next(out.rglob("ema-pg/metrics.jsonl"))
rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
times = {key: round(statistics.median(r[key] for r in rows if key in r), 3)
         for key in ("time/rollout_s", "time/prepare_s", "time/update_s", "time/ema_s", "time/weight_sync_s")}
em = {}
for report in sorted(metrics_path.parent.glob("eval-*/report.json")):
    results = json.loads(report.read_text())["results"]
    em[report.parent.name] = {"em": [r["em"] for r in results], "seconds": round(sum(r["seconds"] for r in results), 1)}
print(json.dumps({"benchmark": "gpu_train_check", "device_name": torch.cuda.get_device_name(0),
                  "torch": torch.__version__, "engine": installed_rollout_backend(), "iterations": len(rows),
                  "prepare_wall_s": round(prepared - start, 1), "compare_wall_s": round(done_at - prepared, 1),
                  "median_per_iteration": times, "reward_last_iteration": rows[-1].get("rollout/reward"), "held_out_em": em}))
PY

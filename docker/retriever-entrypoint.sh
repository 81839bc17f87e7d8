#!/bin/sh
# Build the index on first start (into the /data volume), then serve it on all interfaces of the container.
set -e
INDEX="${EMAPG_INDEX:-/data/indexes/wiki-minilm-flat}"
if [ ! -f "$INDEX/manifest.json" ]; then
  emapg index --out "$INDEX" ${EMAPG_INDEX_ARGS:-}
fi
exec emapg serve --index "$INDEX" --host 0.0.0.0 --port 8000 "$@"

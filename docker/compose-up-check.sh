#!/bin/sh
# `docker compose up retriever`, end to end, from the working tree (make compose-up-check; tests/test_compose_up.py):
#   1. a Docker daemon: the running one, else `dockerd` started in the background (root, docker.io installed);
#   2. the base image: $EMAPG_BASE_IMAGE if set (python:3.11-slim on a host that reaches Docker Hub), else the one
#      docker/base-image.sh builds from Debian's packages (emapg-base:bookworm, reused once built);
#   3. the retriever image, built by compose from the working tree (docker/retriever.Dockerfile);
#   4. `compose up -d retriever` under its own project name (fresh volumes: the first start builds the index), on a
#      free loopback port, with a bearer token; waits for Docker's health check to pass;
#   5. through the published port: /health, a search (/retrieve) without the token (401) and with it, /metrics;
#   6. `compose down -v`, also on failure or interruption.
# Prints one line per stage with its time, then "compose-up-check: ok". Exit 77: no Docker daemon can run here (or
# no compose, or nothing to build a base with); the last line says why. Any other non-zero exit: a failure.
# Settings (environment): EMAPG_BASE_IMAGE, COMPOSE_CHECK_TIMEOUT (seconds to wait for healthy; default 900),
# COMPOSE_CHECK_PROJECT (default emapg-compose-check).
set -eu
cd "$(dirname "$0")/.."

skip() { echo "compose-up-check: SKIP: $*"; exit 77; }
now() { date +%s; }
PROJECT="${COMPOSE_CHECK_PROJECT:-emapg-compose-check}"
TIMEOUT="${COMPOSE_CHECK_TIMEOUT:-900}"

# 1. The daemon.
command -v docker >/dev/null || skip "no docker client on PATH (apt-get install docker.io)"
if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || skip "no Docker daemon answers and dockerd is not installed: $(docker info 2>&1 | grep -i -m1 -E 'cannot|error' || true)"
  [ "$(id -u)" = 0 ] || skip "no Docker daemon answers, and starting dockerd needs root"
  LOG="${TMPDIR:-/tmp}/emapg-dockerd.log"
  echo "compose-up-check: starting dockerd (log: $LOG)"
  setsid nohup dockerd >"$LOG" 2>&1 </dev/null &
  i=0
  until docker info >/dev/null 2>&1; do
    i=$((i + 1))
    if [ $i -gt 60 ] || ! kill -0 $! 2>/dev/null; then
      skip "dockerd did not start: $(grep -i -E 'level=(error|fatal)|failed' "$LOG" | tail -n 3 | tr '\n' ' ')"
    fi
    sleep 1
  done
fi
echo "compose-up-check: docker daemon $(docker version -f '{{.Server.Version}}'), storage $(docker info -f '{{.Driver}}'), cgroup v$(docker info -f '{{.CgroupVersion}}')"

# `docker compose` (v2 plugin) where installed, else Debian's docker-compose (1.29).
if docker compose version >/dev/null 2>&1; then
  COMPOSE="docker compose"; V1=""
elif command -v docker-compose >/dev/null; then
  COMPOSE="docker-compose"; V1=1
else
  skip "neither \`docker compose\` nor docker-compose is installed"
fi
COMPOSE="$COMPOSE -p $PROJECT -f docker-compose.yml"
echo "compose-up-check: using $($COMPOSE version --short 2>/dev/null || $COMPOSE version | head -n 1)"

# 2. The base image.
if [ -z "${EMAPG_BASE_IMAGE:-}" ]; then
  EMAPG_BASE_IMAGE=emapg-base:bookworm
  if ! docker image inspect "$EMAPG_BASE_IMAGE" >/dev/null 2>&1; then
    command -v mmdebstrap >/dev/null || command -v debootstrap >/dev/null \
      || skip "no base image: set EMAPG_BASE_IMAGE (e.g. python:3.11-slim) or install mmdebstrap to build $EMAPG_BASE_IMAGE"
  fi
fi
export EMAPG_BASE_IMAGE
t=$(now)
if docker image inspect "$EMAPG_BASE_IMAGE" >/dev/null 2>&1; then
  echo "compose-up-check: base image $EMAPG_BASE_IMAGE: present, reused"
else
  docker/base-image.sh "$EMAPG_BASE_IMAGE"
  echo "compose-up-check: base image $EMAPG_BASE_IMAGE: built in $(( $(now) - t )) s"
fi

# A free loopback port for the retriever, and a token it must require.
EMAPG_RETRIEVER_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
EMAPG_RETRIEVER_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
export EMAPG_RETRIEVER_PORT EMAPG_RETRIEVER_TOKEN

cleanup() {
  rc=$?
  if [ $rc -ne 0 ] && [ -n "${CID:-}" ]; then
    echo "compose-up-check: FAILED (exit $rc); the retriever's last log lines:"
    docker logs --tail 40 "$CID" 2>&1 || true
  fi
  t=$(now)
  $COMPOSE down -v --remove-orphans >/dev/null 2>&1 || true
  echo "compose-up-check: compose down -v in $(( $(now) - t )) s"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM
$COMPOSE down -v --remove-orphans >/dev/null 2>&1 || true  # what an interrupted earlier run left

# 3. The retriever image, from the working tree. The image it replaces is removed once untagged and unused.
OLD=$(docker image inspect -f '{{.Id}}' emapg-retriever:latest 2>/dev/null || true)
t=$(now)
$COMPOSE build ${V1:+--force-rm} retriever
echo "compose-up-check: retriever image built in $(( $(now) - t )) s (base $EMAPG_BASE_IMAGE)"
NEW=$(docker image inspect -f '{{.Id}}' emapg-retriever:latest)
if [ -n "$OLD" ] && [ "$OLD" != "$NEW" ]; then docker rmi "$OLD" >/dev/null 2>&1 || true; fi

# 4. Up, then healthy (Docker's own health check: /health from inside the container).
t=$(now)
$COMPOSE up -d --no-build retriever
CID=$($COMPOSE ps -q retriever)
while :; do
  state=$(docker inspect -f '{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}' "$CID")
  case "$state" in
    "running healthy") break ;;
    exited*|dead*|restarting*) echo "compose-up-check: the retriever stopped ($state)"; exit 1 ;;
  esac
  if [ $(( $(now) - t )) -gt "$TIMEOUT" ]; then echo "compose-up-check: not healthy after $TIMEOUT s ($state)"; exit 1; fi
  sleep 2
done
echo "compose-up-check: compose up -> healthy in $(( $(now) - t )) s (first start: builds the index into a fresh volume)"

# 5. Through the published port.
python3 - <<'PROBE'
import json, os, urllib.error, urllib.request

base = f"http://127.0.0.1:{os.environ['EMAPG_RETRIEVER_PORT']}"
auth = {"Authorization": f"Bearer {os.environ['EMAPG_RETRIEVER_TOKEN']}"}


def call(path, body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


status, text = call("/health")
health = json.loads(text)
assert status == 200 and health["status"] == "ok" and health["index_loaded"], text
print(f"compose-up-check: /health ok: {health['num_docs']} passages, {health['kind']} {health['index_factory']}, "
      f"encoder {health['encoder']}")
query = {"queries": ["Who wrote Hamlet?"], "topk": 3}
status, text = call("/retrieve", query)
assert status == 401, f"/retrieve without the token: {status} {text[:200]}"
status, text = call("/retrieve", query, auth)
assert status == 200, f"/retrieve: {status} {text[:300]}"
hits = json.loads(text)["result"][0]
assert len(hits) == 3 and "Hamlet" in hits[0]["contents"], hits
print(f"compose-up-check: /retrieve 'Who wrote Hamlet?' -> {hits[0]['contents'].splitlines()[0]} "
      f"(401 without the token)")
status, text = call("/metrics", headers=auth)
assert status == 200 and 'emapg_retriever_requests_total{status="200"}' in text, text[:300]
print("compose-up-check: /metrics ok (emapg_retriever_requests_total counts the search)")
PROBE
echo "compose-up-check: ok"

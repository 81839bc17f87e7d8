#!/bin/sh
# A stand-in for python:3.11-slim built from Debian's own packages, for hosts that reach Debian's archive and PyPI
# but no image registry (the project's sandboxes; an air-gapped mirror). Real users do not need it: the Dockerfiles
# default to python:3.11-slim. Build it, then hand it to the images as their base:
#   docker/base-image.sh                       # -> emapg-base:bookworm (reused if it exists; FORCE=1 rebuilds)
#   docker build --build-arg BASE_IMAGE=emapg-base:bookworm -f docker/retriever.Dockerfile -t emapg-retriever .
#   EMAPG_BASE_IMAGE=emapg-base:bookworm docker compose up retriever   # (docker-compose.yml passes it on)
#
# What it holds: Debian bookworm (minbase) with its python3 (3.11, the same minor version as python:3.11-slim),
# python3-venv and python3-pip, and a venv at /opt/venv first on PATH, so `python` and `pip` work as in the
# python image (Debian's own python3 refuses `pip install`, PEP 668). With TORCH_WHEEL (default: the CPU wheel in
# /opt/wheels when it is there) the venv also holds torch 2.13.0+cpu, taken from the host: the Dockerfiles'
# `pip install torch==2.13.0 --index-url ...` then finds it installed and downloads nothing (the PyTorch index is
# unreachable where this script is needed). torch's own dependencies come from PyPI.
#
# Needs: root, mmdebstrap (apt-get install mmdebstrap) or debootstrap, a running Docker daemon.
# Settings (environment): MIRROR (default http://deb.debian.org/debian), TORCH_WHEEL (empty: no torch), FORCE=1,
# EXTRA_CA_DIR (default /usr/local/share/ca-certificates): the host's own CA certificates (*.crt), trusted in the
# image too, and pip told to use the system store (/etc/pip.conf), so that pip works behind the same TLS-inspecting
# proxy as the host. Empty: Debian's CAs only.
set -eu
# Host-only pip settings (a find-links folder on this machine) mean nothing inside the image.
unset PIP_FIND_LINKS

TAG="${1:-emapg-base:bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
EXTRA_CA_DIR="${EXTRA_CA_DIR-/usr/local/share/ca-certificates}"
DEFAULT_WHEEL=/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
if [ -z "${TORCH_WHEEL+set}" ]; then
  if [ -f "$DEFAULT_WHEEL" ]; then TORCH_WHEEL="$DEFAULT_WHEEL"; else TORCH_WHEEL=""; fi
fi

if [ "${FORCE:-0}" != 1 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base-image.sh: $TAG exists (FORCE=1 rebuilds it)"
  exit 0
fi
if [ -n "$TORCH_WHEEL" ] && [ ! -f "$TORCH_WHEEL" ]; then
  echo "base-image.sh: TORCH_WHEEL=$TORCH_WHEEL: no such file" >&2
  exit 1
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
ROOTFS_TAR="$WORK/rootfs.tar"
# Run inside the new root: the host's CAs, then pip pointed at the system store (pip's own bundle lacks them).
mkdir -p "$WORK/ca"
if [ -n "$EXTRA_CA_DIR" ] && ls "$EXTRA_CA_DIR"/*.crt >/dev/null 2>&1; then cp "$EXTRA_CA_DIR"/*.crt "$WORK/ca/"; fi
cat > "$WORK/setup.sh" <<'SETUP'
set -eu
cp /tmp/ca/*.crt /usr/local/share/ca-certificates/ 2>/dev/null || true
update-ca-certificates >/dev/null
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > /etc/pip.conf
python3 -m venv /opt/venv
if [ -n "$(ls /tmp/wheels 2>/dev/null)" ]; then /opt/venv/bin/pip install --no-cache-dir /tmp/wheels/*.whl; fi
rm -rf /tmp/ca /tmp/wheels /tmp/setup.sh /var/lib/apt/lists/* /var/cache/apt/*.bin /root/.cache
SETUP
mkdir -p "$WORK/wheels"
if [ -n "$TORCH_WHEEL" ]; then cp "$TORCH_WHEEL" "$WORK/wheels/"; fi
PACKAGES=python3,python3-venv,python3-pip,ca-certificates
start=$(date +%s)

if command -v mmdebstrap >/dev/null; then
  # The hook runs on the host with the new root as $1; pip inside the chroot reaches PyPI through the host's network.
  mmdebstrap --variant=minbase --include="$PACKAGES" \
    --customize-hook="cp -r '$WORK/ca' '$WORK/wheels' '$WORK/setup.sh' \"\$1/tmp/\"" \
    --customize-hook='chroot "$1" sh /tmp/setup.sh' \
    bookworm "$ROOTFS_TAR" "$MIRROR"
elif command -v debootstrap >/dev/null; then
  ROOT="$WORK/root"
  debootstrap --variant=minbase --include="$PACKAGES" bookworm "$ROOT" "$MIRROR"
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  cp -r "$WORK/ca" "$WORK/wheels" "$WORK/setup.sh" "$ROOT/tmp/"
  chroot "$ROOT" sh /tmp/setup.sh
  rm -f "$ROOT/etc/resolv.conf"
  tar -C "$ROOT" -cf "$ROOTFS_TAR" .
else
  echo "base-image.sh: needs mmdebstrap or debootstrap (apt-get install mmdebstrap)" >&2
  exit 1
fi

# The python image's conventions: the venv first on PATH, UTF-8, unbuffered-friendly defaults left to the Dockerfiles.
docker import \
  --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV VIRTUAL_ENV=/opt/venv' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  "$ROOTFS_TAR" "$TAG"
echo "base-image.sh: $TAG built in $(( $(date +%s) - start )) s"

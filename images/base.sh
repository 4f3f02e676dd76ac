#!/usr/bin/env bash
# A base image for both kvfence images without a registry: Debian bookworm's minbase with
# python3 (3.11), venv, pip, passwd and the CA certificates, made by mmdebstrap from the Debian
# mirror apt uses and imported into podman as $BASE (localhost/kvfence-base:bookworm). About
# two minutes; skipped when the image exists. Needs root, mmdebstrap and podman.
set -euo pipefail
cd "$(dirname "$0")/.."
. images/podman-env.sh
BASE="${BASE:-localhost/kvfence-base:bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
if podman image exists "$BASE"; then
    echo "images/base.sh: $BASE exists"
    exit 0
fi
tar="$state/base.tar"
mmdebstrap --variant=minbase --mode=root --format=tar \
    --include=python3,python3-venv,python3-pip,passwd,ca-certificates \
    bookworm "$tar" "$MIRROR"
podman import --change 'CMD ["python3"]' "$tar" "$BASE"
rm -f "$tar"

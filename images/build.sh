#!/usr/bin/env bash
# Builds the operator image and a CPU engine image with podman (or docker, where podman is
# absent), from the repository root. The base is $BASE: by default a local Debian one that
# images/base.sh makes when it is missing (no registry needed); with docker, set BASE to a
# registry image such as docker.io/library/python:3.11-slim-bookworm. Layers are cached between
# runs (podman: in images/podman-env.sh's folder), so an unchanged input rebuilds nothing.
#
#   images/build.sh                       # localhost/kvfence-engine:dev, localhost/kvfence-operator:dev
#   ENGINE_TAG=… OPERATOR_TAG=… images/build.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE_TAG="${ENGINE_TAG:-localhost/kvfence-engine:dev}"
OPERATOR_TAG="${OPERATOR_TAG:-localhost/kvfence-operator:dev}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
CA=/etc/ssl/certs/ca-certificates.crt
if command -v podman > /dev/null; then
    . images/podman-env.sh
    BASE="${BASE:-localhost/kvfence-base:bookworm}"
    podman image exists "$BASE" || BASE="$BASE" images/base.sh
    # pip in the RUN steps reaches the index with the host's CA bundle, mounted and not baked
    # in. A local wheel of the pinned CPU torch (TORCH_WHEEL, or one in /opt/wheels, pip's
    # find-links on these machines) is mounted and installed instead of the torch index.
    mounts=(-v "$CA:$CA:ro" --network host)
    wheel="${TORCH_WHEEL:-$(ls /opt/wheels/torch-"$TORCH_VERSION"+cpu-*.whl 2> /dev/null | head -1)}"
    torch=()
    if [ -n "$wheel" ]; then
        mounts+=(-v "$(dirname "$wheel"):/wheels:ro")
        torch=(--build-arg TORCH_WHEEL="/wheels/$(basename "$wheel")")
    fi
    build=(podman build --pull=never "${mounts[@]}")
else
    BASE="${BASE:?with docker, set BASE to a Python 3.11 Debian image}"
    torch=()
    build=(docker build)
fi
"${build[@]}" --build-arg BASE="$BASE" -f operator/Dockerfile -t "$OPERATOR_TAG" .
"${build[@]}" --build-arg BASE="$BASE" "${torch[@]}" \
    --build-arg TORCH_VERSION="$TORCH_VERSION" \
    --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu --build-arg TORCH_BUILD=cpu \
    -f engine/Dockerfile -t "$ENGINE_TAG" .
echo "images/build.sh: built $OPERATOR_TAG and $ENGINE_TAG"

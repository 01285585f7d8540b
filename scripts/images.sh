#!/usr/bin/env bash
# Builds, runs and exports lorafleet's container images with whichever builder is present
# (Docker, Podman or Buildah). The Makefile's image targets call this; see docs/images.md.
#   scripts/images.sh base                      localhost/lorafleet-base:bookworm from Debian packages (mmdebstrap)
#   scripts/images.sh build operator|runner     build one image from its Dockerfile
#   scripts/images.sh smoke operator|runner     run it: the operator against a test control plane, the
#                                               runner serving the CPU demo and answering a completion
#   scripts/images.sh export operator|runner    an OCI archive in build/images/ (kind load, skopeo, registry push)
#   scripts/images.sh size operator|runner      its size in MB
# Environment (the Makefile passes its variables of the same names):
#   IMAGE_BUILDER      docker, podman or buildah (default: the first one present that works)
#   IMAGE_BUILD_FLAGS  extra builder flags, e.g. --volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro
#   IMAGE_BASE         the images' base (build argument BASE_IMAGE; default: the Dockerfiles' own)
#   IMAGE_PREFIX       repository prefix (default lorafleet): lorafleet/operator:VERSION, lorafleet/runner:VERSION
#   RUNNER_VARIANT     cuda (default) or cpu: the runner with CPU torch (tag VERSION-cpu)
#   IMAGE_TAG          tag instead of the package version
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
PREFIX=${IMAGE_PREFIX:-lorafleet}
TAG=${IMAGE_TAG:-$VERSION}
VARIANT=${RUNNER_VARIANT:-cuda}
BASE_TAG=localhost/lorafleet-base:bookworm
# shellcheck disable=SC2206
FLAGS=(${IMAGE_BUILD_FLAGS:-})

die() { echo "images.sh: $*" >&2; exit 2; }

builder() {
  if [ -n "${IMAGE_BUILDER:-}" ]; then
    command -v "$IMAGE_BUILDER" >/dev/null || die "IMAGE_BUILDER=$IMAGE_BUILDER is not installed"
    echo "$IMAGE_BUILDER"; return
  fi
  # docker only when its daemon answers (the client alone cannot build)
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then echo docker; return; fi
  for b in podman buildah; do command -v $b >/dev/null && { echo $b; return; }; done
  die "no image builder: install Docker, Podman or Buildah, or name one with IMAGE_BUILDER="
}

image() {  # the image name of operator|runner
  case "$1" in
    operator) echo "$PREFIX/operator:$TAG" ;;
    runner) if [ "$VARIANT" = cpu ]; then echo "$PREFIX/runner:$TAG-cpu"; else echo "$PREFIX/runner:$TAG"; fi ;;
    *) die "unknown image '$1' (operator or runner)" ;;
  esac
}

# A command in a new container of IMAGE: run_in IMAGE [-v SRC:DST ...] -- ARGS (host network; ARGS are
# the entrypoint's arguments). SIGTERM or SIGINT stops the container (and removes it).
run_in() {
  local img=$1; shift
  local mounts=()
  while [ "$1" != -- ]; do mounts+=("$1"); shift; done; shift
  local b ctr="" child rc; b=$(builder)
  if [ "$b" = buildah ]; then
    ctr=$(buildah from --pull=false "$img")
    # buildah run does not apply the entrypoint: name it
    buildah run --network host "${mounts[@]}" "$ctr" -- lorafleet "$@" & child=$!
  else
    "$b" run --rm --init --network host "${mounts[@]}" "$img" "$@" & child=$!
  fi
  trap 'kill -TERM $child 2>/dev/null' TERM INT
  rc=0; wait $child || rc=$?
  wait $child 2>/dev/null || true  # after a signal: until it has stopped
  trap - TERM INT
  [ -z "$ctr" ] || buildah rm "$ctr" >/dev/null
  return $rc
}

cmd_base() {
  command -v mmdebstrap >/dev/null || die "mmdebstrap is not installed (apt-get install mmdebstrap)"
  local b; b=$(builder); mkdir -p build/images
  local tar=build/images/lorafleet-base-bookworm.tar
  # Python with venv and the CA certificates; no documentation, manual pages or translations.
  mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    bookworm "$tar"
  case "$b" in
    buildah)
      local ctr; ctr=$(buildah from scratch)
      buildah add "$ctr" "$tar" / >/dev/null
      buildah config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
      buildah commit --rm "$ctr" "$BASE_TAG" >/dev/null ;;
    *) "$b" import --change 'CMD ["/bin/bash"]' "$tar" "$BASE_TAG" >/dev/null ;;
  esac
  rm -f "$tar"
  echo "$BASE_TAG"
}

cmd_build() {
  local what=$1 b; b=$(builder)
  local args=(-f "Dockerfile.$what" -t "$(image "$what")")
  [ -n "${IMAGE_BASE:-}" ] && args+=(--build-arg "BASE_IMAGE=$IMAGE_BASE")
  [ "$what" = runner ] && args+=(--build-arg "VARIANT=$VARIANT")
  if [ "$b" = buildah ]; then
    buildah bud --layers "${args[@]}" "${FLAGS[@]}" .
  else
    "$b" build "${args[@]}" "${FLAGS[@]}" .
  fi
}

cmd_size() {  # MB (10^6 bytes) of the image's layers, unpacked
  local b img; b=$(builder); img=$(image "$1")
  case "$b" in
    buildah) buildah images --json "$img" | python3 -c '
import json, sys
size, unit = json.load(sys.stdin)[0]["size"].split()
print(round(float(size) * {"kB": 1e-3, "MB": 1, "GB": 1e3}[unit]))' ;;
    *) "$b" image inspect --format '{{.Size}}' "$img" | awk '{printf "%.0f\n", $1 / 1e6}' ;;
  esac
}

cmd_export() {
  local b img; b=$(builder); img=$(image "$1")
  mkdir -p build/images
  local out="build/images/${PREFIX//\//-}-$1-${img##*:}.oci.tar"
  case "$b" in
    docker) docker save -o "$out" "$img" ;;  # Docker's archive; kind load image-archive reads it
    podman) podman save --format oci-archive -o "$out" "$img" ;;
    buildah) rm -f "$out"; buildah push "$img" "oci-archive:$out:$img" ;;
  esac
  echo "$out ($(du -m "$out" | cut -f1) MB)"
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

wait_http() {  # URL SECONDS PID: until URL answers 200, the process PID exits, or time runs out
  local i
  for ((i = 0; i < $2 * 2; i++)); do
    curl -fsS -o /dev/null "$1" 2>/dev/null && return 0
    kill -0 "$3" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

smoke_operator() {
  local img; img=$(image operator)
  local py=${PYTHON:-.venv/bin/python}
  echo "== $img: lorafleet operator --help"
  run_in "$img" -- operator --help | head -3
  run_in "$img" -- --version
  echo "== $img: against a test control plane"
  local dir; dir=$(mktemp -d); trap 'rm -rf "$dir"' RETURN
  "$py" scripts/image_smoke_operator.py --image-run "scripts/images.sh run-in $img" --dir "$dir"
}

smoke_runner() {
  local img; img=$(image runner)
  local py=${PYTHON:-.venv/bin/python}
  local demo; demo=$("$py" -c "from lorafleet.runner.demo import prepare; print(prepare())" | tail -1)
  # the pod's view: a model volume its user (1000) can read
  local dir; dir=$(mktemp -d); trap 'rm -rf "$dir"' RETURN
  cp -r "$demo/model" "$demo/adapters" "$dir/"; chmod -R a+rX "$dir"
  local port; port=$(free_port)
  echo "== $img: lorafleet serve (CPU demo) on port $port"
  run_in "$img" -v "$dir:/demo:ro" -- --log-level WARNING serve --model /demo/model --adapters /demo/adapters \
    --device cpu --port "$port" --kv-cache-gb 0.25 > build/images/runner-smoke.log 2>&1 &
  local pid=$!
  if ! wait_http "http://127.0.0.1:$port/v1/models" 300 $pid; then
    tail -40 build/images/runner-smoke.log; kill $pid 2>/dev/null; die "the runner image did not serve"
  fi
  local answer
  answer=$(curl -fsS "http://127.0.0.1:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "pirate", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}')
  kill -TERM $pid; wait $pid || true
  echo "$answer"
  python3 -c 'import json, sys; r = json.loads(sys.argv[1]); assert r["choices"][0]["text"].strip(), r' "$answer"
  echo "== $img: answered a completion"
}

mkdir -p build/images
case "${1:-}" in
  base) cmd_base ;;
  build) cmd_build "${2:?operator or runner}" ;;
  smoke) "smoke_${2:?operator or runner}" ;;
  export) cmd_export "${2:?operator or runner}" ;;
  size) cmd_size "${2:?operator or runner}" ;;
  builder) builder ;;
  name) image "${2:?operator or runner}" ;;
  run-in) shift; img=$1; shift; run_in "$img" "$@" ;;
  *) sed -n '2,17p' "$0"; exit 2 ;;
esac

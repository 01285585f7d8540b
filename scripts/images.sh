#!/usr/bin/env bash
# Builds, runs and exports lorafleet's container images with whichever builder is present
# (Docker, Podman or Buildah). The Makefile's image targets call this; see docs/images.md.
#   scripts/images.sh base                      localhost/lorafleet-base:bookworm from Debian packages (mmdebstrap)
#   scripts/images.sh build operator|runner     build one image from its Dockerfile
#   scripts/images.sh smoke operator|runner     run it: the operator against a test control plane, the
#                                               runner serving the CPU demo and answering a completion
#   scripts/images.sh check runner [SHAPES]     the CUDA runner image carries its kernels: versions, `lorafleet
#                                               runner --help`, every ahead-of-time module loads with flashinfer's
#                                               JIT off, and `lorafleet build-kernels --flashinfer SHAPES` (the
#                                               build's shapes, e.g. --kv-dtypes bfloat16 float8_e4m3fn) compiles
#                                               nothing; runs on a machine without a GPU
#   scripts/images.sh export operator|runner    an OCI archive in build/images/ (kind load, skopeo, registry push)
#   scripts/images.sh size operator|runner      its size in MB
# Environment (the Makefile passes its variables of the same names):
#   IMAGE_BUILDER      docker, podman or buildah (default: the first one present that works)
#   IMAGE_BUILD_FLAGS  extra builder flags, e.g. --volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro
#                      (split as the shell splits words: --build-arg KERNEL_HEAD_DIMS="128 256" is one argument)
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
# the flags as a shell would split them (quotes group words); they are the caller's own command line
eval "FLAGS=(${IMAGE_BUILD_FLAGS:-})"

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

# A command (not the entrypoint's arguments) in a new container of IMAGE, as the image's user:
# exec_in IMAGE COMMAND [ARGS...]
exec_in() {
  local img=$1; shift
  local b ctr rc=0; b=$(builder)
  if [ "$b" = buildah ]; then
    ctr=$(buildah from --pull=false "$img")
    buildah run --network host "$ctr" -- "$@" || rc=$?
    buildah rm "$ctr" >/dev/null
  else
    "$b" run --rm --network host --entrypoint "$1" "$img" "${@:2}" || rc=$?
  fi
  return $rc
}

has_image() {
  local b; b=$(builder)
  case "$b" in
    buildah) buildah inspect --type image "$1" >/dev/null 2>&1 ;;
    *) "$b" image inspect "$1" >/dev/null 2>&1 ;;
  esac
}

# Runs inside the runner image (python -c): argv[1:] are build-kernels' shape flags.
CHECK_RUNNER_PY='
import os, subprocess, sys, tempfile, time
from pathlib import Path
shapes = sys.argv[1:] or ["--head-dims", "128", "--dtypes", "bfloat16"]
os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "8.0 9.0a")  # no GPU to ask (the names do not depend on it)
ws, home = Path(tempfile.mkdtemp(prefix="jit-")), Path(tempfile.mkdtemp(prefix="home-"))
env = dict(os.environ, FLASHINFER_WORKSPACE_BASE=str(ws), FLASHINFER_DISABLE_JIT="1", HOME=str(home))
import torch, flashinfer, tvm_ffi
from flashinfer.jit import env as fi_env
nvcc = subprocess.run([os.environ["CUDA_HOME"] + "/bin/nvcc", "--version"], capture_output=True, text=True).stdout
nvcc = nvcc.split("release ")[1].split(",")[0]
print(f"uid {os.getuid()}; torch {torch.__version__} (CUDA {torch.version.cuda}); flashinfer {flashinfer.__version__};",
      f"tvm-ffi {tvm_ffi.__version__}; nvcc {nvcc}")
aot_dir, tvm_dir, kdir = fi_env.FLASHINFER_AOT_DIR, Path(os.environ["TVM_FFI_CACHE_DIR"]), Path(os.environ["LORAFLEET_KERNEL_DIR"])
aot, tvm, sgmv = sorted(aot_dir.glob("*/*.so")), sorted(tvm_dir.glob("*.so")), sorted(kdir.glob("*.so"))
mb = sum(p.stat().st_size for p in aot) / 1e6
print(f"flashinfer ahead-of-time modules in {aot_dir}: {len(aot)} ({mb:.0f} MB)")
for p in aot:
    print("  ", p.name)
print(f"tvm-ffi torch addons in {tvm_dir}:", *[p.name for p in tvm])
print(f"SGMV extension in {kdir}:", *[p.name for p in sgmv])
assert aot and len(tvm) == 2 and sgmv
# 1. build-kernels for the build shapes: every module already there, nothing compiled
t0 = time.time()
r = subprocess.run(["lorafleet", "build-kernels", "--flashinfer", *shapes], env=env, capture_output=True, text=True)
took = time.time() - t0
assert r.returncode == 0, r.stdout + r.stderr
out = [Path(x) for x in r.stdout.split()]
def compiled():  # what a build leaves (writing the generated sources of a module is not building it)
    return [p for p in ws.rglob("*") if p.suffix in (".o", ".so", ".ninja")]
assert not compiled(), f"build-kernels compiled: {compiled()[:5]}"
built = [p for p in out if p.parent.parent == aot_dir and p.is_file()]
assert built and out == built + [kdir / "lorafleet_sgmv.so"], r.stdout
print(f"lorafleet build-kernels --flashinfer", *shapes, f"-> {len(built)} flashinfer modules and the SGMV",
      f"extension already built, nothing compiled ({took:.1f} s)")
# 2. every ahead-of-time module and the SGMV extension load (flashinfer JIT off; the kernel folder read-only)
code = ("import sys, torch, tvm_ffi\nfor p in sys.argv[1:]: tvm_ffi.load_module(p)\n"
        "from lorafleet.runner import kernels\nprint(kernels.load().__file__)")
r = subprocess.run([sys.executable, "-c", code, *map(str, aot)], env=env, capture_output=True, text=True)
assert r.returncode == 0, r.stdout + r.stderr
assert Path(r.stdout.split()[-1]) == kdir / "lorafleet_sgmv.so", r.stdout
assert not compiled() and not (home / ".cache").exists(), "something was compiled"
print(f"loaded {len(aot)} flashinfer modules and the SGMV extension, flashinfer JIT off; tvm-ffi compiled nothing")
'

check_runner() {
  local img; img=$(image runner)
  [ "$VARIANT" = cuda ] || die "check: the cpu variant carries no kernels"
  has_image "$img" || die "no image $img (make image-runner)"
  echo "== $img: lorafleet runner --help"
  run_in "$img" -- runner --help | head -1
  echo "== $img: compiled kernels"
  exec_in "$img" python -c "$CHECK_RUNNER_PY" "$@"
  echo "== $img: carries its kernels"
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
  check) [ "${2:-}" = runner ] || die "check: runner only"; shift 2; check_runner "$@" ;;
  export) cmd_export "${2:?operator or runner}" ;;
  size) cmd_size "${2:?operator or runner}" ;;
  builder) builder ;;
  name) image "${2:?operator or runner}" ;;
  run-in) shift; img=$1; shift; run_in "$img" "$@" ;;
  *) sed -n '2,22p' "$0"; exit 2 ;;
esac

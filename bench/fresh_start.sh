#!/usr/bin/env bash
# A runner's start on a fresh GPU machine with exactly what the runner image carries (Dockerfile.runner):
# the image's kernel step (`lorafleet build-kernels --flashinfer` with its default shapes) runs first
# into fresh folders, as at image build time; then `lorafleet runner` starts on a Llama-2-7B-shape
# synthetic model with empty caches everywhere else (home, flashinfer's JIT workspace, torch
# extensions), as a new pod does. Measures "weights loaded" (the engine's log line) -> /readyz 200.
# Prints one JSON line; fresh_machine_ready_s is the figure, jit_modules_compiled_at_start should be 0.
#   bash bench/fresh_start.sh        (repository root of a GPU machine; torch with CUDA, nvcc and ninja
#                                     installed; flashinfer's wheels in .whl/ as for bench/device_run.sh)
# Knobs: FLASHINFER_CUDA_ARCH_LIST (default "8.0 9.0a", as the image), PORT (default 8031), READY_S (900),
# FRESH_KEEP_SITE / FRESH_KEEP_KERNELS (afterwards, copy the built flashinfer modules into that site's
# ahead-of-time folder / the SGMV build into that kernel dir, for later work on the same machine).
set -euo pipefail
T=$(mktemp -d /tmp/fresh_start.XXXXXX)
PORT=${PORT:-8031}
export PYTHONUNBUFFERED=1 HOME=$T/home XDG_CACHE_HOME=$T/home/.cache TORCH_EXTENSIONS_DIR=$T/torch_extensions \
  LORAFLEET_CACHE=$T/cache LORAFLEET_KERNEL_DIR=$T/kernels FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-8.0 9.0a} \
  TVM_FFI_CACHE_DIR=$T/tvm-ffi
mkdir -p "$HOME"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$T/site" .whl/*.whl > "$T/pip.log" 2>&1 \
  || { cat "$T/pip.log"; exit 1; }
export PYTHONPATH=$PWD/src:$T/site

# 1. The image build's kernel step (the Dockerfile's defaults: head size 128, bf16), after tvm-ffi's torch
#    DLPack addon (which tvm-ffi compiles on first import where its cache folder lacks it).
t0=$(date +%s.%N)
TVM_FFI_DISABLE_TORCH_C_DLPACK=1 python3 -m tvm_ffi.utils._build_optional_torch_c_dlpack --output-dir "$TVM_FFI_CACHE_DIR" \
  --build-dir "$T/image-build/tvm-ffi" --build-with-cuda > "$T/tvm.log" 2>&1 || { tail -30 "$T/tvm.log"; exit 1; }
rm -f "$TVM_FFI_CACHE_DIR"/*.lock
FLASHINFER_WORKSPACE_BASE=$T/image-build python3 -m lorafleet build-kernels --flashinfer > "$T/build.log" 2>&1 \
  || { tail -30 "$T/build.log"; exit 1; }
build_s=$(python3 -c "import sys; print(round($(date +%s.%N) - $t0, 1))")
rm -rf "$T/image-build"  # not in the image: only flashinfer's ahead-of-time folder and the kernel dir are

# 2. A new pod: the 7B shape (weights drawn on the GPU), an empty JIT workspace.
mkdir -p "$T/model-7b"
echo '{"seed": 0, "std": 0.02}' > "$T/model-7b/synthetic.json"
cat > "$T/model-7b/config.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
 "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
 "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "hidden_act": "silu",
 "tie_word_embeddings": false, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
EOF
export FLASHINFER_WORKSPACE_BASE=$T/pod
find "$TVM_FFI_CACHE_DIR" "$LORAFLEET_KERNEL_DIR" -name '*.so' | sort > "$T/so_before.txt"
started=$(date +%s.%N)
python3 -m lorafleet --log-level INFO runner --model "$T/model-7b" --device cuda --host 127.0.0.1 --port "$PORT" \
  > "$T/runner.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
ready_now() {  # /readyz answers 200 (curl where the machine has it)
  if command -v curl >/dev/null; then curl -fsS -o /dev/null "http://127.0.0.1:$PORT/readyz" 2>/dev/null
  else python3 -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)" "http://127.0.0.1:$PORT/readyz" 2>/dev/null; fi
}
ready=""
for _ in $(seq 1 $(( ${READY_S:-900} * 4 ))); do
  if ready_now; then ready=$(date +%s.%N); break; fi
  kill -0 $pid 2>/dev/null || { tail -30 "$T/runner.log"; exit 1; }
  sleep 0.25
done
[ -n "$ready" ] || { tail -30 "$T/runner.log"; echo "not ready after ${READY_S:-900}s" >&2; exit 1; }
kill $pid; wait $pid 2>/dev/null || true
cp "$T/runner.log" "$T/build.log" "${OUT:-/tmp}/" 2>/dev/null || true
{ find "$T/pod" -name '*.so' 2>/dev/null || true; find "$TVM_FFI_CACHE_DIR" "$LORAFLEET_KERNEL_DIR" -name '*.so' | sort | comm -13 "$T/so_before.txt" -; } \
  > "$T/so_new.txt"
if [ -n "${FRESH_KEEP_SITE:-}" ]; then
  mkdir -p "$FRESH_KEEP_SITE/flashinfer/data/aot" && cp -r "$T/site/flashinfer/data/aot/." "$FRESH_KEEP_SITE/flashinfer/data/aot/"
fi
if [ -n "${FRESH_KEEP_KERNELS:-}" ]; then mkdir -p "$FRESH_KEEP_KERNELS" && cp -r "$T/kernels/." "$FRESH_KEEP_KERNELS/"; fi

python3 - "$T/runner.log" "$started" "$ready" "$build_s" "$T/so_new.txt" <<'EOF'
import datetime, json, os, re, subprocess, sys
log, started, ready, build_s, new = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
line = next(l for l in open(log) if re.search(r" loaded .* in [0-9.]+s", l))
loaded = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
card = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(json.dumps({
    "fresh_machine_ready_s": round(ready - loaded, 1),
    "weights_load_s": float(re.search(r" in ([0-9.]+)s", line).group(1)),
    "process_start_to_ready_s": round(ready - started, 1),
    "jit_modules_compiled_at_start": len(open(new).read().split()),
    "image_kernel_build_s": build_s, "flashinfer_cuda_arch_list": os.environ["FLASHINFER_CUDA_ARCH_LIST"],
    "card": card.splitlines()[0] if card else None, "commit": commit,
    "date": datetime.date.today().isoformat(), "command": "bash bench/fresh_start.sh",
}))
EOF

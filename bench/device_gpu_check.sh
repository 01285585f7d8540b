#!/usr/bin/env bash
# One call on a lent H200: GPU engine tests, then a reduced end-to-end benchmark.
# Usage (repository root, wheels in .whl/): bash bench/device_gpu_check.sh
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LORAFLEET_CACHE=/tmp/lfcache LORAFLEET_KERNEL_DIR=/tmp/lfkernels FLASHINFER_WORKSPACE_BASE=/tmp/fiws
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
export PYTHONPATH=$PWD/src:/tmp/site
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
stamp "building SGMV kernels"
timeout 240 python3 -m lorafleet build-kernels > "$OUT/build.log" 2>&1 & BUILD=$!
timeout 120 python3 -c "import flashinfer, time; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
wait $BUILD; stamp "build rc=$? $(tail -1 $OUT/build.log)"
stamp "engine GPU tests"
timeout ${TEST_S:-210} python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_engine_cuda.py --durations=5 2>&1 | tee "$OUT/engine_tests.log" | tail -25
stamp "tests done"
timeout ${BENCH_S:-150} python3 -m lorafleet --log-level WARNING bench e2e --requests ${REQS:-256} --mixes distinct identical \
  --population 64 --sweep --hf-requests 0 --profile --out "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log" | tail -20
stamp "bench done"
( cd /tmp && find fiws -name '*.so' | head -50 | tar czf "$OUT/ficache.tgz" -T - ) 2>/dev/null
ls -la "$OUT"

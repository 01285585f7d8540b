#!/usr/bin/env bash
# GPU work in one call on a lent H200 (repository root; wheels in .whl/, optional caches in .cache_fi/).
#   bash bench/device_run.sh tests    # kernel + engine GPU tests, sanitizer case
#   bash bench/device_run.sh e2e      # bench e2e: distinct + identical, LoRA off, HF+PEFT, breakdown
#   bash bench/device_run.sh e2e2     # bench e2e: uniform + skewed, LoRA off (one call each: ~8 min)
#   bash bench/device_run.sh extra    # bench e2e: cold start from disk (COLD_REQS=400) and the 64/128/256 sweep
#   bash bench/device_run.sh quick    # engine GPU tests, then a short e2e (REQS=256: distinct, identical,
#                                     # LoRA off, per-step profile) to see where a step's time goes
# Knobs: REQS (default 1000), BENCH_S (timeout of the bench, s). Results and caches go to $OUT.
# The wheels (the GPU machine has no network): in the repository root, with .whl/ ignored by git,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl flashinfer-python==0.5.3 apache-tvm-ffi==0.1.3
# ficache.tgz / lfkernels.tgz from a previous call's $OUT can be put in .cache_fi/ to skip compiling.
# Afterwards, on any machine: lorafleet bench e2e --merge e2e_a.json e2e_b.json e2e_extra.json --out docs/e2e.json
# and lorafleet bench e2e --plot-from docs/e2e.json --plot docs/e2e_mixes.png
set -u -o pipefail
STAGE=${1:-tests}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LORAFLEET_KERNEL_DIR=/tmp/lfkernels FLASHINFER_WORKSPACE_BASE=/tmp/fiws
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
export PYTHONPATH=$PWD/src:/tmp/site
[ -f .cache_fi/ficache.tgz ] && tar xzf .cache_fi/ficache.tgz -C /tmp
[ -f .cache_fi/lfkernels.tgz ] && tar xzf .cache_fi/lfkernels.tgz -C /tmp
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
timeout 240 python3 -m lorafleet build-kernels > "$OUT/build.log" 2>&1; stamp "kernels: $(tail -1 "$OUT/build.log")"
case "$STAGE" in
  tests)
    timeout ${TEST_S:-400} python3 -m pytest -q -p no:cacheprovider tests/gpu -rA --durations=8 -s 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|flips|Error" | tail -30
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck python3 tests/gpu/sanitizer_case.py \
      > "$OUT/sanitizer.log" 2>&1; tail -2 "$OUT/sanitizer.log" ;;
  e2e)
    timeout ${BENCH_S:-540} python3 -m lorafleet --log-level WARNING bench e2e --requests ${REQS:-1000} \
      --mixes distinct identical --sweep --profile --out "$OUT/e2e_a.json" 2>&1 | tee "$OUT/e2e_a.log" | tail -14 ;;
  e2e2)
    timeout ${BENCH_S:-540} python3 -m lorafleet --log-level WARNING bench e2e --requests ${REQS:-1000} \
      --mixes uniform skewed --sweep --hf-requests 0 --out "$OUT/e2e_b.json" 2>&1 | tee "$OUT/e2e_b.log" | tail -14 ;;
  quick)
    timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_cuda.py -rA -s \
      --durations=6 -o faulthandler_timeout=${HANG_S:-100} 2>&1 | tee "$OUT/gpu_tests.log" \
      | grep -E "passed|failed|FAILED|flips|Error|piecewise|call |Timeout|File " | tail -30
    timeout ${BENCH_S:-400} python3 -m lorafleet --log-level WARNING bench e2e --requests ${REQS:-256} \
      --mixes distinct identical --sweep --hf-requests 0 --profile --out "$OUT/e2e_quick.json" 2>&1 \
      | tee "$OUT/e2e_quick.log" | tail -16 ;;
  extra)
    timeout ${BENCH_S:-500} python3 -m lorafleet --log-level WARNING bench e2e --requests ${REQS:-1000} \
      --mixes --cold --cold-requests ${COLD_REQS:-400} --no-lora-off --hf-requests 0 --sweep 64 128 256 \
      --out "$OUT/e2e_extra.json" 2>&1 \
      | tee "$OUT/e2e_extra.log" | tail -10 ;;
esac
stamp "done"
( cd /tmp && find fiws -name '*.so' | tar czf "$OUT/ficache.tgz" -T - ) 2>/dev/null
( cd /tmp && tar czf "$OUT/lfkernels.tgz" lfkernels ) 2>/dev/null
ls -la "$OUT" | tail -n +2

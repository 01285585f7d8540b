"""Every LORAFLEET_* environment variable, typed, in one place.

The kernel variables are read once, when an engine starts, into its `KernelChoices`
(runner/config.py); no module below the engine reads the environment."""

from __future__ import annotations

import os
from pathlib import Path


class EnvError(ValueError):
    """A LORAFLEET_* variable with a value it cannot take (the message names the variable and what it takes)."""


def _str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _choice(name: str, choices: tuple[str, ...]) -> str:
    """One of `choices` (case and surrounding blanks ignored; unset or empty: the first), else ValueError."""
    choice = _str(name, choices[0]).strip().lower() or choices[0]
    if choice not in choices:
        raise EnvError(f"{name} must be one of {', '.join(choices)}, got {choice!r}")
    return choice


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise EnvError(f"environment variable {name} must be an integer, got {raw!r}") from exc


def cache_dir() -> Path:
    """LORAFLEET_CACHE: where the demo model, fetched adapters and built kernels live."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lorafleet"
    return Path(_str("LORAFLEET_CACHE", str(default)))


def admin_token() -> str | None:
    """LORAFLEET_ADMIN_TOKEN: bearer token for the scheduler's /admin endpoints (unset: refused)."""
    tok = os.environ.get("LORAFLEET_ADMIN_TOKEN", "")
    return tok or None


def log_level() -> str:
    """LORAFLEET_LOG_LEVEL: DEBUG, INFO (default), WARNING, ERROR."""
    return _str("LORAFLEET_LOG_LEVEL", "INFO").upper()


def kernel_build_dir() -> Path:
    """LORAFLEET_KERNEL_DIR: where the SGMV extension is built (JIT) or found (ahead of time)."""
    return Path(_str("LORAFLEET_KERNEL_DIR", str(cache_dir() / "kernels")))


SGMV_BACKENDS = ("auto", "cuda", "torch")


def sgmv_backend() -> str:
    """LORAFLEET_SGMV: auto (CUDA kernel on CUDA, torch elsewhere), cuda or torch."""
    return _choice("LORAFLEET_SGMV", SGMV_BACKENDS)


ATTENTION_BACKENDS = ("auto", "flashinfer", "torch")


def attention_backend() -> str:
    """LORAFLEET_ATTENTION: auto (flashinfer on CUDA when installed, torch elsewhere), flashinfer or torch."""
    return _choice("LORAFLEET_ATTENTION", ATTENTION_BACKENDS)


DECODE_TC_CHOICES = ("auto", "1", "0")


def decode_tensor_cores() -> str:
    """LORAFLEET_DECODE_TC: flashinfer's decode attention on tensor cores (its prefill kernel) or CUDA cores.
    auto: tensor cores where at least 4 query heads share a K/V head; 1 / 0: always / never."""
    return _choice("LORAFLEET_DECODE_TC", DECODE_TC_CHOICES)


DECODE_KERNEL_CHOICES = ("auto", "flashinfer", "lorafleet")


def decode_kernel() -> str:
    """LORAFLEET_DECODE_KERNEL: the decode rows' attention kernel on CUDA. auto (default): the project's own where
    the K/V pages are e4m3 and each K/V head serves one query head (measured faster there, docs/benchmarks.md 10.19),
    flashinfer's batch decode elsewhere; flashinfer: always flashinfer's; lorafleet: the project's own
    (csrc/decode_attn.cu) wherever it applies (head sizes 64, 128 and 256, at most 8 query heads per K/V head)."""
    return _choice("LORAFLEET_DECODE_KERNEL", DECODE_KERNEL_CHOICES)


DECODE_STAGES = (0, 3, 5)


def decode_stages() -> int:
    """LORAFLEET_DECODE_STAGES: the project's decode attention kernel copies each lane's next K/V rows this many passes
    minus one ahead through shared memory (cp.async), where each K/V head serves one query head: 3 (default) or 5; 0:
    one pass ahead into registers. The same bits either way (a speed choice: 3 measured fastest on an H200,
    docs/benchmarks.md 10.25)."""
    stages = _int("LORAFLEET_DECODE_STAGES", 3)
    if stages not in DECODE_STAGES:
        raise EnvError(f"LORAFLEET_DECODE_STAGES must be one of {', '.join(map(str, DECODE_STAGES))}, got {stages}")
    return stages


def decode_chunk() -> int:
    """LORAFLEET_DECODE_CHUNK: the project's decode attention kernel cuts a request's keys into chunks of this many
    tokens (a multiple of 16 from 16 to 4,096; default 256; a request with more than 16 chunks takes longer ones). A
    request's bits follow its own length and this number alone, so any value keeps a request's tokens independent of
    its step; shorter chunks let more CTAs share a request (LORAFLEET_DECODE_CTAS_PER_SM)."""
    chunk = _int("LORAFLEET_DECODE_CHUNK", 256)
    if not 16 <= chunk <= 4096 or chunk % 16:
        raise EnvError(f"LORAFLEET_DECODE_CHUNK must be a multiple of 16 from 16 to 4096, got {chunk}")
    return chunk


def decode_int_convert() -> bool:
    """LORAFLEET_DECODE_INT_CVT: with e4m3 pages, 3 stages and one query head per K/V head, the project's decode
    kernel turns each K/V byte into fp32 by integer ops and one exact multiply instead of the cvt instructions (the same
    values, so the same bits; default 0 until measured)."""
    return _flag("LORAFLEET_DECODE_INT_CVT", False)


def decode_mma() -> bool:
    """LORAFLEET_DECODE_MMA: with e4m3 pages, the project's decode kernel computes q . k and p v on the tensor cores
    (mma.sync, f16 operands, fp32 sums, q and the probabilities rounded to f16), for any group of query heads per K/V
    head, 3 stages; otherwise the CUDA-core kernel (fp32 throughout). Default 0: measured slower than the CUDA-core
    kernel with one query head per K/V head and than flashinfer's tensor-core decode with grouped heads
    (docs/benchmarks.md 10.26)."""
    return _flag("LORAFLEET_DECODE_MMA", False)


def decode_ctas_per_sm() -> int:
    """LORAFLEET_DECODE_CTAS_PER_SM: the project's decode attention kernel gives each (request, K/V head) as many
    CTAs (workers, each taking every n-th chunk) as bring a launch nearest to this many CTAs per SM, at most one per
    chunk (1 to 64; default 4: measured fastest with 256-token chunks on an H100, docs/benchmarks.md 10.18). A launch
    shape only: it changes no bit."""
    n = _int("LORAFLEET_DECODE_CTAS_PER_SM", 4)
    if not 1 <= n <= 64:
        raise EnvError(f"LORAFLEET_DECODE_CTAS_PER_SM must be from 1 to 64, got {n}")
    return n


PREFILL_BACKENDS = ("auto", "fa2", "fa3")


def prefill_backend() -> str:
    """LORAFLEET_PREFILL_BACKEND: flashinfer's kernel for prompt rows on CUDA. auto: on sm90 FA2 or FA3
    per step (runner/attention/meta.py `prefill_kernel`: FA3's plan runs one CTA per (128-row query tile,
    head) and never splits the K/V, so a short prompt chunk over a long prefix uses few SMs, while FA2's
    plan splits the K/V; FA3 is faster once its CTAs fill the card), elsewhere flashinfer's own choice;
    fa2 or fa3 forces one kernel."""
    return _choice("LORAFLEET_PREFILL_BACKEND", PREFILL_BACKENDS)


SGMV_FUSED_CHOICES = ("auto", "1", "0")


def sgmv_fused() -> str:
    """LORAFLEET_SGMV_FUSED: how eager and piecewise steps (those with prompt rows, and decode steps
    outside the CUDA graphs) launch a LoRA group whose segments all stay below the tensor-core
    thresholds: auto (the measured default, runner/lora/step.py MIXED_FUSED), 1 (shrink and expand in one
    fused launch) or 0 (two launches).
    Decode CUDA graphs always take two launches. Results are bitwise the same either way."""
    return _choice("LORAFLEET_SGMV_FUSED", SGMV_FUSED_CHOICES)


def port_hint() -> str:
    """LORAFLEET_PORT_HINT: how the user of a busy port picks another, `<port>` standing for the number
    (e.g. `make run PORT=<port>`, set by the Makefile); default `--port <port>`."""
    return _str("LORAFLEET_PORT_HINT", "--port <port>")


def runner_id() -> str | None:
    """LORAFLEET_RUNNER_ID: a stable runner id (defaults to the pod or host name plus port)."""
    return os.environ.get("LORAFLEET_RUNNER_ID") or None


def request_timeout_s() -> int:
    """LORAFLEET_RUNNER_TIMEOUT: seconds without a byte from a runner before it counts as failed."""
    return _int("LORAFLEET_RUNNER_TIMEOUT", 60)


def pvc_root() -> Path:
    """LORAFLEET_PVC_ROOT: where runner pods mount the PVCs that `pvc://claim/path` sources name."""
    return Path(_str("LORAFLEET_PVC_ROOT", "/mnt/lorafleet/pvc"))


def fused_ops() -> bool:
    """LORAFLEET_FUSED_OPS: use flashinfer's fused norm / activation / RoPE kernels on CUDA (default 1)."""
    return _flag("LORAFLEET_FUSED_OPS", True)


def rope_kv_kernel() -> bool:
    """LORAFLEET_ROPE_KV: decode CUDA graphs rotate q/k and write the K/V cache in one launch of the
    project's kernel (csrc/rope_kv.cu) instead of five (default 1; needs the fused ops)."""
    return _flag("LORAFLEET_ROPE_KV", True)


def rope_kv_fp8() -> bool:
    """LORAFLEET_ROPE_KV_FP8: with FP8 K/V pages (--kv-cache-dtype fp8) the rope_kv kernel writes the e4m3 pages too
    (one launch, the torch writer's bits) instead of RoPE plus the torch ops of the e4m3 write (default 1; H200,
    7B FP8 weights + FP8 K/V: +9 % output tok/s over the torch writer)."""
    return _flag("LORAFLEET_ROPE_KV_FP8", True)


def norm_shrink() -> bool:
    """LORAFLEET_NORM_SHRINK: on CUDA the RMSNorms before the qkv and gate_up projections run on the project's kernel
    (csrc/sgmv.cu: Hugging Face's roundings; with FP8 weights it also quantizes the rows), and in decode steps with
    adapters that launch also computes the group's LoRA shrink (one launch fewer per group); default 0 until
    measured on a GPU."""
    return _flag("LORAFLEET_NORM_SHRINK", False)


def norm_quant() -> bool:
    """LORAFLEET_NORM_QUANT: with FP8 weights on the FP8 tensor cores (CUDA), the RMSNorms before the qkv and gate_up
    projections run on the project's kernel (csrc/sgmv.cu, Hugging Face's roundings, the row in registers up to 8,192
    wide), which also writes the rows' e4m3 copy and scales for the product: one launch instead of flashinfer's norm
    and the quantization's own (with adapters, the shrink's). Default 1: +1.0 to +1.5 % end to end on an H100 in
    two runs (docs/benchmarks.md 10.21, 10.22); 0: flashinfer's norm and the separate quantization."""
    return _flag("LORAFLEET_NORM_QUANT", True)


def shrink_early() -> bool:
    """LORAFLEET_SHRINK_EARLY: the LoRA shrink launched right after its projection's base product (bf16/fp16
    weights, or FP8 ones without the epilogue; two launches per group) reads x without waiting for that product to
    finish (csrc/sgmv.h LaunchOptions::x_ready): under programmatic dependent launch it can run while the GEMM
    drains. The same bits either way (default 0: no gain end to end on the H200, docs/benchmarks.md section 13.4)."""
    return _flag("LORAFLEET_SHRINK_EARLY", False)


LORA_BRANCH_CHOICES = ("off", "addon", "shrink")


def lora_branch() -> str:
    """LORAFLEET_LORA_BRANCH: in decode CUDA graphs (CUDA LoRA kernels; projections that the FP8 epilogue does not
    finish), what of each projection group's LoRA runs on a second stream beside the base GEMM: off (default: nothing,
    the shrink and the expand follow the GEMM; measured faster, docs/benchmarks.md section 13.7), addon (the shrink
    and an expand that writes the add-on into an fp32 buffer, added to the GEMM's output after both) or shrink (the
    shrink only; the expand follows the GEMM). The same bits in every case (addon adds +0.0 where no adapter writes)."""
    return _choice("LORAFLEET_LORA_BRANCH", LORA_BRANCH_CHOICES)


def decode_ranks() -> tuple[int, int, int, int]:
    """LORAFLEET_DECODE_RANKS: rank rows per work item of the LoRA shrink's one-row segments (decode rows): 1, 2 or 4;
    0 (default): the kernel's own choice (2 in decode steps). One number for every projection group, or four,
    comma-separated, for qkv, o, gate_up and down (e.g. 4,1,2,1: groups with many rank rows in few items, those
    with few in many). A launch shape only: never changes a bit."""
    raw = _str("LORAFLEET_DECODE_RANKS", "0").strip() or "0"
    parts = [p.strip() for p in raw.split(",")]
    try:
        ranks = tuple(int(p) for p in parts)
    except ValueError as exc:
        raise EnvError(f"LORAFLEET_DECODE_RANKS must be 0, 1, 2 or 4, or four of them comma-separated "
                       f"(qkv,o,gate_up,down), got {raw!r}") from exc
    if len(ranks) == 1:
        ranks = ranks * 4
    if len(ranks) != 4 or any(r not in (0, 1, 2, 4) for r in ranks):
        raise EnvError(f"LORAFLEET_DECODE_RANKS must be 0, 1, 2 or 4, or four of them comma-separated "
                       f"(qkv,o,gate_up,down), got {raw!r}")
    return ranks


def shrink_row_items() -> bool:
    """LORAFLEET_SHRINK_ROW_ITEMS: the LoRA shrink cuts the rows of segments shorter than 96 rows (a decode step's
    rows of one adapter) into one-row work items of LORAFLEET_DECODE_RANKS rank rows, as it does one-row segments,
    instead of items of 2 rows x 2 rank rows: more, shorter items where few adapters serve many rows. A launch shape
    only: never changes a bit (default 0 until measured)."""
    return _flag("LORAFLEET_SHRINK_ROW_ITEMS", False)


def rope_kv_lora() -> bool:
    """LORAFLEET_ROPE_KV_LORA: decode CUDA graphs add the qkv rows' LoRA expand inside the rope_kv
    kernel instead of a separate expand launch per layer (same bits; default 0: no gain on the H200,
    docs/perf_notes.md, wave 8)."""
    return _flag("LORAFLEET_ROPE_KV_LORA", False)


def rope_kv_pdl() -> bool:
    """LORAFLEET_ROPE_KV_PDL: the rope_kv kernel (RoPE and the K/V write after qkv) is launched with programmatic
    dependent launch, its blocks waiting for qkv's product or epilogue first (csrc/rope_kv.h RopeKvArgs::pdl), so
    that it is resident while the kernel before it ends where that kernel lets it start early (the wgmma products
    after their last MMA, the epilogue with LORAFLEET_EPILOGUE_EARLY). The same bits (default 1: with the early
    epilogue +1.7 / +0.9 % bf16 and +1.7 / +1.4 % FP8 with 32 distinct adapters / one, LoRA off +1.0 %, on an H100,
    docs/benchmarks.md 13.22)."""
    return _flag("LORAFLEET_ROPE_KV_PDL", True)


def fp8_swap_rows() -> int:
    """LORAFLEET_FP8_SWAP_ROWS: with FP8 weights on CUDA, steps of at most this many rows compute W @ x.T on
    the FP8 tensor cores (the operands swapped, the same products) instead of x @ W.T (default 0: never)."""
    rows = _int("LORAFLEET_FP8_SWAP_ROWS", 0)
    if rows < 0:
        raise EnvError(f"LORAFLEET_FP8_SWAP_ROWS must be >= 0, got {rows}")
    return rows


def fp8_gemm_rows() -> int:
    """LORAFLEET_FP8_GEMM_ROWS: with FP8 weights on CUDA, steps of at most this many rows (up to 64) run their
    FP8 products on the project's kernel (csrc/fp8_gemm.cu, the weight streamed once) instead of cuBLASLt
    (default 0: never)."""
    rows = _int("LORAFLEET_FP8_GEMM_ROWS", 0)
    if not 0 <= rows <= 64:
        raise EnvError(f"LORAFLEET_FP8_GEMM_ROWS must be in [0, 64], got {rows}")
    return rows


def fp8_gemm_bf16() -> bool:
    """LORAFLEET_FP8_GEMM_BF16: the project's FP8 kernel (LORAFLEET_FP8_GEMM_ROWS) multiplies the bf16
    activations as they are with the e4m3 weights (weight-only FP8, no per-token quantization launch) instead of
    e4m3 activations (default 0)."""
    return _flag("LORAFLEET_FP8_GEMM_BF16", False)


def fp8_epilogue() -> bool:
    """LORAFLEET_FP8_EPILOGUE: the unit-scale FP8 product (LORAFLEET_FP8_UNIT_SCALE_ELEMS) is finished by one
    launch of the project's kernel that applies the token and row scales, the bias and the rows' LoRA expand
    (csrc/quant.h fp8_epilogue; bit for bit the separate ops) instead of three torch ops, a bias add and the SGMV
    expand (default 1; 0: the separate launches)."""
    return _flag("LORAFLEET_FP8_EPILOGUE", True)


def epilogue_early() -> bool:
    """LORAFLEET_EPILOGUE_EARLY: the FP8 epilogue's launch (after an FP8 product, or a bf16 one in the two launches
    with adapters) lets the next kernel start at once (griddepcontrol.launch_dependents first; csrc/quant.h
    Fp8EpilogueArgs::early): its blocks are resident, and a wgmma product streams its weight, while the epilogue
    runs; every kernel that follows it waits for it before reading its output (the same bits; default 1: +1.1 /
    +0.5 % bf16 and +1.0 / +0.7 % FP8 with 32 distinct adapters / one on an H100, docs/benchmarks.md 13.22)."""
    return _flag("LORAFLEET_EPILOGUE_EARLY", True)


def fp8_epilogue_act() -> bool:
    """LORAFLEET_FP8_EPILOGUE_ACT: with FP8 weights, that epilogue and flashinfer's ops, the gate_up projection's
    epilogue also applies the activation (SiLU or GELU-tanh) and writes act(gate) * up, bit for bit flashinfer's
    act_and_mul of its output, instead of that kernel's launch (default 1: one launch less per layer, +0.6 to +1.5 %
    end to end on the H200, docs/benchmarks.md section 10.11; 0: flashinfer's launch)."""
    return _flag("LORAFLEET_FP8_EPILOGUE_ACT", True)


def fp8_sm90() -> bool:
    """LORAFLEET_FP8_SM90: with FP8 weights on a compute capability 9.0 GPU, the unit-scale product of steps of at
    most 64 rows runs on the project's wgmma kernel (csrc/fp8_gemm_sm90.cu, CUTLASS's sm90 collectives, the weight
    as the long side of the MMA) instead of cuBLASLt (default 1: +1.3 to +3.7 % end to end on the H200,
    docs/benchmarks.md section 10.12; needs a build that found CUTLASS's headers, else cuBLASLt; 0: cuBLASLt)."""
    return _flag("LORAFLEET_FP8_SM90", True)


def bf16_sm90() -> bool:
    """LORAFLEET_BF16_SM90: with bf16 weights on a compute capability 9.0 GPU, the products of steps of at most 64
    rows run on the project's wgmma kernel with bf16 operands instead of cuBLAS, with the bias and the rows' LoRA
    expand inside its epilogue (default 1: +0.9 to +1.2 % end to end in every mix on the H100, the decode step's
    exposed LoRA 1.76 -> 1.62 ms with 32 distinct adapters and 1.23 -> 1.02 ms with one, docs/benchmarks.md section
    13.11; needs a build that found CUTLASS's headers, else cuBLAS; 0: cuBLAS's products and the expand's launch)."""
    return _flag("LORAFLEET_BF16_SM90", True)


def sm90_shrink() -> bool:
    """LORAFLEET_SM90_SHRINK: with LORAFLEET_BF16_SM90, the rows' LoRA shrink runs inside the wgmma product's launch
    too (its consumer warps write the rows' v before their main loop, the epilogues wait for all of it) instead of a
    shrink launched before each product, where K is at most 8,192 (a longer K keeps the launch) (default 1: +5.8 % end
    to end with 32 distinct adapters, +6.0 % with one, no change without adapters, on the H100, docs/benchmarks.md
    section 13.12; 0: the shrink's own launch)."""
    return _flag("LORAFLEET_SM90_SHRINK", True)


def sm90_shrink_producer() -> bool:
    """LORAFLEET_SM90_SHRINK_PRODUCER: where the rows' LoRA shrink runs inside the bf16 wgmma product
    (LORAFLEET_SM90_SHRINK), the producer warp group's three warps that issue no copies take its tickets, beside the
    main loop, instead of the consumer warps before it, in products of any K (7B's down too) (default 0: measured
    -2.0 / -0.2 % end to end with adapters on the H100, docs/benchmarks.md section 13.17; 1: those warps; the same
    bits either way). FP8 products: LORAFLEET_FP8_SM90_SHRINK_PRODUCER."""
    return _flag("LORAFLEET_SM90_SHRINK_PRODUCER", False)


def sm90_shrink_first() -> bool:
    """LORAFLEET_SM90_SHRINK_FIRST: with LORAFLEET_SM90_SHRINK, a bf16 wgmma product with adapters runs as two launches,
    the way an FP8 one does: the product into fp32 with the rows' LoRA shrink on the producer warp group's idle warps
    beside its main loop (any K: 7B's down too), then the FP8 epilogue's launch with unit scales, which adds the bias
    and the expand, instead of one launch whose epilogues first wait for every CTA's share of v; with
    LORAFLEET_FP8_EPILOGUE_ACT (on) gate_up's epilogue also applies the activation in place of flashinfer's
    act_and_mul (default 1: +1.3 / +3.3 % end to end with 32 distinct adapters / one, LoRA off unchanged, on the H100,
    docs/benchmarks.md section 13.20; 0: the one launch; the same bits)."""
    return _flag("LORAFLEET_SM90_SHRINK_FIRST", True)


def fp8_sm90_shrink_producer() -> bool:
    """LORAFLEET_FP8_SM90_SHRINK_PRODUCER: with LORAFLEET_FP8_SM90_SHRINK, the shrink first runs on the producer warp
    group's three warps that issue no copies, beside the main loop, instead of the consumer warps before it, and o and
    down take it too (their rows then quantized by the activation kernel's launch) (default 1: +1.2 / +1.1 % end to
    end with 32 distinct adapters / one against the shrink's launches, in each of two calls on H100s,
    docs/benchmarks.md sections 13.17 and 13.18; 0: the consumer warps, qkv and gate_up only; the same bits)."""
    return _flag("LORAFLEET_FP8_SM90_SHRINK_PRODUCER", True)


def norm_early() -> bool:
    """LORAFLEET_NORM_EARLY: with the bf16 products on the wgmma kernel (LORAFLEET_BF16_SM90), the norms before qkv and
    gate_up run on the project's kernel, which lets the product after it start at once (the product streams its
    weight's first k-tiles while the norm runs, and waits for it before it reads the rows) instead of flashinfer's,
    which lets it start only at its end (default 1: +1.5-1.7 % end to end with adapters on the H100, docs/benchmarks.md
    sections 13.13 and 13.14; 0: flashinfer's norm)."""
    return _flag("LORAFLEET_NORM_EARLY", True)


def fp8_sm90_fused() -> bool:
    """LORAFLEET_FP8_SM90_FUSED: where that wgmma kernel's product (in one part, bf16 output) is finished by the FP8
    epilogue without an activation or a LoRA expand (qkv, o, down of steps without adapters), the epilogue runs inside
    the product's kernel (csrc/fp8_gemm_sm90.cu fp8_gemm_sm90_fused: the same bits, no fp32 round trip, one launch less
    per projection; default 1: LoRA off +2.8 % end to end on the H200, docs/benchmarks.md section 10.15; 0: two
    launches)."""
    return _flag("LORAFLEET_FP8_SM90_FUSED", True)


def fp8_sm90_shrink() -> bool:
    """LORAFLEET_FP8_SM90_SHRINK: with FP8 weights on that wgmma kernel, the rows' LoRA shrink runs on the product's
    own warps instead of a shrink launched before each product (each step's first group keeps its launch); the FP8
    epilogue's launch after the product adds the expand as before. Which warps: LORAFLEET_FP8_SM90_SHRINK_PRODUCER
    (default 1, with the producer's warps beside the main loop: +1.2 / +1.1 % end to end with adapters on the H100,
    docs/benchmarks.md section 13.18; on the consumer warps alone it measured even, section 13.16; 0: the shrink's
    launches)."""
    return _flag("LORAFLEET_FP8_SM90_SHRINK", True)


def fp8_sm90_split() -> bool:
    """LORAFLEET_FP8_SM90_SPLIT: that wgmma kernel cuts K into parts where the weight's 64-row tiles alone fill less
    than half the GPU's SMs (7B o and down on an H200: two parts; runner/model/fp8.py sm90_splits), the FP8
    epilogue adding the partial sums in part order (default 0)."""
    return _flag("LORAFLEET_FP8_SM90_SPLIT", False)


def fp8_sm90_persistent() -> bool:
    """LORAFLEET_FP8_SM90_PERSISTENT: that wgmma kernel, with its epilogue a launch of its own or inside it
    (LORAFLEET_FP8_SM90_FUSED), runs CUTLASS's persistent ping-pong schedule: one CTA per SM walks the
    tiles, a tile's epilogue beside the next tile's loads (the same bits; default 0: one CTA per tile)."""
    return _flag("LORAFLEET_FP8_SM90_PERSISTENT", False)


def fp8_quant_in_shrink() -> bool:
    """LORAFLEET_FP8_QUANT_IN_SHRINK: with the FP8 epilogue and adapters in the step, the LoRA shrink's launch also
    quantizes the projection's activations (the same bits; one launch less per projection) instead of the
    activation kernel's own launch (default 1; 0: a launch of its own)."""
    return _flag("LORAFLEET_FP8_QUANT_IN_SHRINK", True)


UNIT_SCALE_ELEMS_DEFAULT = 1
DENSE_LORA_ROWS_DEFAULT = 256


def dense_lora_rows() -> int:
    """LORAFLEET_DENSE_LORA_ROWS: a step with prompt rows whose adapted rows form at most 4 segments, each of at
    least this many rows, and whose work is at least that of 1,024 rows through a Llama-2-7B layer (token rows x
    one layer's projection weight elements on the rank) runs eagerly with its LoRA as matrix products per
    segment: the add-on is written into the projection's output first and the base GEMM accumulates onto it (one
    write of the output instead of the LoRA kernels' read-modify-write; prefill of 2,048-token prompts 0.83 ->
    0.92 of LoRA off on the H200, docs/benchmarks.md section 13.1). Default 256; 0: never (every step on the
    LoRA kernels)."""
    rows = _int("LORAFLEET_DENSE_LORA_ROWS", DENSE_LORA_ROWS_DEFAULT)
    if rows < 0:
        raise EnvError(f"LORAFLEET_DENSE_LORA_ROWS must be >= 0, got {rows}")
    return rows


DENSE_LORA_KEXT_DEFAULT = 64


def dense_lora_kext() -> int:
    """LORAFLEET_DENSE_LORA_KEXT: spare columns per LoRA projection in the plain qkv and gate_up weights of an engine
    with adapters whose steps can take LoRA's dense path (LORAFLEET_DENSE_LORA_ROWS): that path then computes those
    projections as one GEMM over K-extended operands, [x | v] @ [W | B]^T, the step's v = x A^T in spare columns
    beside x (the previous projection's output, normalized in place) and its B^T in the weight's, so the output is
    written once (the rank blocks of a step's segments must fit: 64 columns hold four rank-16 adapters or one of
    rank 64; otherwise the add-on is written first, as without it). Costs the spare columns' memory (Llama-2-7B:
    331 MB, 2.5 % of the weights). A multiple of 8, so rows stay 16-byte aligned. Default 64; 0: off."""
    cols = _int("LORAFLEET_DENSE_LORA_KEXT", DENSE_LORA_KEXT_DEFAULT)
    if cols < 0 or cols % 8:
        raise EnvError(f"LORAFLEET_DENSE_LORA_KEXT must be a multiple of 8 (16-byte rows) and >= 0, got {cols}")
    return cols


def fp8_unit_scale_elems() -> int:
    """LORAFLEET_FP8_UNIT_SCALE_ELEMS: with FP8 weights on CUDA, steps of at most 64 rows whose weight has at
    least this many elements run the FP8 product with unit scales and fp32 output, the per-token and per-row
    scales applied after it (the same products: cuBLASLt picks a kernel that streams the weight faster for
    this call; timed in CUDA graphs, as decode steps run, it is the fastest FP8 call on every Llama-2-7B and
    -70B projection at 32 rows, docs/benchmarks.md section 10.7). The count is per rank's shard. Default 1:
    every weight; 0: never (the per-row call)."""
    elems = _int("LORAFLEET_FP8_UNIT_SCALE_ELEMS", UNIT_SCALE_ELEMS_DEFAULT)
    if elems < 0:
        raise EnvError(f"LORAFLEET_FP8_UNIT_SCALE_ELEMS must be >= 0, got {elems}")
    return elems


def blas_lt_rows() -> int:
    """LORAFLEET_BLAS_LT_ROWS: on CUDA without tensor parallelism, the o and down projections of steps
    with at most this many rows call cuBLASLt instead of cuBLAS (default 64; 0: never). cuBLAS picks
    slower kernels for these two shapes at decode batch sizes (docs/perf_notes.md, wave 9). Read when the
    model is built: a model built earlier and shared keeps the value it saw."""
    rows = _int("LORAFLEET_BLAS_LT_ROWS", 64)
    if rows < 0:
        raise EnvError(f"LORAFLEET_BLAS_LT_ROWS must be >= 0, got {rows}")
    return rows


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(name: str, default: bool = False) -> bool:
    """A switch: unset or empty gives `default`; 1/true/yes/on and 0/false/no/off (any case); anything else is an
    error naming the variable, never a silent default."""
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise EnvError(f"{name} must be 1 or 0 (also true/false, yes/no, on/off), got {os.environ[name]!r}")


def allow_private_sources() -> bool:
    """LORAFLEET_ALLOW_PRIVATE_SOURCES=1: sources may be on loopback, private or link-local
    addresses (default: refused; cloud metadata addresses are refused always)."""
    return _flag("LORAFLEET_ALLOW_PRIVATE_SOURCES")


def source_roots() -> tuple[Path, ...]:
    """LORAFLEET_SOURCE_ROOTS: os.pathsep-separated directories under which local sources
    (paths, file://, pvc://) must resolve; empty: the cache dir and the PVC root."""
    raw = os.environ.get("LORAFLEET_SOURCE_ROOTS", "")
    return tuple(Path(p) for p in raw.split(os.pathsep) if p.strip())


def api_keys_file() -> Path | None:
    """LORAFLEET_API_KEYS_FILE: the scheduler's API key file (same as `--api-keys`); unset: no keys."""
    raw = os.environ.get("LORAFLEET_API_KEYS_FILE", "")
    return Path(raw) if raw else None


def service_account_dir() -> Path:
    """LORAFLEET_SERVICEACCOUNT_DIR: where a pod's ServiceAccount token and ca.crt are
    (default /var/run/secrets/kubernetes.io/serviceaccount). Used with KUBERNETES_SERVICE_HOST;
    for running the in-cluster path outside a pod (the tests' process kubelet sets it)."""
    return Path(_str("LORAFLEET_SERVICEACCOUNT_DIR", "/var/run/secrets/kubernetes.io/serviceaccount"))


def hosts_file() -> Path | None:
    """LORAFLEET_HOSTS_FILE: an /etc/hosts-style file of extra name -> address entries that the
    operator's HTTP client consults before DNS (how the tests' kube-proxy publishes Service names;
    also usable where cluster DNS is not visible to the operator). Unset: DNS only."""
    raw = os.environ.get("LORAFLEET_HOSTS_FILE", "")
    return Path(raw) if raw else None


def runner_token() -> str | None:
    """LORAFLEET_RUNNER_TOKEN: the scheduler↔runner credential. Set on a runner, every route but
    GET /healthz, /readyz and /metrics needs `Authorization: Bearer <token>`; set on a scheduler, it
    sends that header to its runners. Unset or empty: no check (a laptop, or tests)."""
    tok = os.environ.get("LORAFLEET_RUNNER_TOKEN", "")
    return tok or None


def engine_fault() -> str | None:
    """LORAFLEET_ENGINE_FAULT: `step:N` makes the engine core raise in its N-th step. Only for testing
    how a runner handles an engine crash; never set it in production."""
    return os.environ.get("LORAFLEET_ENGINE_FAULT") or None


def engine_stall_seconds() -> float:
    """LORAFLEET_ENGINE_STALL_S: a runner's front kills its engine core when it has heard nothing from it (not even
    the core's heartbeat, sent every second by a thread of its own, also during a long step) for this many seconds:
    a stopped or frozen process, which the front then reports and replaces as it does a dead one. Default 30; 0:
    never."""
    raw = _str("LORAFLEET_ENGINE_STALL_S", "30").strip() or "30"
    try:
        value = float(raw)
    except ValueError:
        raise EnvError(f"LORAFLEET_ENGINE_STALL_S must be a number of seconds, got {raw!r}") from None
    if not (value == 0 or 2 <= value <= 86400):  # (nan fails both)
        raise EnvError(f"LORAFLEET_ENGINE_STALL_S must be 0 (never) or 2 to 86400 seconds, got {raw!r}")
    return value


def pin_host_adapters() -> bool:
    """LORAFLEET_PIN_HOST_ADAPTERS: keep adapters read from disk in pinned host memory (default 0).
    0: pageable memory, the driver staging each slot copy, so that no page-locking allocation (a
    driver call per adapter, ~80 MB for a Llama-2-7B rank-16 adapter) runs while the engine launches
    steps. On the H200, serving 600 distinct adapters, pageable gave 2,554 output tok/s against 2,203
    pinned (same code, same session; docs/benchmarks.md §7.0a)."""
    return _flag("LORAFLEET_PIN_HOST_ADAPTERS", False)

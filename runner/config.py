"""Typed, frozen configuration of the engine and its kernel choices (the model's is lorafleet.models.contract)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lorafleet.env import DECODE_STAGES, LORA_BRANCH_CHOICES
from lorafleet.models.contract import ModelConfig, ModelConfigError  # noqa: F401 (re-exported)


@dataclass(frozen=True)
class KernelChoices:
    """Which kernels an engine uses, resolved once at engine start (`from_env`), validated, logged once, and
    carried by its EngineConfig; nothing below the engine reads the environment.

    attention: auto (flashinfer on CUDA when installed, torch elsewhere), flashinfer or torch.
    prefill: flashinfer's kernel for prompt rows on sm90: auto (FA2 or FA3 per step), fa2 or fa3.
    decode_tc: flashinfer's decode attention on tensor cores: auto (where >= 4 query heads share a K/V
        head), 1 (always) or 0 (never).
    decode_kernel: the decode rows' attention kernel on CUDA: flashinfer's, or the project's own (csrc/decode_attn.cu,
        lorafleet: the K/V pages read once at their byte cost, bf16 / fp16 or e4m3; head sizes 64, 128 and 256 with at
        most 8 query heads per K/V head, flashinfer's elsewhere); auto: the project's own for e4m3 pages where each
        K/V head serves one query head (decode_kernel.preferred), flashinfer's elsewhere.
    decode_stages: the project's decode kernel copies each lane's next K/V rows this many passes minus one ahead
        through shared memory (3, the default, or 5; one query head per K/V head) instead of one pass ahead into
        registers (0); the same bits.
    decode_chunk: that kernel's chunk of a request's keys, in tokens (a multiple of 16; a request's bits follow it).
    decode_ctas_per_sm: that kernel's CTAs per SM its workers per (request, K/V head) aim at (the same bits).
    decode_int_convert: that kernel, with e4m3 pages and 3 stages, turns bytes into fp32 by integer ops (the same bits).
    decode_mma: that kernel, with e4m3 pages, on the tensor cores (f16 operands, fp32 sums; any group, 3 stages).
    decode_no_split: flashinfer's decode attention (on tensor cores: decode_tc 1) plans every request's K/V as one
        chunk instead of splitting long ones by a plan of the whole batch, so a request's attention does not depend on
        the others in its step (set by batch-invariant engines that keep flashinfer's decode; not read from the
        environment).
    sgmv: auto (the CUDA kernels on CUDA, torch elsewhere), cuda or torch.
    sgmv_fused: steps with prompt rows launch a LoRA group below the tensor-core thresholds as one fused
        launch (auto: the measured default; 1) or two (0); the bits are the same.
    mma_rows: per projection group (qkv, o, gate_up, down) the (shrink, expand) segment rows from which
        the LoRA kernels take tensor cores.
    fused_ops: flashinfer's fused norm / activation / RoPE kernels on CUDA.
    rope_kv: RoPE and the K/V cache write in one launch of the project's kernel (CUDA, full rotary).
    rope_kv_lora: decode graphs add the qkv rows' LoRA expand inside that kernel.
    rope_kv_fp8: that kernel also writes FP8 (e4m3) K/V pages (otherwise those take the torch writer).
    rope_kv_pdl: that kernel is launched with programmatic dependent launch, waiting for qkv's kernel first, so that
        it starts as soon as that kernel lets it (the same bits; on: with epilogue_early +1.7 % with 32 distinct
        adapters in bf16 and FP8, +1.0 % LoRA off, on the H100, docs/benchmarks.md 13.22).
    norm_shrink: the RMSNorms before qkv and gate_up on the project's kernel (CUDA; with FP8 weights it quantizes
        the rows too), which in decode steps with adapters also computes the group's LoRA shrink.
    norm_quant: with FP8 weights on the FP8 tensor cores (CUDA), the RMSNorms before qkv and gate_up on the
        project's kernel, which also writes the rows' e4m3 copy and scales for the product: one launch for the
        norm and the activations' quantization (with adapters the shrink then does not quantize them).
    decode_ranks: per projection group (qkv, o, gate_up, down) the rank rows per work item of the LoRA shrink's
        one-row segments (1, 2 or 4; 0: the kernel's choice), in the shrinks of decode steps (CUDA; a launch shape,
        the same bits); one number stands for all four groups.
    shrink_row_items: the rows of short segments (under 96 rows: a decode step's rows of one adapter) also run as
        such one-row items instead of items of 2 rows x 2 rank rows (CUDA; a launch shape, the same bits).
    shrink_early: the LoRA shrink launched right after its projection's base GEMM does not wait for that GEMM
        before reading x (CUDA, two launches per group; the same bits).
    lora_branch: in decode graphs (CUDA LoRA kernels; projections not finished by the FP8 epilogue; not with
        rope_kv_lora), what of each group's LoRA runs on a second stream beside the base GEMM: off, addon (the shrink
        and an expand writing the add-on into an fp32 buffer, added after both) or shrink (the shrink only; the expand
        after the GEMM). The same bits in every case, but for addon's +0.0 added where no adapter writes (-0.0 -> +0.0).
    blas_lt_rows: steps of at most this many rows run the o and down GEMMs on cuBLASLt (CUDA, one GPU).
    fp8_swap_rows: with FP8 weights, steps of at most this many rows compute W @ x.T (operands swapped).
    fp8_gemm_rows: with FP8 weights, steps of at most this many rows (<= 64) run the project's FP8 kernel.
    fp8_gemm_bf16: that kernel takes the bf16 activations as they are (weight-only FP8: no per-token
        quantization launch; the products of the bf16 rows and the e4m3 weights) instead of e4m3 ones.
    fp8_unit_scale_elems: with FP8 weights, steps of at most 64 rows whose weight has at least this many
        elements (per rank's shard) multiply with unit scales into fp32 and apply the token and row scales
        after; checked before fp8_swap_rows (0: never; the default, 1, takes every weight: the fastest FP8
        call in CUDA graphs on every 7B and 70B projection, docs/benchmarks.md section 10.7).
    fp8_epilogue: that product is finished by one launch of the project's epilogue kernel (token and row
        scales, bias, the rows' LoRA expand; bit for bit the separate launches it replaces).
    fp8_epilogue_act: with that epilogue and flashinfer's ops, the gate_up epilogue also applies the activation and
        writes act(gate) * up (flashinfer's act_and_mul bits) instead of a launch of its own.
    fp8_sm90: with FP8 weights on a compute capability 9.0 GPU, that unit-scale product runs on the project's wgmma
        kernel (csrc/fp8_gemm_sm90.cu; tokens as the MMA's narrow side) instead of cuBLASLt, where the build has it.
    fp8_sm90_fused: where that kernel's product (in one part) is finished by the epilogue without an activation or a
        LoRA expand (qkv, o, down of steps without adapters; bf16), the epilogue runs inside the product's kernel (the
        same bits, one launch less).
    fp8_sm90_shrink: with that kernel and adapters in the step, the rows' LoRA shrink runs on the product's own warps
        instead of a launch before it (each step's first group keeps its launch); the epilogue's launch adds the
        expand. With fp8_sm90_shrink_producer (below, on) every projection takes it; on the consumer warps before
        their main loop only the products whose rows the norm quantizes (qkv, gate_up; K at most SM90_SHRINK_MAX_K),
        which measured even (on, with the producer's warps).
    fp8_sm90_split: that kernel cuts K into parts for weights with too few rows to fill the GPU (fp8.py sm90_splits).
    fp8_sm90_persistent: that kernel (its epilogue a launch of its own or inside it) on CUTLASS's persistent
        ping-pong schedule instead of one CTA per tile (the same bits).
    fp8_quant_in_shrink: with that epilogue and adapters in the step, the LoRA shrink's launch quantizes the
        projection's activations too (the same bits) instead of a launch of their own.
    bf16_sm90: with bf16 weights on a compute capability 9.0 GPU, the products of steps of at most 64 rows run on
        that wgmma kernel with bf16 operands instead of cuBLAS, the bias and the rows' LoRA expand inside its epilogue
        (after the group's shrink), one launch where cuBLAS's product and the expand took two (on: +1 % in every
        mix on the H100, docs/benchmarks.md section 13.11).
    sm90_shrink: with bf16_sm90, the rows' LoRA shrink inside that same launch too (the kernel's own warps write v
        before its epilogues read it) instead of a launch before it, where K is at most SM90_SHRINK_MAX_K (on:
        +5.8 / +6.0 % with adapters on the H100, docs/benchmarks.md section 13.12).
    sm90_shrink_producer: where the shrink runs inside the bf16 wgmma product (sm90_shrink), the producer warp group's
        three warps that issue no copies take it, beside the main loop, instead of the consumer warps before it, in
        products of any K (the same bits; off: -2.0 / -0.2 % with adapters on the H100, docs/benchmarks.md 13.17).
    sm90_shrink_first: with sm90_shrink, a bf16 product with adapters in two launches as an FP8 one takes them: the
        wgmma product into fp32 with the shrink on the producer's warps beside its main loop (any K), then the FP8
        epilogue's launch with unit scales adding the bias and the expand, instead of one launch whose epilogues wait
        for every CTA's share of v; with fp8_epilogue_act and flashinfer's ops, gate_up's epilogue also applies the
        activation in place of act_and_mul (the same bits; on: +1.3 / +3.3 % with 32 distinct adapters / one on the
        H100, LoRA off unchanged, docs/benchmarks.md 13.20).
    fp8_sm90_shrink_producer: the same for FP8 products with fp8_sm90_shrink, where o and down then take the shrink
        too (their rows quantized by the activation kernel's launch) (the same bits; on: +1.2 / +1.1 % with adapters
        on the H100 in two calls, docs/benchmarks.md 13.18).
    norm_early: with bf16_sm90, the norms before qkv and gate_up on the project's kernel, which lets the product after
        it start at once and stream its weight beside the norm (on: +1.5 / +1.6 % with adapters on the H100,
        docs/benchmarks.md sections 13.13, 13.14).
    epilogue_early: the FP8 epilogue's launch (fp8_epilogue; bf16_sm90 products with adapters take it too) lets the
        next kernel start at once, so that a wgmma product after it streams its weight meanwhile (the same bits; on:
        +1.1 / +1.0 % with 32 distinct adapters in bf16 / FP8 on the H100, docs/benchmarks.md 13.22).
    pin_host_adapters: adapters read from disk are kept in pinned host memory.
    dense_lora_rows: a step with prompt rows whose adapted rows form at most DENSE_LORA_MAX_SEGMENTS segments
        (runner/lora/step.py), each of at least this many rows, and whose work reaches dense_lora_min_work,
        runs eagerly, its LoRA as matrix products per segment written before the base GEMM, which accumulates
        onto them (0: never).
    dense_lora_kext: spare columns per LoRA projection in the plain qkv and gate_up weights of an engine whose steps
        can take that path (with adapters, and enough rows per step to reach its work floor): the path then runs
        those projections as one GEMM over K-extended operands, [x | v] @ [W | B]^T, where the step's rank blocks
        fit (runner/lora/step.py); a multiple of 8; 0: off (the add-on written first, the base GEMM accumulating onto
        it).
    dense_lora_min_work: the work floor of that path: token rows x projection weight elements of one layer on
        this rank (default: 1,024 rows of a Llama-2-7B layer); not read from the environment.
    """

    attention: str = "auto"
    prefill: str = "auto"
    decode_tc: str = "auto"
    decode_kernel: str = "auto"
    decode_stages: int = 3
    decode_chunk: int = 256
    decode_ctas_per_sm: int = 4
    decode_int_convert: bool = False
    decode_mma: bool = False
    decode_no_split: bool = False
    sgmv: str = "auto"
    sgmv_fused: str = "auto"
    mma_rows: tuple[tuple[int, int], ...] = ((129, 129), (512, 512), (129, 129), (512, 512))
    fused_ops: bool = True
    rope_kv: bool = True
    rope_kv_lora: bool = False
    rope_kv_fp8: bool = True
    rope_kv_pdl: bool = True
    norm_shrink: bool = False
    norm_quant: bool = True
    shrink_early: bool = False
    decode_ranks: tuple[int, int, int, int] = (0, 0, 0, 0)
    shrink_row_items: bool = False
    lora_branch: str = "off"
    blas_lt_rows: int = 64
    fp8_swap_rows: int = 0
    fp8_gemm_rows: int = 0
    fp8_gemm_bf16: bool = False
    fp8_unit_scale_elems: int = 1
    fp8_epilogue: bool = True
    fp8_epilogue_act: bool = True
    fp8_sm90: bool = True
    fp8_sm90_fused: bool = True
    fp8_sm90_shrink: bool = True
    fp8_sm90_split: bool = False
    fp8_sm90_persistent: bool = False
    fp8_quant_in_shrink: bool = True
    bf16_sm90: bool = True
    sm90_shrink: bool = True
    sm90_shrink_producer: bool = False
    sm90_shrink_first: bool = True
    fp8_sm90_shrink_producer: bool = True
    norm_early: bool = True
    epilogue_early: bool = True
    pin_host_adapters: bool = False
    dense_lora_rows: int = 256
    dense_lora_kext: int = 64
    dense_lora_min_work: int = 1024 * 202_375_168

    def __post_init__(self):
        for name, ok in (("attention", ("auto", "flashinfer", "torch")), ("prefill", ("auto", "fa2", "fa3")),
                         ("decode_tc", ("auto", "1", "0")), ("decode_kernel", ("auto", "flashinfer", "lorafleet")),
                         ("sgmv", ("auto", "cuda", "torch")), ("sgmv_fused", ("auto", "1", "0")),
                         ("lora_branch", LORA_BRANCH_CHOICES)):
            if getattr(self, name) not in ok:
                raise ValueError(f"kernel choice {name} must be one of {', '.join(ok)}, got {getattr(self, name)!r}")
        for name in ("blas_lt_rows", "fp8_swap_rows", "fp8_unit_scale_elems", "dense_lora_rows", "dense_lora_kext",
                     "dense_lora_min_work"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.decode_stages not in DECODE_STAGES:
            raise ValueError(f"decode_stages must be {', '.join(map(str, DECODE_STAGES[:-1]))} or "
                             f"{DECODE_STAGES[-1]}, got {self.decode_stages!r}")
        if not 16 <= self.decode_chunk <= 4096 or self.decode_chunk % 16:
            raise ValueError(f"decode_chunk must be a multiple of 16 from 16 to 4096, got {self.decode_chunk!r}")
        if not 1 <= self.decode_ctas_per_sm <= 64:
            raise ValueError(f"decode_ctas_per_sm must be from 1 to 64, got {self.decode_ctas_per_sm!r}")
        if self.dense_lora_kext % 8:
            raise ValueError(f"dense_lora_kext must be a multiple of 8 (16-byte rows), got {self.dense_lora_kext}")
        if self.decode_no_split and self.decode_tc != "1":
            raise ValueError("decode_no_split takes flashinfer's tensor-core decode (decode_tc 1): its other decode "
                             "kernel plans its splits by itself")
        ranks = self.decode_ranks
        if isinstance(ranks, int):  # one number: every group's
            ranks = (ranks,) * 4
        ranks = tuple(ranks) if isinstance(ranks, (tuple, list)) else ()
        if len(ranks) != 4 or any(type(r) is not int or r not in (0, 1, 2, 4) for r in ranks):
            raise ValueError(f"decode_ranks must be 0, 1, 2 or 4 (one number, or one per group: qkv, o, gate_up, "
                             f"down), got {self.decode_ranks!r}")
        object.__setattr__(self, "decode_ranks", ranks)  # (frozen: the normalized form, set once here)
        if not 0 <= self.fp8_gemm_rows <= 64:
            raise ValueError(f"fp8_gemm_rows must be in [0, 64], got {self.fp8_gemm_rows}")
        if len(self.mma_rows) != 4 or any(len(r) != 2 or min(r) < 1 for r in self.mma_rows):
            raise ValueError("mma_rows needs (shrink, expand) row counts >= 1 for each of the four projection groups")

    @classmethod
    def from_env(cls) -> "KernelChoices":
        """The LORAFLEET_* kernel variables (lorafleet.env), each validated."""
        from lorafleet import env

        return cls(attention=env.attention_backend(), prefill=env.prefill_backend(),
                   decode_tc=env.decode_tensor_cores(), decode_kernel=env.decode_kernel(),
                   decode_stages=env.decode_stages(), decode_chunk=env.decode_chunk(),
                   decode_ctas_per_sm=env.decode_ctas_per_sm(), decode_int_convert=env.decode_int_convert(),
                   decode_mma=env.decode_mma(),
                   sgmv=env.sgmv_backend(),
                   sgmv_fused=env.sgmv_fused(), fused_ops=env.fused_ops(), rope_kv=env.rope_kv_kernel(),
                   rope_kv_lora=env.rope_kv_lora(), rope_kv_fp8=env.rope_kv_fp8(),
                   rope_kv_pdl=env.rope_kv_pdl(),
                   norm_shrink=env.norm_shrink(), norm_quant=env.norm_quant(),
                   shrink_early=env.shrink_early(),
                   decode_ranks=env.decode_ranks(), shrink_row_items=env.shrink_row_items(),
                   lora_branch=env.lora_branch(), blas_lt_rows=env.blas_lt_rows(),
                   fp8_swap_rows=env.fp8_swap_rows(), fp8_gemm_rows=env.fp8_gemm_rows(),
                   fp8_gemm_bf16=env.fp8_gemm_bf16(),
                   fp8_unit_scale_elems=env.fp8_unit_scale_elems(), fp8_epilogue=env.fp8_epilogue(),
                   fp8_epilogue_act=env.fp8_epilogue_act(), fp8_sm90=env.fp8_sm90(),
                   fp8_sm90_fused=env.fp8_sm90_fused(),
                   fp8_sm90_shrink=env.fp8_sm90_shrink(),
                   fp8_sm90_split=env.fp8_sm90_split(), fp8_sm90_persistent=env.fp8_sm90_persistent(),
                   fp8_quant_in_shrink=env.fp8_quant_in_shrink(), bf16_sm90=env.bf16_sm90(),
                   sm90_shrink=env.sm90_shrink(), sm90_shrink_producer=env.sm90_shrink_producer(),
                   sm90_shrink_first=env.sm90_shrink_first(),
                   fp8_sm90_shrink_producer=env.fp8_sm90_shrink_producer(),
                   norm_early=env.norm_early(), epilogue_early=env.epilogue_early(),
                   pin_host_adapters=env.pin_host_adapters(), dense_lora_rows=env.dense_lora_rows(),
                   dense_lora_kext=env.dense_lora_kext())

    def describe(self) -> str:
        defaults = KernelChoices()
        changed = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != getattr(defaults, f.name)]
        return "kernel choices: " + (", ".join(changed) if changed else "defaults")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. `None` fields are derived from the device at start."""

    max_batch_size: int = 32
    page_size: int = 16
    num_pages: int | None = None  # KV pages; None: from kv_fraction (GPU) or kv_cache_gb (CPU)
    kv_fraction: float = 0.85  # GPU: share of free memory (after weights and adapters) for the KV pool
    kv_cache_gb: float = 1.0  # CPU: KV pool size
    max_lora_rank: int = 64
    lora_slots: int | None = None  # adapters resident in the device pool; None: 8 on CPU, 64 on GPU
    host_lora_cache: int = 256  # adapters kept in (pinned) host memory behind the device pool
    adapter_readers: int | None = None  # CUDA: processes reading adapters from disk; None: half the CPUs, 2..8
    max_prefill_tokens: int = 8192  # unchunked: prompt tokens per step (one longer prompt still runs alone)
    # Chunked prefill: at most this many token rows per step, decodes included; long prompts are split
    # across steps. None: 2048 on CUDA, 512 on the CPU (unchunked with chunked_prefill=False).
    max_step_tokens: int | None = None
    # Chunked prefill, steps that carry decodes: at most this many prompt rows ride along (a smaller
    # chunk keeps such a step close to a decode-only one, so a long prompt barely delays the decoding
    # requests; its own first token comes later). None: the step budget alone limits them.
    decode_prefill_tokens: int | None = None
    chunked_prefill: bool | None = None  # None or True: on (see max_step_tokens); False: whole prompts per step
    # Batch-invariant decoding: a decode row's bits do not depend on the other rows of its step. A step that carries
    # both decode and prompt rows runs them as two forward passes (the decode rows alone: a decode-only step, its
    # CUDA graph; a second pass over the weights in each such step), the decode rows' attention takes the project's
    # kernel (decode_kernel "lorafleet": its chunks follow a request's own length), or with decode_kernel
    # "flashinfer" flashinfer's tensor-core decode with each request's K/V unsplit (decode_no_split), and the pages a
    # step fills are cached for later steps only (docs/api.md, "Reproducibility"). Off: one pass, the kernels' own
    # choices.
    batch_invariant: bool = False
    # Overlapped scheduling: build and queue step N+1 while the device runs step N. None: on for CUDA.
    overlap: bool | None = None
    # Admission batching: while requests run, wait until this many batch places are free (or as many
    # as requests wait) before admitting, for at most admit_wait_steps steps, so that prompts are
    # prefilled together in fewer mixed steps. None: max_batch_size // 8 on CUDA, 1 (off) on CPU.
    admit_batch: int | None = None
    admit_wait_steps: int = 8
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    enable_lora: bool = True
    cuda_graphs: bool = True
    piecewise_graphs: bool = True  # CUDA: steps with prefill replay graphs around eager attention
    requeue_evicted: bool = False  # offline: resume evicted requests here; service: report them
    tp: int = 1  # tensor parallelism: GPUs of this node driven as one engine (ranks 1..tp-1 in child processes)
    allow_synthetic: bool = False  # benchmarks: accept synthetic://SEED adapter sources (never from the network)
    prefix_cache: bool = True  # keep full KV pages for later requests with the same prefix, adapter and salt
    # "fp8": the projection weights in FP8 (e4m3, a scale per output row; quantized at load from a bf16/fp16
    # checkpoint); None: as the checkpoint stores them (a pre-quantized FP8 checkpoint runs in FP8)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8: e4m3 K/V pages

    def __post_init__(self):
        for name in ("max_batch_size", "page_size", "num_pages", "max_lora_rank", "lora_slots", "max_model_len", "tp",
                     "max_prefill_tokens", "max_step_tokens", "admit_batch"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v >= 1):  # (0 pages or batch places: a silent hang)
                raise ValueError(f"{name} must be an integer of at least 1, got {v!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 or none, got {self.quantization!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
    kernels: KernelChoices | None = None  # None: from the environment at engine start (KernelChoices.from_env)
    extra: dict = field(default_factory=dict, compare=False)

    def adapter_reader_count(self) -> int:
        """Processes that read adapters from disk (CUDA engines): `adapter_readers`, or half the CPUs
        between 2 and 8 (each read keeps one CPU busy for a fraction of a second)."""
        if self.adapter_readers is not None:
            return max(1, self.adapter_readers)
        import os

        return min(8, max(2, (os.cpu_count() or 4) // 2))

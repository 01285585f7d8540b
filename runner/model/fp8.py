"""FP8 (e4m3) projection weights with one fp32 scale per output row, and their product.

    w ~= q.float() * scale[:, None]        q float8_e4m3fn [N, K], scale fp32 [N] = row absmax / 448

On GPUs with FP8 tensor cores (compute capability 8.9 and up) the product quantizes the activations per
token at run time (dynamic: each row of x by its own absmax / 448) and multiplies on the FP8 tensor cores
(`torch._scaled_mm`, row-wise scales, output in the activations' dtype). Elsewhere (the CPU) it is
weight-only: x times the dequantized weight, so the CPU runs the FP8 path's weight numerics exactly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


@dataclass
class Fp8Weight:
    q: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # fp32 [N]
    scale_row: torch.Tensor | None = None  # fp32 [1, N] (the scaled-mm layout), made on first use

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequant(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def to(self, device) -> "Fp8Weight":
        return Fp8Weight(self.q.to(device), self.scale.to(device))

    def narrow_cols(self, lo: int, hi: int) -> "Fp8Weight":
        """Columns lo:hi (a row-parallel rank's input slice; the rows' scales stay those of whole rows)."""
        return Fp8Weight(self.q[:, lo:hi].contiguous(), self.scale)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Saturating cast (values past the format's range clamp to +-448 instead of becoming NaN)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows(w: torch.Tensor) -> Fp8Weight:
    """Per-output-row scales: scale = the row's absmax / 448 (a zero row keeps a tiny scale), q = w / scale."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / E4M3_MAX).clamp(min=1e-12)
    return Fp8Weight(to_e4m3(wf / scale[:, None]), scale)


def from_checkpoint(q: torch.Tensor, scale: torch.Tensor, strategy: str, block: tuple[int, int] | None) -> Fp8Weight:
    """A pre-quantized weight [N, K] with its checkpoint scales: per channel ([N] or [N, 1]) and per tensor (one
    value) as they are; 128 x 128 blocks ([ceil(N / 128), ceil(K / 128)] multipliers) dequantized and re-rounded
    to per-row scales (exact where a row's blocks share one scale)."""
    scale = scale.float()
    n, k = q.shape
    if strategy == "channel":
        return Fp8Weight(q.to(E4M3), scale.reshape(-1).expand(n).contiguous())
    if strategy == "tensor":
        return Fp8Weight(q.to(E4M3), scale.reshape(-1)[:1].expand(n).contiguous())
    if strategy == "block":
        br, bc = block
        full = scale.repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)[:, :k]
        return quantize_rows(q.float() * full)
    raise ValueError(f"unknown FP8 scale strategy {strategy!r}")


def fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_tokens(x: torch.Tensor, ext=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization: (x_q float8 [M, K], scale fp32 [M, 1]), x_q = e4m3(x * (1 / scale)). `ext`
    (the project's CUDA extension, runner/kernels.py): the same bits in one launch (csrc/quant.cu) for 2-D bf16/fp16
    CUDA rows."""
    if ext is not None and x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (torch.bfloat16,
                                                                                             torch.float16):
        q = torch.empty(x.shape, dtype=E4M3, device=x.device)
        scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
        ext.quantize_e4m3(q, scale.view(-1), x, torch.cuda.current_stream(x.device).cuda_stream)
        return q, scale
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    return to_e4m3(xf * scale.reciprocal()), scale  # a product with the reciprocal, as vLLM's kernels take it


_ONES: dict[int, torch.Tensor] = {}


def unit_scale(device: torch.device) -> torch.Tensor:
    """A unit fp32 scale on CUDA `device`, made once per GPU: the engine makes it before it captures graphs,
    so a graph never holds the only write of it."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ONES:
        _ONES[index] = torch.ones((), dtype=torch.float32, device=torch.device("cuda", index))
    return _ONES[index]


def unit_scale_call(M: int, N: int, K: int, unit_scale_elems: int) -> bool:
    """Whether fp8_linear takes the unit-scale product (fp32 output, scales applied after) for x [M, K], w [N, K]."""
    return 0 < unit_scale_elems <= N * K and 0 < M <= 64


def _own_kernel(x: torch.Tensor, w: Fp8Weight, ext, own_rows: int) -> bool:
    M, K = x.shape
    return (ext is not None and 0 < M <= own_rows and x.dtype == torch.bfloat16 and K % 64 == 0
            and w.q.shape[0] % 16 == 0 and w.q.is_contiguous())


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def sm90_gemm_available(ext, device: torch.device) -> bool:
    """Whether the extension `ext` holds the wgmma FP8 GEMM (csrc/fp8_gemm_sm90.cu, built where CUTLASS's headers were
    found) and `device` can run it (compute capability 9.0: its machine code is sm_90a)."""
    return (ext is not None and hasattr(ext, "fp8_gemm_sm90_built") and bool(ext.fp8_gemm_sm90_built())
            and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0))


SM90_TILE_ROWS = 64  # weight rows per tile of csrc/fp8_gemm_sm90.cu
SM90_MAX_ROWS = 64  # token rows of one call of that kernel (fp8_gemm_sm90.h kFp8Sm90MaxRows)
# The longest K whose LoRA shrink goes inside that kernel's bf16 product (KernelChoices.sm90_shrink): its warps' dot
# products run before their main loop, a round trip to memory per 8 vectors of each lane, so a long K pays more there
# than in the shrink's own launch (7B's down, K = 11,008: 4.4 us more per product on an H100, docs/benchmarks.md 13.12).
# Not with KernelChoices.sm90_shrink_producer (fp8_sm90_shrink_producer), whose warps run beside the main loop, nor
# with sm90_shrink_first (the producer's warps too).
SM90_SHRINK_MAX_K = 8192


def epilogue_lora(lora: tuple | None) -> tuple:
    """The epilogue kernels' LoRA arguments (v, B pools, ranks, row slots, A pools or None) from
    LoraStepImpl.epilogue_operands' tuple, or none: no v, no B pools, no ranks, no row slots, no A pools."""
    return lora if lora is not None else (None, [], None, None, None)


def bf16_sm90_applies(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, spans: list[int]) -> bool:
    """Whether the wgmma kernel takes the bf16 product x @ w.T (+ bias, + the rows' LoRA expand over the output
    `spans`) with its epilogue inside (bf16_sm90_linear): bf16 x [M <= 64, K] contiguous, a bf16 w [N, K] whose rows
    are 16-byte aligned and at least K apart (a weight with spare columns, Decoder.widen_for_lora, qualifies), K a
    multiple of 16, N of 8, one to three spans of multiples of 8 covering N, a bf16 bias or none."""
    bf = torch.bfloat16
    if not (x.dtype == bf and not isinstance(w, Fp8Weight) and w.dtype == bf and x.dim() == 2
            and w.dim() == 2 and x.is_contiguous() and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0):
        return False
    (M, K), N = x.shape, w.shape[0]
    return (1 <= M <= SM90_MAX_ROWS and w.shape[1] == K and K % 16 == 0 and N % 8 == 0 and w.stride(1) == 1
            and w.stride(0) >= K and w.stride(0) % 8 == 0 and sum(spans) == N and 1 <= len(spans) <= 3
            and all(s > 0 and s % 8 == 0 for s in spans)
            and (bias is None or (bias.dtype == bf and _aligned(bias) and bias.numel() == N)))


def bf16_sm90_linear(ext, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, spans: list[int],
                     lora: tuple | None, unit: torch.Tensor, sync: torch.Tensor | None = None,
                     shrink_producer: bool = False) -> torch.Tensor:
    """x @ w.T + bias plus, given `lora` = (v, B pools, ranks, row slots, A pools) from
    LoraStepImpl.epilogue_operands, the rows' LoRA expand over the output `spans`, in one launch of the wgmma kernel on
    bf16 operands (where bf16_sm90_applies): the product in fp32 rounded to bf16, the bias added and rounded, the
    expand's sum added before the last rounding (the FP8 epilogue's arithmetic with unit scales: `unit`, ones, fp32,
    at least max(M, N)). With A pools in `lora` the same launch also writes v (the rows' shrink, before its
    epilogues read it), using `sync` (int32 [3], zero, this call site's own; [4] with `shrink_producer`) between its
    warps: the consumer warps before their main loop, or with `shrink_producer` the producer warp group's three
    warps that issue no copies, beside it (the same bits)."""
    M, N = x.shape[0], w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    v, b, ranks, row_slot, a = epilogue_lora(lora)
    extra = {} if a is None else {"a": list(a), "sync": sync}  # (the kernel's defaults otherwise)
    if a is not None and shrink_producer:
        extra["shrink_producer"] = True
    ext.fp8_gemm_sm90_fused(out, x, w, unit[:M], unit[:N], bias, list(spans), v, list(b), ranks, row_slot, True,
                            torch.cuda.current_stream(x.device).cuda_stream, **extra)
    return out


def shrink_first_args(x: torch.Tensor, spans: list[int], lora: tuple, sync: torch.Tensor,
                      producer: bool) -> dict:
    """fp8_gemm_sm90's arguments for the rows' LoRA shrink first (x's bf16 rows, the spans, `lora` = (v, B pools,
    ranks, row slots, A pools), the call site's counters; `producer`: on the producer warp group's idle warps)."""
    v, b, ranks, row_slot, a = lora
    return dict(lora_x=x, cols=list(spans), v=v, b=list(b), ranks=ranks, row_slot=row_slot, a=list(a), sync=sync,
                **({"shrink_producer": True} if producer else {}))


def bf16_sm90_shrink_first(ext, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, spans: list[int],
                           lora: tuple | None, unit: torch.Tensor, sync: torch.Tensor | None,
                           shrink_producer: bool = True, act: int = 0, early: bool = False) -> torch.Tensor:
    """bf16_sm90_linear's result in two launches, as an FP8 projection with adapters takes them: the wgmma product of
    the bf16 operands into fp32, with A pools in `lora` the rows' shrink first into v on its own warps (the producer
    warp group's three that issue no copies, beside the main loop, with `shrink_producer`, else the consumer warps
    before it; `sync`, int32 [>= 1], zero, this call site's own), then the FP8 epilogue's launch with unit scales
    (`unit`: fp32 ones, at least max(M, N)), which adds the bias and the expand (`lora` without A pools: v already
    written; None: no expand). The same bits as the one launch (whose epilogue is that arithmetic on the same fp32
    sums), with no wait inside the product for every CTA's share of v: the epilogue's launch reads v after the
    product has ended. `act` (two equal spans gate | up): 1 (SiLU) or 2 (GELU-tanh): the epilogue returns act(gate) *
    up [M, N / 2], flashinfer's act_and_mul bits from the one launch's output, in place of that launch. `early`: the
    epilogue's launch lets the next kernel start at once (csrc/quant.h Fp8EpilogueArgs::early; the same bits)."""
    M, N = x.shape[0], w.shape[0]
    v, b, ranks, row_slot, a = epilogue_lora(lora)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if a is not None and sync is None:
        raise ValueError("bf16_sm90_shrink_first: the shrink first needs the call site's counters")
    shrink = {} if a is None else shrink_first_args(x, spans, lora, sync, shrink_producer)
    ext.fp8_gemm_sm90(y, x, w, stream, 1, **shrink)
    out = torch.empty(M, N // 2 if act else N, dtype=x.dtype, device=x.device)
    ext.fp8_epilogue(out, y, unit[:M], unit[:N], bias, list(spans), v, list(b), ranks, row_slot, True, stream, act,
                     **({"early": True} if early else {}))
    return out


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm90_splits(n: int, k: int, sms: int) -> int:
    """The parts K is cut into for the wgmma kernel: doubled while the weight's 64-row tiles times the parts still fit
    in one wave of `sms` SMs (K divisible by 16 per part). Depends on the weight and the GPU only, never on the step's
    rows, so a token's output does not depend on what else is in its step. 7B o and down on 132 SMs: 2; the rest 1."""
    tiles = -(-n // SM90_TILE_ROWS)
    s = 1
    while s < 16 and tiles * s * 2 <= sms and k % (16 * s * 2) == 0:
        s *= 2
    return s


def _sm90_operands(xq: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether the wgmma kernel takes these operands: K a multiple of 16, N of 4, 16-byte aligned rows."""
    K, N = xq.shape[1], w.q.shape[0]
    return K % 16 == 0 and N % 4 == 0 and _aligned(xq) and _aligned(w.q)


def fp8_shrink_first_applies(x: torch.Tensor, xq: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether the wgmma kernel's unit-scale product of x's e4m3 rows `xq` can also compute the rows' LoRA shrink of
    x itself first (fp8_linear's `shrink_sync`): bf16 x [M <= 64, K] contiguous and 16-byte aligned, the kernel's
    operands (_sm90_operands)."""
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous() and _aligned(x)
            and 1 <= x.shape[0] <= SM90_MAX_ROWS and xq.shape == x.shape and _sm90_operands(xq, w))


def _sm90_fused(xq: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype, act: int, split: bool) -> bool:
    """Whether the wgmma kernel can finish the product with the epilogue inside it (fp8_gemm_sm90_fused): bf16 out,
    no activation, one part (the parts sm90_splits would cut K into: 1)."""
    N, K = w.q.shape
    return (out_dtype == torch.bfloat16 and act == 0 and _sm90_operands(xq, w)
            and (not split or sm90_splits(N, K, _sm_count(xq.device.index)) == 1))


def _unit_product(xq: torch.Tensor, w: Fp8Weight, ext, sm90: bool, split: bool = False,
                  persistent: bool = False, shrink: dict | None = None) -> torch.Tensor:
    """x_q @ w_q.T in fp32 with unit scales: on the wgmma kernel (`sm90`, where its operands suit it: K a multiple
    of 16, N of 4, 16-byte aligned rows) or cuBLASLt. Both sum exact e4m3 products on the tensor cores, which
    accumulate with fewer bits than fp32 between their promotions to fp32: the two differ in those roundings and in
    the order of the additions. With `split` the wgmma kernel may cut K into parts (sm90_splits): the result
    is then [parts, M, N], partial sums for the FP8 epilogue (or split_sum) to add in part order. `persistent`: the
    wgmma kernel on CUTLASS's persistent ping-pong schedule (the same bits). `shrink` (the wgmma kernel, one CTA a
    tile): its fp8_gemm_sm90 arguments for the rows' LoRA shrink on the product's warps first (lora_x, cols, v, b,
    ranks, row_slot, a, sync)."""
    M, K = xq.shape
    N = w.q.shape[0]
    if sm90 and _sm90_operands(xq, w):
        parts = sm90_splits(N, K, _sm_count(xq.device.index)) if split else 1
        y = torch.empty(*((parts,) if parts > 1 else ()), M, N, dtype=torch.float32, device=xq.device)
        schedule = (True, True) if persistent else ()  # (pdl, persistent), the kernel's defaults otherwise
        ext.fp8_gemm_sm90(y, xq, w.q, torch.cuda.current_stream(xq.device).cuda_stream, parts, *schedule,
                          **(shrink or {}))
        return y
    if shrink is not None:
        raise ValueError("fp8_linear: the shrink first needs the product on the wgmma kernel")
    one = unit_scale(xq.device)
    return torch._scaled_mm(xq, w.q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)


def split_sum(y: torch.Tensor) -> torch.Tensor:
    """[parts, M, N] partial sums added in part order (the FP8 epilogue's order: the same bits), or y as it is."""
    if y.dim() == 2:
        return y
    total = y[0].clone()
    for part in y[1:]:
        total.add_(part)
    return total


def epilogue_applies(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, tensor_cores: bool, ext,
                     own_rows: int, unit_scale_elems: int, spans: list[int]) -> bool:
    """Whether fp8_linear(..., epilogue=True) can finish the unit-scale product in the extension's one-launch
    epilogue (csrc/quant.h fp8_epilogue: the scales, the bias and the rows' LoRA expand over the output `spans`)."""
    if not (tensor_cores and ext is not None and hasattr(ext, "fp8_epilogue") and x.is_cuda and x.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    M, K = x.shape
    N = w.q.shape[0]
    return (not _own_kernel(x, w, ext, own_rows) and unit_scale_call(M, N, K, unit_scale_elems)
            and sum(spans) == N and all(s > 0 and s % 8 == 0 for s in spans) and len(spans) <= 3
            and _aligned(w.scale) and (bias is None or (bias.dtype == x.dtype and _aligned(bias))))


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, tensor_cores: bool,
               ext=None, swap_rows: int = 0, own_rows: int = 0, unit_scale_elems: int = 0,
               own_bf16: bool = False, epilogue: bool = False, spans: list[int] | None = None,
               lora: tuple | None = None, quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
               act: int = 0, sm90: bool = False, sm90_split: bool = False, sm90_fused: bool = False,
               sm90_persistent: bool = False,
               shrink_sync: torch.Tensor | None = None, shrink_producer: bool = False,
               early: bool = False) -> torch.Tensor:
    """x [M, K] (bf16/fp16 on the GPU, any float on the CPU) @ w.T + bias -> [M, N] in x's dtype. With the
    CUDA extension `ext`: the activations quantized by its one-launch kernel (see quantize_tokens), and for
    M <= `own_rows` (bf16, K a multiple of 64, N of 16) the product on its FP8 kernel (csrc/fp8_gemm.cu), with
    `own_bf16` on the bf16 rows themselves (weight-only FP8: no activation quantization, x @ dequant(w).T);
    Then, M <= 64 and N * K >= `unit_scale_elems` > 0: the product of the e4m3 operands with unit scales into
    fp32, then times the token and row scales (the same arithmetic; cuBLASLt streams large weights faster there), the
    product on the wgmma kernel with `sm90` (only where sm90_gemm_available; `sm90_split`: K cut into parts where the
    weight has too few rows to fill the GPU, sm90_splits);
    with `epilogue` (only where epilogue_applies) the scales, the bias and, given `lora` = (v, B pools, ranks,
    row slots) from LoraStepImpl.epilogue_operands, the rows' LoRA expand over the output `spans` in one launch,
    bit for bit the separate ops. `quantized`: x's e4m3 rows and scales [M, 1] already made (by the LoRA shrink's
    launch), the same bits as quantize_tokens(x, ext). `act` (with `epilogue`, two equal spans gate | up): 1 (SiLU) or
    2 (GELU-tanh): the epilogue returns act(gate) * up [M, N / 2] as flashinfer's act_and_mul makes it from its output.
    With `sm90` and `sm90_fused`, an epilogue without an activation or `lora` on a product in one part (bf16) runs
    inside the wgmma kernel (the same bits, one launch; with `lora` it stays two launches: inside, the B and v loads
    wait behind each tile's main loop, measured slower); `sm90_persistent`: every wgmma product, with the epilogue inside or not, on the kernel's persistent ping-pong
    schedule (the same bits; the epilogue inside then runs beside the next tile's main loop). With A pools in `lora`
    (LoraStepImpl.epilogue_operands' in_product) and `shrink_sync` (int32, zero, the call site's own), the product on
    the wgmma kernel (one CTA a tile; fp8_shrink_first_applies) computes the rows' shrink of x into v first, on its
    own warps, and the epilogue's launch after it adds the expand (`shrink_producer`: on the producer warp group's
    three warps that issue no copies, beside the main loop, instead of the consumers before it; the same bits).
    `early`: the epilogue's own launch lets the next kernel start at once (Fp8EpilogueArgs::early; the same bits).
    Then, M <= `swap_rows` (and a multiple of 16): cuBLASLt computes (w @ x.T).T, the weight as the long operand.
    Otherwise torch._scaled_mm with per-token and per-row scales."""
    if act and not (epilogue and tensor_cores and not _own_kernel(x, w, ext, own_rows)
                    and unit_scale_call(x.shape[0], w.q.shape[0], x.shape[-1], unit_scale_elems)):
        raise ValueError("fp8_linear: an activation rides only in the epilogue of the unit-scale product")
    if lora is not None and lora[4] is not None and not (
            epilogue and tensor_cores and not _own_kernel(x, w, ext, own_rows)
            and unit_scale_call(x.shape[0], w.q.shape[0], x.shape[-1], unit_scale_elems)):
        raise ValueError("fp8_linear: A pools (the shrink first) ride only in the unit-scale product before the "
                         "epilogue's launch")
    if not tensor_cores:
        y = torch.nn.functional.linear(x, w.dequant(x.dtype))
        return y if bias is None else y + bias
    if w.scale_row is None:
        w.scale_row = w.scale.reshape(1, -1).contiguous()
    M, K = x.shape
    N = w.q.shape[0]
    own = _own_kernel(x, w, ext, own_rows)
    if own and own_bf16:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
        ext.fp8_gemm_bf16(y, x.contiguous(), w.q, w.scale_row.view(-1), torch.cuda.current_stream(x.device).cuda_stream)
        return y if bias is None else y + bias
    xq, sx = quantized if quantized is not None else quantize_tokens(x, ext)
    if own:
        y = torch.empty(M, N, dtype=x.dtype, device=x.device)
        ext.fp8_gemm(y, xq, sx.view(-1), w.q, w.scale_row.view(-1), torch.cuda.current_stream(x.device).cuda_stream)
    elif unit_scale_call(M, N, K, unit_scale_elems):
        if epilogue:
            out = torch.empty(M, N // 2 if act else N, dtype=x.dtype, device=x.device)
            v, b, ranks, row_slot, a = epilogue_lora(lora)
            stream = torch.cuda.current_stream(x.device).cuda_stream
            shrink, inside = None, None  # (the shrink first's arguments; the product's with the epilogue inside)
            fusable = sm90 and sm90_fused and _sm90_fused(xq, w, x.dtype, act, sm90_split)
            if a is not None:  # the shrink first, inside the product (else a launch before this call did it)
                if shrink_sync is None or sm90_persistent:
                    raise ValueError("fp8_linear: A pools take the shrink first: shrink_sync, one CTA a tile, the "
                                     "epilogue's own launch")
                shrink = shrink_first_args(x, spans or [N], lora, shrink_sync, shrink_producer)
            elif fusable and lora is None:
                inside = {"persistent": True} if sm90_persistent else {}
            if inside is not None:
                ext.fp8_gemm_sm90_fused(out, xq, w.q, sx.view(-1), w.scale, bias, list(spans or [N]), v, list(b),
                                        ranks, row_slot, True, stream, **inside)
                return out
            y = _unit_product(xq, w, ext, sm90, sm90_split, sm90_persistent, shrink)
            ext.fp8_epilogue(out, y, sx.view(-1), w.scale, bias, list(spans or [N]), v, list(b), ranks, row_slot,
                             True, stream, act, **({"early": True} if early else {}))
            return out
        y = _unit_product(xq, w, ext, sm90, sm90_split, sm90_persistent)
        y = split_sum(y).mul_(sx).mul_(w.scale_row).to(x.dtype)
    elif 0 < M <= swap_rows and M % 16 == 0:  # cuBLASLt wants the rows in multiples of 16 there
        y = torch._scaled_mm(w.q, xq.t(), scale_a=w.scale_row.view(-1, 1), scale_b=sx.view(1, -1),
                             out_dtype=x.dtype).t().contiguous()
    else:
        y = torch._scaled_mm(xq, w.q.t(), scale_a=sx, scale_b=w.scale_row, out_dtype=x.dtype)
    return y if bias is None else y + bias

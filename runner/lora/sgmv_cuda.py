"""SGMV on CUDA: the shrink / expand kernels of `csrc/` behind the `SGMV` interface."""

from __future__ import annotations

from typing import Sequence

import torch

from lorafleet.runner.lora.segments import SegmentTable
from lorafleet.runner.model.norm import NormOperands


class CudaSGMV:
    """The LoRA add-on over the segments of a flat batch: `shrink` and `expand` one launch each, `add`
    one or two.

    For every segment i with slot s = seg.slots[i] >= 0 and every projection g of the group
    (q,k,v or gate,up share x; o and down stand alone):

        rows = seg.indptr[i] : seg.indptr[i+1]
        r    = ranks[g, s]                                 # 0: projection g not adapted by slot s
        shrink:  v[rows, g, :r]  = x[rows] @ a[g][s, :r, :].T       # fp32 accumulate, fp32 store
        expand:  ys[g][rows]    += v[rows, g, :r] @ b[g][s, :r, :]  # fp32 accumulate, one rounding

    Shapes and dtypes (all tensors on one CUDA device):
        x      [T, in]          float16 or bfloat16, contiguous, in % 8 == 0
        a[g]   [S, R_g, in]     dtype of x, contiguous; rows beyond a slot's rank are never read
        b[g]   [S, R_g, out_g]  dtype of x, contiguous; out_g % 8 == 0
        ranks  int32 [G, S]     on the device (read by the kernels; clamped to [0, R_g])
        v      fp32 [T, G, R]   contiguous workspace, R >= every R_g
        ys[g]  [T, out_g]       dtype of x, stride(1) == 1, any row stride that is a multiple of 8
                                and a 16-byte aligned start (column views of a fused qkv / gate_up)
        seg    SegmentTable     int32 indptr [cap + 1] and slots [cap] on the device, cap <= 1024
    G is 1, 2 or 3; R_g <= 128. Rows of segments with slot -1, entries v[:, g, r:] and ys columns
    outside the views are never read or written. `host_ranks` is ignored: the kernels read `ranks`.

    Every call is capturable in a CUDA graph: no host synchronisation or allocation, and the grid
    depends only on (T, capacity, G, pool shapes), so a graph captured once replays correctly with
    new contents of `seg.indptr`, `seg.slots` and `ranks`.

    `add` does both halves of one group: in ONE fused launch when T is below both tensor-core
    thresholds (or `mma=False`: every segment on the CUDA-core path, where one shared adapter over
    many rows is still fastest), else as the two launches; `mma=False, fused=False` gives two
    CUDA-core launches (what decode steps use: runner/lora/step.py). Fused results equal the two-launch
    CUDA-core path bit for bit; the fused kernel keeps 2 * capacity int32 counters per device,
    zero between launches (launches on one device must not run concurrently on two streams).

    Segments with at least `shrink_mma_min_rows` / `expand_mma_min_rows` rows run on tensor cores,
    shorter ones on the memory-bound CUDA-core path; both are exact for any table. `pdl` enables
    programmatic dependent launch on sm_90+: each kernel starts while the previous kernel in the
    stream drains and reads the segment table, `ranks` and its first A or B tile early (x, v and y
    only after that kernel completes), so nothing may write the tables or the pools in the kernel
    launched right before a shrink or an expand. Results are bitwise identical with and without it.
    """

    name = "cuda"

    def __init__(self, *, shrink_mma_min_rows: int = 64, expand_mma_min_rows: int = 128, pdl: bool = True):
        if shrink_mma_min_rows < 1 or expand_mma_min_rows < 1:
            raise ValueError("mma_min_rows must be >= 1")
        self.shrink_mma_min_rows = int(shrink_mma_min_rows)
        self.expand_mma_min_rows = int(expand_mma_min_rows)
        self.pdl = bool(pdl)
        self._mod = None
        self._counters: dict[torch.device, torch.Tensor] = {}

    def _ext(self):
        if self._mod is None:
            from lorafleet.runner.kernels import load

            self._mod = load()
        return self._mod

    def shrink(self, v: torch.Tensor, x: torch.Tensor, a: Sequence[torch.Tensor], ranks: torch.Tensor,
               host_ranks: Sequence[Sequence[int]], seg: SegmentTable, max_blocks: int = 0,
               mma_min_rows: int | None = None, blocks_per_sm: int = 0, decode_ranks: int = 0,
               quant: tuple[torch.Tensor, torch.Tensor] | None = None, x_ready: bool = False,
               row_items: bool = False) -> None:
        """`mma_min_rows` overrides the instance's threshold. Launch-shape knobs, none of which ever
        changes a bit of v (only the speed): `max_blocks` > 0 caps the grid, leaving SMs to a kernel
        that runs beside this one on another stream; `blocks_per_sm` > 0 caps the resident blocks per
        SM (0: the kernel's default, 4); `decode_ranks` (1, 2 or 4; 0: the default, 2, or 4 when the call
        can take tensor cores) is the number of rank rows per CUDA-core work item of one-row segments, and with
        `row_items` also of the rows of segments shorter than 96 rows (instead of items of 2 rows x 2 rank rows).
        `quant` = (out float8_e4m3fn [T, in], scale fp32 [T]): the same launch also quantizes every row of x per
        token, bit for bit runner/model/fp8.py quantize_tokens (an FP8 projection's input, no launch of its own).
        `x_ready`: the kernel enqueued right before this call (the base GEMM on the same x) neither writes x nor
        touches v, so the launch reads x without waiting for it (csrc/sgmv.h LaunchOptions::x_ready); never
        changes a bit of v."""
        if not x.is_cuda:
            raise ValueError(f"CudaSGMV needs CUDA tensors, got x on {x.device} (use TorchSGMV on the CPU)")
        stream = torch.cuda.current_stream(x.device).cuda_stream
        rows = self.shrink_mma_min_rows if mma_min_rows is None else mma_min_rows
        q_out, q_scale = quant if quant is not None else (None, None)
        self._ext().shrink(v, x, list(a), ranks, seg.indptr, seg.slots, rows, self.pdl, stream, max_blocks,
                           blocks_per_sm, decode_ranks, q_out, q_scale, x_ready, row_items)

    def norm_shrink(self, v: torch.Tensor, x_out: torch.Tensor, norm: "NormOperands", a: Sequence[torch.Tensor],
                    ranks: torch.Tensor, seg: SegmentTable,
                    quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The RMSNorm of `norm` (runner/model/norm.py) into x_out (and its residual, and with `quant` its e4m3 rows)
        and the shrink of x_out in ONE launch, every segment on the CUDA-core path: v is bit for bit
        `shrink(v, x_out, a, ranks, None, seg, mma_min_rows=1 << 30)` on the x_out it writes."""
        stream = torch.cuda.current_stream(x_out.device).cuda_stream
        q_out, q_scale = quant if quant is not None else (None, None)
        self._ext().norm_shrink(v, x_out, norm.h, norm.res, norm.res_out, norm.w, norm.eps, norm.offset, list(a), ranks,
                                seg.indptr, seg.slots, self.pdl, stream, 0, 0, q_out, q_scale)

    def expand(self, ys: Sequence[torch.Tensor], v: torch.Tensor, b: Sequence[torch.Tensor], ranks: torch.Tensor,
               host_ranks: Sequence[Sequence[int]], seg: SegmentTable, mma_min_rows: int | None = None,
               blocks_per_sm: int = 0, write: bool = False) -> None:
        """`mma_min_rows` overrides the instance's threshold; `blocks_per_sm` > 0 caps the resident blocks
        per SM (0: occupancy only), a launch-shape knob that never changes a bit of ys. `write`: ys are fp32 and
        receive the add-on itself, v @ B in fp32 (not read; rows without an adapter and projections a slot does
        not adapt are left as they are), the very sums the default mode adds to its fp16/bf16 ys before rounding:
        ys_bf16.add_(ys_f32) later gives that mode's bits (csrc/sgmv.h ExpandArgs::write_f32)."""
        ys = list(ys)
        if not ys or not ys[0].is_cuda:
            raise ValueError("CudaSGMV needs CUDA tensors (use TorchSGMV on the CPU)")
        stream = torch.cuda.current_stream(ys[0].device).cuda_stream
        rows = self.expand_mma_min_rows if mma_min_rows is None else mma_min_rows
        self._ext().expand(ys, v, list(b), ranks, seg.indptr, seg.slots, rows, self.pdl, stream, blocks_per_sm, write)

    def add(self, ys: Sequence[torch.Tensor], v: torch.Tensor, x: torch.Tensor, a: Sequence[torch.Tensor],
            b: Sequence[torch.Tensor], ranks: torch.Tensor, host_ranks: Sequence[Sequence[int]], seg: SegmentTable,
            mma: bool = True, mma_rows: tuple[int, int] | None = None, fused: bool = True,
            x_ready: bool = False, decode_ranks: int = 0, row_items: bool = False) -> None:
        """shrink then expand of one group (see the class docstring), fused into one launch when T is
        below both thresholds (`mma=False`: always). `mma_rows` = (shrink, expand) thresholds of this
        call instead of the instance's. `fused=False`: always the two launches (the same bits as the
        fused launch); `mma=False, fused=False` is what decode steps call. `x_ready`: the two launches' shrink
        need not wait for the kernel enqueued before the call (see shrink); the fused launch ignores it, as it does
        `decode_ranks` and `row_items` (the two launches' shrink: see shrink)."""
        if not x.is_cuda:
            raise ValueError(f"CudaSGMV needs CUDA tensors, got x on {x.device} (use TorchSGMV on the CPU)")
        big = 1 << 30
        s_rows, e_rows = mma_rows or (self.shrink_mma_min_rows, self.expand_mma_min_rows)  # the binding checks >= 1
        if not fused:
            self.shrink(v, x, a, ranks, host_ranks, seg, mma_min_rows=s_rows if mma else big, x_ready=x_ready,
                        decode_ranks=decode_ranks, row_items=row_items)
            self.expand(ys, v, b, ranks, host_ranks, seg, mma_min_rows=e_rows if mma else big)
            return
        stream = torch.cuda.current_stream(x.device).cuda_stream
        self._ext().add(list(ys), v, x, list(a), list(b), ranks, seg.indptr, seg.slots, self._counters_for(x.device),
                        s_rows if mma else big, e_rows if mma else big, self.pdl, stream)

    def _counters_for(self, device: torch.device) -> torch.Tensor:
        c = self._counters.get(device)
        if c is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("CudaSGMV.add: call it once outside CUDA-graph capture first (counter allocation)")
            c = torch.zeros(2 * self._ext().MAX_SEGMENTS, dtype=torch.int32, device=device)
            self._counters[device] = c
        return c

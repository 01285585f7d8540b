"""SGMV: the per-segment LoRA add-on, `y += x @ A[slot] @ B[slot]`, as shrink then expand.

Semantics (pseudo-torch), for every segment i with slot s = seg.slots[i] >= 0 and every
projection g of a group (q,k,v share x; gate,up share x; o and down stand alone):

    rows = seg.indptr[i] : seg.indptr[i+1]
    r = ranks[g, s]                                  # 0: projection g not adapted by slot s
    v[rows, g, :r]  = x[rows] @ a[g][s, :r, :].T     # shrink  [n, in] x [in, r]   (fp32 accumulate)
    ys[g][rows]    += v[rows, g, :r] @ b[g][s, :r, :] # expand  [n, r]  x [r, out]

Shapes and dtypes:
    x      [T, in]            fp16 / bf16 / fp32, contiguous
    a[g]   [S, R, in]         same dtype as x; A of slot s, rows beyond its rank unused
    b[g]   [S, R, out_g]      same dtype as x; B^T with the LoRA scaling folded in
    ranks  int32 [G, S]       on the device of x
    v      fp32 [T, G, R]     workspace written by shrink, read by expand
    ys[g]  [T, out_g]         same dtype as x; stride(1) == 1, any row stride (views of a fused output)
Rows whose segment has slot -1, and entries v[:, g, r:], are never read or written.

`TorchSGMV` is the plain-torch implementation (CPU, and the reference on GPU);
`fp32_loop_reference` is an independent per-row fp32 loop used only by tests.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from lorafleet.runner.lora.segments import SegmentTable


class SGMV(Protocol):
    def shrink(self, v: torch.Tensor, x: torch.Tensor, a: Sequence[torch.Tensor], ranks: torch.Tensor,
               host_ranks: Sequence[Sequence[int]], seg: SegmentTable) -> None: ...

    def expand(self, ys: Sequence[torch.Tensor], v: torch.Tensor, b: Sequence[torch.Tensor], ranks: torch.Tensor,
               host_ranks: Sequence[Sequence[int]], seg: SegmentTable) -> None: ...


class TorchSGMV:
    """Plain-torch SGMV over the host copy of the segment table: one matmul per segment."""

    name = "torch"

    def shrink(self, v, x, a, ranks, host_ranks, seg):
        for i, s in enumerate(seg.host_slots):
            if s < 0:
                continue
            lo, hi = seg.host_indptr[i], seg.host_indptr[i + 1]
            for g, a_g in enumerate(a):
                r = host_ranks[g][s]
                if r:
                    v[lo:hi, g, :r] = torch.matmul(x[lo:hi], a_g[s, :r].transpose(0, 1)).float()

    def expand(self, ys, v, b, ranks, host_ranks, seg):
        for i, s in enumerate(seg.host_slots):
            if s < 0:
                continue
            lo, hi = seg.host_indptr[i], seg.host_indptr[i + 1]
            for g, (y, b_g) in enumerate(zip(ys, b)):
                r = host_ranks[g][s]
                if r:
                    y[lo:hi] += torch.matmul(v[lo:hi, g, :r].to(y.dtype), b_g[s, :r])


def fp32_loop_reference(x, a, b, ranks, row_slots):
    """Independent reference: for each row, each projection, `x_row @ A^T @ B` in fp32.

    Returns the add-on per projection as fp32 tensors [T, out_g] (zeros where no adapter).
    `row_slots` gives the slot of every row (-1 for none); `ranks` is a host [G][S] list.
    """
    outs = [torch.zeros(x.shape[0], b_g.shape[2], dtype=torch.float32) for b_g in b]
    xf = x.detach().float().cpu()
    for row, s in enumerate(row_slots):
        if s < 0:
            continue
        for g in range(len(a)):
            r = ranks[g][s]
            if r == 0:
                continue
            a_gs = a[g][s, :r].detach().float().cpu()
            b_gs = b[g][s, :r].detach().float().cpu()
            acc = torch.zeros(r, dtype=torch.float32)
            for k in range(r):
                acc[k] = (xf[row] * a_gs[k]).sum()
            outs[g][row] = (acc[:, None] * b_gs).sum(0)
    return outs

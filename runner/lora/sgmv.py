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


SHORT_SEGMENT = 16  # segments with fewer rows run batched (gather + einsum), longer ones one matmul each


def _split(seg: SegmentTable, device) -> tuple[list[tuple[int, int, int]], torch.Tensor | None, torch.Tensor | None, list[int]]:
    """(long segments [(lo, hi, slot)], rows of short segments, their slots, their distinct slots), once per step."""
    hit = seg.cache.get("torch_split")
    if hit is None:
        long_, rows, slots = [], [], []
        for i, s in enumerate(seg.host_slots):
            if s < 0:
                continue
            lo, hi = seg.host_indptr[i], seg.host_indptr[i + 1]
            if hi - lo >= SHORT_SEGMENT:
                long_.append((lo, hi, s))
            else:
                rows.extend(range(lo, hi))
                slots.extend([s] * (hi - lo))
        t_rows = torch.tensor(rows, dtype=torch.int64, device=device) if rows else None
        t_slots = torch.tensor(slots, dtype=torch.int64, device=device) if rows else None
        hit = seg.cache["torch_split"] = (long_, t_rows, t_slots, sorted(set(slots)))
    return hit


class TorchSGMV:
    """Plain-torch SGMV over the host copy of the segment table.

    Long segments (prefill, shared adapters) run one matmul each; rows of short segments
    (decode with distinct adapters) run together as gather + einsum up to the largest rank
    among them, with entries beyond each slot's rank masked to zero.
    """

    name = "torch"

    def shrink(self, v, x, a, ranks, host_ranks, seg):
        long_, rows, slots, distinct = _split(seg, x.device)
        for lo, hi, s in long_:
            for g, a_g in enumerate(a):
                r = host_ranks[g][s]
                if r:
                    v[lo:hi, g, :r] = torch.matmul(x[lo:hi], a_g[s, :r].transpose(0, 1)).float()
        if rows is None:
            return
        for g, a_g in enumerate(a):
            r_max = max(host_ranks[g][s] for s in distinct)
            if r_max == 0:
                continue
            w = a_g.index_select(0, slots)[:, :r_max]  # [n, r, in]
            out = torch.einsum("ti,tri->tr", x.index_select(0, rows), w).float()
            keep = torch.arange(r_max, device=x.device)[None, :] < ranks[g].to(x.device).long()[slots][:, None]
            v[rows, g, :r_max] = out * keep

    def expand(self, ys, v, b, ranks, host_ranks, seg):
        long_, rows, slots, distinct = _split(seg, v.device)
        for lo, hi, s in long_:
            for g, (y, b_g) in enumerate(zip(ys, b)):
                r = host_ranks[g][s]
                if r:
                    y[lo:hi] += torch.matmul(v[lo:hi, g, :r].to(y.dtype), b_g[s, :r])
        if rows is None:
            return
        for g, (y, b_g) in enumerate(zip(ys, b)):
            r_max = max(host_ranks[g][s] for s in distinct)
            if r_max == 0:
                continue
            w = b_g.index_select(0, slots)[:, :r_max]  # [n, r, out]
            vg = v[rows, g, :r_max]
            keep = torch.arange(r_max, device=v.device)[None, :] < ranks[g].to(v.device).long()[slots][:, None]
            vg = torch.where(keep, vg, torch.zeros((), dtype=vg.dtype, device=vg.device)).to(y.dtype)
            y.index_add_(0, rows, torch.einsum("tr,tro->to", vg, w))


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

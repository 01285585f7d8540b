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

    def add(self, ys: Sequence[torch.Tensor], v: torch.Tensor, x: torch.Tensor, a: Sequence[torch.Tensor],
            b: Sequence[torch.Tensor], ranks: torch.Tensor, host_ranks: Sequence[Sequence[int]], seg: SegmentTable,
            mma: bool = True, mma_rows: tuple[int, int] | None = None, fused: bool = True,
            x_ready: bool = False, decode_ranks: int = 0, row_items: bool = False) -> None:
        """shrink(v, x, a, ...) then expand(ys, v, b, ...); `mma=False` asks for the CUDA-core path;
        `mma_rows` = (shrink, expand): segments of at least that many rows may take tensor cores (None:
        the implementation's defaults); `fused=False` asks for separate launches where one fused launch
        would be allowed. Only the speed depends on the path, and the rounding on a segment's own path
        (never on other segments, the step's length or `fused`). `x_ready`: the caller enqueued the base GEMM on
        the same x right before, so the shrink need not wait for it (a scheduling hint; never changes a bit);
        `decode_ranks`: rank rows per shrink work item of one-row segments, `row_items`: short segments' rows as such
        items too (launch shapes; never change a bit)."""


SHORT_SEGMENT = 16  # shorter segments run together as one padded bmm over their distinct slots


class _Split:
    """Per-step index tensors of TorchSGMV, derived once from the segment table."""

    def __init__(self, seg: SegmentTable, device):
        self.long: list[tuple[int, int, int]] = []  # (lo, hi, slot) of long segments
        groups: dict[int, list[int]] = {}  # slot -> rows of its short segments
        for i, s in enumerate(seg.host_slots):
            if s < 0:
                continue
            lo, hi = seg.host_indptr[i], seg.host_indptr[i + 1]
            if hi - lo >= SHORT_SEGMENT:
                self.long.append((lo, hi, s))
            else:
                groups.setdefault(s, []).extend(range(lo, hi))
        self.slots = sorted(groups)  # distinct slots of short segments
        self.k = len(self.slots)
        if not self.k:
            return
        self.m = max(len(r) for r in groups.values())
        pad, valid, dest = [], [], []
        for j, s in enumerate(self.slots):
            rows = groups[s]
            pad.extend(rows + [rows[0]] * (self.m - len(rows)))  # padding repeats a real row; dropped below
            valid.extend(range(j * self.m, j * self.m + len(rows)))
            dest.extend(rows)
        i64 = torch.int64
        self.pad = torch.tensor(pad, dtype=i64, device=device)  # [k * m]
        self.valid = torch.tensor(valid, dtype=i64, device=device)  # positions of real rows in [k * m]
        self.dest = torch.tensor(dest, dtype=i64, device=device)  # their rows in the batch
        self.slot_t = torch.tensor(self.slots, dtype=i64, device=device)  # [k]

    def keep(self, ranks_g: torch.Tensor, r_max: int) -> torch.Tensor:
        """[k, r_max] True where rank row j < the slot's rank."""
        r = ranks_g.to(self.slot_t.device).long().index_select(0, self.slot_t)
        return torch.arange(r_max, device=self.slot_t.device)[None, :] < r[:, None]


def _split(seg: SegmentTable, device) -> _Split:
    hit = seg.cache.get("torch_split")
    if hit is None:
        hit = seg.cache["torch_split"] = _Split(seg, device)
    return hit


class TorchSGMV:
    """Plain-torch SGMV over the host copy of the segment table.

    Long segments (prefill, shared adapters) run one matmul each; short segments (decode)
    run together: their rows are grouped by distinct slot into a padded [k, m, in] batch and
    multiplied by the k gathered weights with one bmm, entries beyond each slot's rank masked.
    """

    name = "torch"

    def shrink(self, v, x, a, ranks, host_ranks, seg):
        sp = _split(seg, x.device)
        for lo, hi, s in sp.long:
            for g, a_g in enumerate(a):
                r = host_ranks[g][s]
                if r:
                    v[lo:hi, g, :r] = torch.matmul(x[lo:hi], a_g[s, :r].transpose(0, 1)).float()
        if not sp.k:
            return
        xs = x.index_select(0, sp.pad).view(sp.k, sp.m, x.shape[1])  # [k, m, in]
        for g, a_g in enumerate(a):
            r_max = max(host_ranks[g][s] for s in sp.slots)
            if r_max == 0:
                continue
            w = a_g[:, :r_max].index_select(0, sp.slot_t)  # [k, r, in]
            out = torch.bmm(xs, w.transpose(1, 2)).float() * sp.keep(ranks[g], r_max)[:, None, :]  # [k, m, r]
            v[sp.dest, g, :r_max] = out.view(sp.k * sp.m, r_max).index_select(0, sp.valid)

    def add(self, ys, v, x, a, b, ranks, host_ranks, seg, mma=True, mma_rows=None, fused=True, x_ready=False,
            decode_ranks=0, row_items=False):
        self.shrink(v, x, a, ranks, host_ranks, seg)
        self.expand(ys, v, b, ranks, host_ranks, seg)

    def expand(self, ys, v, b, ranks, host_ranks, seg):
        sp = _split(seg, v.device)
        for lo, hi, s in sp.long:
            for g, (y, b_g) in enumerate(zip(ys, b)):
                r = host_ranks[g][s]
                if r:
                    y[lo:hi] += torch.matmul(v[lo:hi, g, :r].to(y.dtype), b_g[s, :r])
        if not sp.k:
            return
        for g, (y, b_g) in enumerate(zip(ys, b)):
            r_max = max(host_ranks[g][s] for s in sp.slots)
            if r_max == 0:
                continue
            vg = v[sp.pad, g, :r_max].view(sp.k, sp.m, r_max)
            vg = torch.where(sp.keep(ranks[g], r_max)[:, None, :], vg, torch.zeros((), dtype=vg.dtype)).to(y.dtype)
            w = b_g[:, :r_max].index_select(0, sp.slot_t)  # [k, r, out]
            out = torch.bmm(vg, w).view(sp.k * sp.m, -1).index_select(0, sp.valid)  # [n, out]
            y.index_add_(0, sp.dest, out)


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

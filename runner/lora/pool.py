"""The device pool of adapter slots that SGMV reads in place.

For every layer and projection p: `a[layer][p]` [S, R, in_p] and `b[layer][p]` [S, R, out_p]
(rank-major: each rank row is contiguous), and `ranks` int32 [L, 7, S] with 0 where a slot
does not adapt that module. Slot s of an adapter of rank r uses rows 0..r-1; the tensors
never move, so captured CUDA graphs stay valid while slots are rewritten.

Storage is one tensor per projection, `A[p]` [L, S, R, in_p] (and `B[p]`), so `a[layer][p]`
is the contiguous view `A[p][layer]` and writing a slot is one strided copy per projection
(14 copies per adapter, not 2 per layer and projection).
"""

from __future__ import annotations

import itertools

import torch

from lorafleet.common.peft_config import BaseShape
from lorafleet.models.contract import PROJECTIONS
from lorafleet.runner.lora.adapter import LoadedAdapter

# (first projection index, count) of each SGMV group, in PROJECTIONS order: qkv, o, gate_up, down.
GROUP_SPANS = ((0, 3), (3, 1), (4, 2), (6, 1))
_POOL_UIDS = itertools.count(1)


class LoraPool:
    """`base` is the shape this pool holds (a tensor-parallel rank's part); with `shard`, adapters
    written into it are full-size (`full` shape) and sliced on the way in."""

    def __init__(self, base: BaseShape, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device,
                 shard=None, full: BaseShape | None = None):
        self.base, self.num_slots, self.max_rank = base, num_slots, max_rank
        self.shard = shard if shard is not None and shard.size > 1 else None
        self.full = full or base
        self.dtype, self.device = dtype, device
        L, S, R = base.num_layers, num_slots, max_rank
        self.A = [torch.zeros(L, S, R, base.shape(p)[0], dtype=dtype, device=device) for p in PROJECTIONS]
        self.B = [torch.zeros(L, S, R, base.shape(p)[1], dtype=dtype, device=device) for p in PROJECTIONS]
        self.a = [[self.A[p][layer] for p in range(len(PROJECTIONS))] for layer in range(L)]
        self.b = [[self.B[p][layer] for p in range(len(PROJECTIONS))] for layer in range(L)]
        self.ranks = torch.zeros(L, len(PROJECTIONS), S, dtype=torch.int32, device=device)
        self.host_ranks = [[[0] * S for _ in PROJECTIONS] for _ in range(L)]
        # per slot, how often write() or clear() changed it: what a copy of its weights elsewhere is checked against
        # (LoRA's dense path keeps the step's B in the projection weights' spare columns across steps)
        self.slot_writes = [0] * S
        # (layer, group) -> the last one-segment K-extended step's stacked A rows and their key (slot, its write count,
        # rank blocks; runner/lora/step.py _kext_a_rows): one stack per layer and group at most, let go when the slot
        # changes (a 7B model at rank 16: 21 MB)
        self.kext_a_rows: dict = {}
        self.uid = next(_POOL_UIDS)  # tells pools apart in records that outlive one (runner/lora/step.py _kext_weight)
        # (a list, b list, ranks [G, S], host ranks) of each (layer, group), built once for the step loop
        self.group_args = [[(self.a[layer][p0 : p0 + g], self.b[layer][p0 : p0 + g], self.ranks[layer, p0 : p0 + g],
                             self.host_ranks[layer][p0 : p0 + g]) for p0, g in GROUP_SPANS] for layer in range(L)]

    def _changed(self, slot: int) -> None:
        """A slot's contents change: its write count moves on and its stacked A rows (kext_a_rows) are let go."""
        self.slot_writes[slot] += 1
        self.kext_a_rows = {k: hit for k, hit in self.kext_a_rows.items() if hit[0][0] != slot}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.A + self.B)

    def write(self, slot: int, adapter: LoadedAdapter, stream: torch.cuda.Stream | None = None) -> None:
        """Copy an adapter into a slot (asynchronously on `stream` when given: pinned sources). Only between steps:
        the decode products that shrink inside their launch (csrc/sm90_gemm.cuh FusedEpilogue) load A and read the
        slot tables before their wait for the kernel before, so no kernel of a step may write them."""
        pk = adapter.shard_for(self.shard, self.full) if self.shard else adapter.packed_for(self.base.num_layers)
        nb = stream is not None
        self._changed(slot)
        for p in range(len(PROJECTIONS)):
            if p in pk.a:
                r = pk.a[p].shape[1]
                self.A[p][:, slot, :r].copy_(pk.a[p], non_blocking=nb)
                self.B[p][:, slot, :r].copy_(pk.bt[p], non_blocking=nb)
        self.ranks[:, :, slot].copy_(pk.ranks, non_blocking=nb)
        for layer, row in enumerate(pk.host_ranks):
            hr = self.host_ranks[layer]
            for p, r in enumerate(row):
                hr[p][slot] = r

    def clear(self, slot: int) -> None:
        """Mark a slot empty: rank 0 everywhere (weights are left, never read)."""
        self._changed(slot)
        self.ranks[:, :, slot] = 0
        for layer in range(self.base.num_layers):
            for p in range(len(PROJECTIONS)):
                self.host_ranks[layer][p][slot] = 0

"""The device pool of adapter slots that SGMV reads in place.

For every layer and projection p: `a[layer][p]` [S, R, in_p] and `b[layer][p]` [S, R, out_p]
(rank-major: each rank row is contiguous), and `ranks` int32 [L, 7, S] with 0 where a slot
does not adapt that module. Slot s of an adapter of rank r uses rows 0..r-1; the tensors
never move, so captured CUDA graphs stay valid while slots are rewritten.
"""

from __future__ import annotations

import torch

from lorafleet.common.peft_config import BaseShape
from lorafleet.common.projections import PROJECTIONS, PROJ_INDEX
from lorafleet.runner.lora.adapter import LoadedAdapter


class LoraPool:
    def __init__(self, base: BaseShape, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.base, self.num_slots, self.max_rank = base, num_slots, max_rank
        self.dtype, self.device = dtype, device
        L, S, R = base.num_layers, num_slots, max_rank
        self.a = [[torch.zeros(S, R, base.shape(p)[0], dtype=dtype, device=device) for p in PROJECTIONS] for _ in range(L)]
        self.b = [[torch.zeros(S, R, base.shape(p)[1], dtype=dtype, device=device) for p in PROJECTIONS] for _ in range(L)]
        self.ranks = torch.zeros(L, len(PROJECTIONS), S, dtype=torch.int32, device=device)
        self.host_ranks = [[[0] * S for _ in PROJECTIONS] for _ in range(L)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for row in self.a + self.b for t in row)

    def write(self, slot: int, adapter: LoadedAdapter, stream: torch.cuda.Stream | None = None) -> None:
        """Copy an adapter into a slot (asynchronously on `stream` when given)."""
        ranks = torch.zeros(self.base.num_layers, len(PROJECTIONS), dtype=torch.int32)
        for (layer, proj), (a, bt) in adapter.weights.items():
            p, r = PROJ_INDEX[proj], a.shape[0]
            self.a[layer][p][slot, :r].copy_(a, non_blocking=stream is not None)
            self.b[layer][p][slot, :r].copy_(bt, non_blocking=stream is not None)
            ranks[layer, p] = r
        # a small blocking copy: on CUDA this runs on the loader's worker thread and side stream
        self.ranks[:, :, slot].copy_(ranks)
        for layer in range(self.base.num_layers):
            for p in range(len(PROJECTIONS)):
                self.host_ranks[layer][p][slot] = int(ranks[layer, p])

    def clear(self, slot: int) -> None:
        """Mark a slot empty: rank 0 everywhere (weights are left, never read)."""
        self.ranks[:, :, slot] = 0
        for layer in range(self.base.num_layers):
            for p in range(len(PROJECTIONS)):
                self.host_ranks[layer][p][slot] = 0

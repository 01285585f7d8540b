"""The LoRA half of one engine step: segment table + workspace, reused by every layer."""

from __future__ import annotations

import torch

from lorafleet.runner.lora.pool import LoraPool
from lorafleet.runner.lora.segments import SegmentTable
from lorafleet.runner.lora.sgmv import SGMV

# (first projection index, count) of each group, in PROJECTIONS order: qkv, o, gate_up, down.
GROUP_SPANS = ((0, 3), (3, 1), (4, 2), (6, 1))


class LoraStepImpl:
    def __init__(self, pool: LoraPool, sgmv: SGMV, seg: SegmentTable, workspace: torch.Tensor | None = None):
        self.pool, self.sgmv, self.seg = pool, sgmv, seg
        need = seg.num_rows * 3 * pool.max_rank
        if workspace is None or workspace.numel() < need:
            workspace = torch.empty(need, dtype=torch.float32, device=pool.device)
        self.ws = workspace
        self.active = seg.any_adapter

    def add(self, layer: int, group: int, x: torch.Tensor, ys: tuple[torch.Tensor, ...]) -> None:
        if not self.active:
            return
        p0, g = GROUP_SPANS[group]
        pool = self.pool
        v = self.ws[: self.seg.num_rows * g * pool.max_rank].view(self.seg.num_rows, g, pool.max_rank)
        a = pool.a[layer][p0 : p0 + g]
        b = pool.b[layer][p0 : p0 + g]
        ranks = pool.ranks[layer, p0 : p0 + g]  # [G, S]
        host = pool.host_ranks[layer][p0 : p0 + g]
        self.sgmv.shrink(v, x, a, ranks, host, self.seg)
        self.sgmv.expand(ys, v, b, ranks, host, self.seg)

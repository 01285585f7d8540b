"""The LoRA half of one engine step: segment table + workspace, reused by every layer."""

from __future__ import annotations

import torch

from lorafleet.runner.lora.pool import GROUP_SPANS, LoraPool
from lorafleet.runner.lora.segments import SegmentTable
from lorafleet.runner.lora.sgmv import SGMV


class LoraStepImpl:
    """`mma=False` (decode steps): every segment on the CUDA-core path, shrink and expand fused."""

    def __init__(self, pool: LoraPool, sgmv: SGMV, seg: SegmentTable, workspace: torch.Tensor | None = None,
                 mma: bool = True):
        self.pool, self.sgmv, self.seg, self.mma = pool, sgmv, seg, mma
        need = seg.num_rows * 3 * pool.max_rank
        if workspace is None or workspace.numel() < need:
            workspace = torch.empty(need, dtype=torch.float32, device=pool.device)
        self.ws = workspace
        self.active = seg.any_adapter
        n, R = seg.num_rows, pool.max_rank
        self.views = {g: workspace[: n * g * R].view(n, g, R) for g in {g for _, g in GROUP_SPANS}}

    def add(self, layer: int, group: int, x: torch.Tensor, ys: tuple[torch.Tensor, ...]) -> None:
        if not self.active:
            return
        v = self.views[GROUP_SPANS[group][1]]
        a, b, ranks, host = self.pool.group_args[layer][group]  # ranks [G, S]
        self.sgmv.add(ys, v, x, a, b, ranks, host, self.seg, self.mma)

"""The per-step segment table that every SGMV call of every layer reuses."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SegmentTable:
    """Rows of the flat batch grouped into segments that share one adapter slot.

    `indptr` / `slots` live on the compute device with a fixed length so a captured CUDA
    graph can replay them: `indptr` is int32 [capacity + 1], `slots` int32 [capacity];
    unused trailing segments are empty (indptr repeats) with slot -1. Segment i covers
    rows `indptr[i]:indptr[i+1]`; slot -1 means "no adapter" and the rows are skipped.
    `host_indptr` / `host_slots` hold only the real segments, for CPU code paths.
    """

    indptr: torch.Tensor  # int32 [capacity + 1]
    slots: torch.Tensor  # int32 [capacity]
    host_indptr: tuple[int, ...]  # [n + 1]
    host_slots: tuple[int, ...]  # [n]
    num_rows: int
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # per-step derived index tensors

    @property
    def num_segments(self) -> int:
        return len(self.host_slots)

    @property
    def any_adapter(self) -> bool:
        return any(s >= 0 for s in self.host_slots)


def merge_runs(row_slots: list[int]) -> tuple[list[int], list[int]]:
    """Runs of equal slots in `row_slots` (one entry per row) -> (indptr [n+1], slots [n])."""
    indptr, slots = [0], []
    for i, s in enumerate(row_slots):
        if slots and slots[-1] == s:
            indptr[-1] = i + 1
        else:
            slots.append(s)
            indptr.append(i + 1)
    return indptr, slots


def build_segments(row_slots: list[int], device: torch.device | str = "cpu", capacity: int | None = None) -> SegmentTable:
    """Merge runs of equal slots in `row_slots` into segments."""
    indptr, slots = merge_runs(row_slots)
    n = len(slots)
    cap = max(n, capacity or n, 1)
    dev_indptr = indptr + [indptr[-1]] * (cap - n)
    dev_slots = slots + [-1] * (cap - n)
    pin = torch.device(device).type == "cuda"
    t_indptr = torch.tensor(dev_indptr, dtype=torch.int32, pin_memory=pin)
    t_slots = torch.tensor(dev_slots, dtype=torch.int32, pin_memory=pin)
    return SegmentTable(
        indptr=t_indptr.to(device, non_blocking=True),
        slots=t_slots.to(device, non_blocking=True),
        host_indptr=tuple(indptr),
        host_slots=tuple(slots),
        num_rows=len(row_slots),
    )

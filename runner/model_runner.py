"""Turns a step plan into one flat batch, runs the model and samples.

Batch layout (Punica §5): prefill tokens first, then decode tokens; within each part rows
are grouped by adapter slot so each adapter is one contiguous segment, and the last
prefill adapter is the first decode adapter when possible (one segment across the seam).
The segment table and attention metadata are built once here and reused by every layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lorafleet.runner.attention.meta import AttnMeta
from lorafleet.runner.lora.segments import SegmentTable, build_segments
from lorafleet.runner.lora.step import LoraStepImpl
from lorafleet.runner.model.llama import LlamaModel
from lorafleet.runner.sampler import sample
from lorafleet.runner.sequence import Sequence


@dataclass
class StepBatch:
    seqs: list[Sequence]  # batch order: prefill then decode
    num_prefill: int
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    logit_rows: torch.Tensor  # int64 [B]
    attn: AttnMeta
    segments: SegmentTable


def order_for_segments(prefill: list[Sequence], decode: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
    """Group each part by adapter slot; put a slot shared by both parts at the seam."""
    pre_slots = {s.slot for s in prefill}
    dec_slots = {s.slot for s in decode}
    shared = sorted(pre_slots & dec_slots)
    seam = shared[0] if shared else None

    def pre_key(s: Sequence):
        return (s.slot == seam, s.slot, s.age_key)

    def dec_key(s: Sequence):
        return (s.slot != seam, s.slot, s.age_key)

    return sorted(prefill, key=pre_key), sorted(decode, key=dec_key)


def build_batch(
    prefill: list[Sequence], decode: list[Sequence], page_size: int, device: torch.device, seg_capacity: int | None = None
) -> StepBatch:
    prefill, decode = order_for_segments(prefill, decode)
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    row_slots: list[int] = []
    qo_indptr = [0]
    kv_lens: list[int] = []
    logit_rows: list[int] = []
    for s in prefill:
        toks = s.all_ids
        n = len(toks)
        ids.extend(toks)
        pos.extend(range(n))
        slots.extend(s.pages[p // page_size] * page_size + p % page_size for p in range(n))
        row_slots.extend([s.slot] * n)
        qo_indptr.append(qo_indptr[-1] + n)
        kv_lens.append(n)
        logit_rows.append(qo_indptr[-1] - 1)
    for s in decode:
        p = s.num_tokens - 1
        ids.append(s.all_ids[-1])
        pos.append(p)
        slots.append(s.pages[p // page_size] * page_size + p % page_size)
        row_slots.append(s.slot)
        qo_indptr.append(qo_indptr[-1] + 1)
        kv_lens.append(p + 1)
        logit_rows.append(qo_indptr[-1] - 1)
    seqs = prefill + decode

    def dev(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)

    meta = AttnMeta(
        num_prefill=len(prefill),
        qo_indptr=qo_indptr,
        kv_lens=kv_lens,
        page_tables=[s.pages for s in seqs],
        page_size=page_size,
        slot_mapping=dev(slots),
    )
    return StepBatch(
        seqs=seqs,
        num_prefill=len(prefill),
        input_ids=dev(ids),
        positions=dev(pos),
        logit_rows=dev(logit_rows),
        attn=meta,
        segments=build_segments(row_slots, device, seg_capacity),
    )


class ModelRunner:
    def __init__(self, model: LlamaModel, attention, lora_pool, sgmv, page_size: int, graphs=None, mixed=None):
        self.model, self.attention = model, attention
        self.lora_pool, self.sgmv = lora_pool, sgmv
        self.page_size = page_size
        self.graphs = graphs  # GraphRunner for decode-only steps on CUDA, or None
        self.mixed = mixed  # PiecewiseGraphs for steps with prefill, or None
        self._workspace: torch.Tensor | None = None
        # Optional wall-clock split of steps for profiling: {"graph"|"eager": [prepare_s, launch_s, wait_s, n]}.
        self.phases: dict[str, list[float]] | None = None

    def run(self, prefill: list[Sequence], decode: list[Sequence]) -> tuple[list[Sequence], list[int]]:
        """One forward over the flat batch; returns (seqs in batch order, next token per seq)."""
        t0 = time.perf_counter() if self.phases is not None else 0.0
        if not prefill and self.graphs is not None and self.graphs.bucket(len(decode)) is not None:
            kind = "graph"
            _, seqs = order_for_segments([], decode)
            t1, logits = self.graphs.run(seqs, self.page_size)
        else:
            cap = self.mixed.max_rows if self.mixed is not None else None  # the static table's capacity
            batch = build_batch(prefill, decode, self.page_size, self.model.device, cap)
            seqs = batch.seqs
            t1 = time.perf_counter() if self.phases is not None else 0.0
            logits = self.mixed.run(batch) if self.mixed is not None else None
            kind = "piecewise"
            if logits is None:
                kind = "eager"
                logits = self.forward(batch)
        t2 = time.perf_counter() if self.phases is not None else 0.0
        tokens = sample(logits, seqs)
        if self.phases is not None:
            acc = self.phases.setdefault(kind, [0.0, 0.0, 0.0, 0])
            t3 = time.perf_counter()
            acc[0] += t1 - t0  # host: batch building, page tables, attention plan
            acc[1] += t2 - t1  # host: kernel launches (graph replay or eager ops)
            acc[2] += t3 - t2  # waiting for the GPU, sampling, device -> host copy
            acc[3] += 1
        return seqs, tokens

    def forward(self, batch: StepBatch) -> torch.Tensor:
        attn_step = self.attention.begin(batch.attn)
        lora = None
        if self.lora_pool is not None and batch.segments.any_adapter:
            lora = LoraStepImpl(self.lora_pool, self.sgmv, batch.segments, self._workspace)
            self._workspace = lora.ws
        return self.model.forward(batch.input_ids, batch.positions, attn_step, lora, batch.logit_rows)

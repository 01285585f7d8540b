"""Decode steps captured in CUDA graphs, one graph of the decoder's layer loop per batch-size bucket.

A decode-only step of B requests replays the graph of the smallest bucket Bp >= B. From the step
batch's device copy, one strided copy fills the static input ids, positions and KV slots, and two
copies the static segment table (capacity = max batch for every bucket); the attention plans take
the batch's page tables. Padded rows write to a reserved scratch page, attend to it, lie outside
every LoRA segment and are never sampled.

`use_graphs=False` runs the same static-buffer plumbing eagerly (no capture), with any attention
backend: the CPU tests of this logic.
"""

from __future__ import annotations

import logging

import torch

from lorafleet.runner.config import KernelChoices
from lorafleet.runner.executor.attention.meta import AttnMeta
from lorafleet.runner.executor.graph_capture import capture
from lorafleet.runner.lora.segments import SegmentTable
from lorafleet.runner.lora.step import LoraStepImpl
from lorafleet.runner.model.decoder import StepIO
from lorafleet.runner.model.rope_kv import FusedKvWriter

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class _Static:
    """One bucket's buffers: the step's rows (B of them) and its segment table at the max batch capacity."""

    def __init__(self, B: int, cap: int, model, max_rank: int):
        i64, i32, dev = torch.int64, torch.int32, model.device
        self.B = B
        self.inputs3 = torch.zeros(3, B, dtype=i64, device=dev)  # input ids, positions, KV slots
        self.io = StepIO.buffers(model.cfg, B, B, model.dtype, dev)
        self.io.input_ids, self.io.positions, self.io.slots = self.inputs3[0], self.inputs3[1], self.inputs3[2]
        self.io.logit_rows = torch.arange(B, dtype=i64, device=dev)
        self.seg_indptr = torch.zeros(cap + 1, dtype=i32, device=dev)
        self.seg_slots = torch.full((cap,), -1, dtype=i32, device=dev)
        self.ws = torch.empty(B * 3 * max(max_rank, 1), dtype=torch.float32, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.attn = None
        self.lora = None


class GraphRunner:
    def __init__(self, model, attention, lora_pool, sgmv, page_size: int, max_batch: int, scratch_page: int,
                 kernels: KernelChoices = KernelChoices(), use_graphs: bool = True):
        self.model, self.attention, self.lora_pool, self.sgmv = model, attention, lora_pool, sgmv
        self.page_size, self.scratch_page, self.kernels = page_size, scratch_page, kernels
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.seg_capacity = max_batch
        self.device = model.device
        self.use_graphs = use_graphs
        # page indices of one plan: every page of the KV pool (the scratch page last) once, plus the scratch
        # page once for each padded row
        self.max_pages = scratch_page + 1 + max_batch
        self.static: dict[int, _Static] = {}
        self.pool = None

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def capture_all(self) -> None:
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        stream = torch.cuda.Stream(self.device) if self.use_graphs else None  # one for all: pool reuse
        for B in sorted(self.buckets, reverse=True):
            self._capture(B, stream)
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _lora_step(self, st: _Static):
        if self.lora_pool is None:
            return None
        seg = SegmentTable(st.seg_indptr, st.seg_slots, (0, st.B), (-1,), st.B)
        # decode: CUDA-core path; the qkv expand inside the fused K/V writer with KernelChoices.rope_kv_lora
        # (not with q/k norms, which must see q and k with their LoRA added)
        in_rope = (self.kernels.rope_kv_lora and isinstance(self.model.kv_write, FusedKvWriter)
                   and getattr(self.sgmv, "name", "") == "cuda" and not self.model.cfg.qk_norm)
        step = LoraStepImpl(self.lora_pool, self.sgmv, seg, st.ws, mma=False, qkv_expand_in_rope=in_rope,
                            kernels=self.kernels)
        step.active = True  # kernels skip slot -1 rows on device; the graph always launches them
        return step

    def _capture(self, B: int, stream) -> None:
        st = _Static(B, self.seg_capacity, self.model, self.lora_pool.max_rank if self.lora_pool else 1)
        st.io.slots.fill_(self.scratch_page * self.page_size)
        st.lora = self._lora_step(st)
        self.static[B] = st
        if not self.use_graphs:
            return
        st.attn = self.attention.graph_step(B, self.max_pages)
        st.attn.plan([[self.scratch_page]] * B, [1] * B)
        run = lambda: self.model.forward(st.io, st.attn, st.lora)  # noqa: E731
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside capture (lazy init, autotuning)
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        capture(g, run, self.pool, stream)
        self.pool = g.pool()
        st.graph = g

    def run(self, batch, d) -> torch.Tensor:
        """Replay for a decode-only step batch and its device copy -> logits [B, V]."""
        n = batch.batch_size
        st = self.static[self.bucket(n)]
        B = st.B
        st.inputs3[:, :n].copy_(d.inputs3)
        if n < B:
            st.io.slots[n:].fill_(self.scratch_page * self.page_size)  # padded rows: the scratch page
        if st.lora is not None:
            if d.seg.indptr.shape[0] != self.seg_capacity + 1:
                raise RuntimeError("decode graphs need the step's segment table at the max batch capacity")
            st.seg_indptr.copy_(d.seg.indptr)
            st.seg_slots.copy_(d.seg.slots)
            # CPU code paths (TorchSGMV) read the host lists of this step's real segments
            st.lora.seg = SegmentTable(st.seg_indptr, st.seg_slots, batch.seg_indptr, batch.seg_slots, n)
        pad = B - n
        page_tables = batch.page_tables + [[self.scratch_page]] * pad
        kv_lens = batch.kv_lens + [1] * pad
        if st.graph is not None:
            st.attn.plan(page_tables, kv_lens)
            st.graph.replay()
            return st.io.logits[:n]
        meta = AttnMeta(num_prefill=0, qo_indptr=list(range(B + 1)), kv_lens=kv_lens, page_tables=page_tables,
                        page_size=self.page_size, slot_mapping=st.io.slots)
        return self.model.forward(st.io, self.attention.begin(meta), st.lora)[:n]

"""Decode steps captured in CUDA graphs, one graph per batch-size bucket.

A decode-only step of B requests replays the graph of the smallest bucket >= B: inputs,
KV slots, page tables (flashinfer's fixed decode buffers) and the LoRA segment table are
copied into static buffers first; padded rows write to a reserved scratch page, attend to
it, and carry no adapter. Prefill and mixed steps run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from lorafleet.runner.attention.flashinfer_backend import GraphDecodeStep
from lorafleet.runner.graph_capture import capture
from lorafleet.runner.lora.segments import SegmentTable, merge_runs
from lorafleet.runner.lora.step import LoraStepImpl

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class _Static:
    def __init__(self, B: int, device, max_rank: int):
        i64, i32 = torch.int64, torch.int32
        self.B = B
        self.input_ids = torch.zeros(B, dtype=i64, device=device)
        self.positions = torch.zeros(B, dtype=i64, device=device)
        self.slot_mapping = torch.zeros(B, dtype=i64, device=device)
        self.logit_rows = torch.arange(B, dtype=i64, device=device)
        self.seg_indptr = torch.zeros(B + 1, dtype=i32, device=device)
        self.seg_slots = torch.full((B,), -1, dtype=i32, device=device)
        self.ws = torch.empty(B * 3 * max(max_rank, 1), dtype=torch.float32, device=device)
        # pinned staging for one host->device copy per step
        self.host = torch.zeros(4 * B + 1, dtype=i64, pin_memory=True)
        self.host_seg = torch.zeros(2 * B + 1, dtype=i32, pin_memory=True)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.wrapper = None


class GraphRunner:
    def __init__(self, model, attention, lora_pool, sgmv, page_size: int, max_batch: int, scratch_page: int):
        self.model, self.attention, self.lora_pool, self.sgmv = model, attention, lora_pool, sgmv
        self.page_size, self.scratch_page = page_size, scratch_page
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        self.device = model.device
        self.max_pages = attention.kv.num_pages
        self.static: dict[int, _Static] = {}
        self.pool = None

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def capture_all(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        stream = torch.cuda.Stream(self.device)  # one for all: the pool reuses blocks only on their stream
        for B in sorted(self.buckets, reverse=True):
            self._capture(B, stream)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _lora_step(self, st: _Static):
        if self.lora_pool is None:
            return None
        seg = SegmentTable(st.seg_indptr, st.seg_slots, (0, st.B), (-1,), st.B)
        step = LoraStepImpl(self.lora_pool, self.sgmv, seg, st.ws)
        step.active = True  # kernels skip slot -1 rows on device; the graph always launches them
        return step

    def _capture(self, B: int, stream: "torch.cuda.Stream") -> None:
        st = _Static(B, self.device, self.lora_pool.max_rank if self.lora_pool else 1)
        st.wrapper = self.attention.make_graph_decoder(B, self.max_pages)
        self.attention.plan_decode(st.wrapper, [[self.scratch_page]] * B, [1] * B)
        scratch = self.scratch_page * self.page_size
        st.slot_mapping.fill_(scratch)
        attn = GraphDecodeStep(self.attention, st.wrapper, st.slot_mapping)
        lora = self._lora_step(st)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside capture (lazy init, autotuning)
                self.model.forward(st.input_ids, st.positions, attn, lora, st.logit_rows)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        st.logits = capture(g, lambda: self.model.forward(st.input_ids, st.positions, attn, lora, st.logit_rows),
                            self.pool, stream)
        self.pool = g.pool()
        st.graph = g
        self.static[B] = st

    def run(self, seqs, page_size: int) -> tuple[float, torch.Tensor]:
        """Replay for decode requests `seqs` (already grouped by adapter) -> (time the replay
        was launched, logits [len(seqs), V])."""
        n = len(seqs)
        st = self.static[self.bucket(n)]
        B = st.B
        scratch = self.scratch_page * page_size
        h = st.host
        ids, pos, slot_map = [0] * B, [0] * B, [scratch] * B
        page_tables, kv_lens, row_slots = [[self.scratch_page]] * B, [1] * B, [-1] * B  # padding rows
        for i, s in enumerate(seqs):
            p = s.num_tokens - 1
            ids[i] = s.output_ids[-1] if s.output_ids else s.prompt_ids[-1]
            pos[i] = p
            slot_map[i] = s.pages[p // page_size] * page_size + p % page_size
            page_tables[i] = s.pages
            kv_lens[i] = p + 1
            row_slots[i] = s.slot
        h[: 3 * B] = torch.tensor(ids + pos + slot_map, dtype=torch.int64)
        dev = h[: 3 * B].to(self.device, non_blocking=True)
        st.input_ids.copy_(dev[:B])
        st.positions.copy_(dev[B : 2 * B])
        st.slot_mapping.copy_(dev[2 * B : 3 * B])
        if self.lora_pool is not None:
            # segments over the padded rows; trailing entries repeat the end, slot -1
            indptr, slots = merge_runs(row_slots)
            hs = st.host_seg
            k = len(slots)
            hs[: k + 1] = torch.tensor(indptr, dtype=torch.int32)
            hs[k + 1 : B + 1] = B
            hs[B + 1 : B + 1 + k] = torch.tensor(slots, dtype=torch.int32)
            hs[B + 1 + k :] = -1
            d = hs.to(self.device, non_blocking=True)
            st.seg_indptr.copy_(d[: B + 1])
            st.seg_slots.copy_(d[B + 1 :])
        self.attention.plan_decode(st.wrapper, page_tables, kv_lens)
        t = time.perf_counter()
        st.graph.replay()
        return t, st.logits[:n]

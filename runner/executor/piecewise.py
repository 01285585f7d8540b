"""Steps with prefill as piecewise CUDA graphs: everything except attention is replayed.

A step of T tokens pads to the smallest bucket Tp >= T and replays the L + 1 graphs captured
for Tp: [embedding + layer 0 up to attention], [layer i-1 after attention + layer i up to
attention] for i = 1..L-1, and [layer L-1 after attention + final norm + lm_head]. Between
them attention runs eagerly over the T real rows (page tables and lengths change every step
and flashinfer plans them on the host), reading q from a static buffer and writing o into one: the
pieces are the decoder's (runner/model/decoder.py), its one layer loop replaying them. The pieces
also rotate q/k and write the step's K/V into the cache, so between pieces only the attention kernels
run. Padded rows compute values nothing reads: they lie outside every LoRA segment, write their K/V
to the scratch page, attention never sees them, and no logit row points at them.

Why: an eager 7B step launches ~600 kernels (plus 256 SGMV launches with LoRA) from Python and
is bound by the host; replayed, a step costs its GPU time plus 32 eager attention calls.
`use_graphs=False` runs the same pieces without capture (the CPU tests of this logic).
"""

from __future__ import annotations

import gc
import logging

import torch

from lorafleet.runner.config import KernelChoices
from lorafleet.runner.executor.graph_capture import capture
from lorafleet.runner.lora.segments import SegmentTable
from lorafleet.runner.lora.step import LoraStepImpl
from lorafleet.runner.model.decoder import StepIO

log = logging.getLogger(__name__)


# Padded step sizes: fine where decode-heavy steps with one or two prompts land, coarser above
# (past 256 tokens padding wastes at most a third of a step, ~12 % on average). Each size costs
# L + 1 graph captures at start, so the list stays short.
BUCKETS = (64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 8192)


def default_buckets(max_tokens: int) -> list[int]:
    """The step sizes below `max_tokens`, then `max_tokens` itself."""
    return [b for b in BUCKETS if b < max_tokens] + [max_tokens]


class _Static:
    """Inputs and cross-piece buffers at the largest bucket; every bucket uses their first rows."""

    def __init__(self, T: int, model, max_rows: int, lora_pool):
        dev = model.device
        self.io = StepIO.buffers(model.cfg, T, max_rows, model.dtype, dev)
        self.seg_indptr = torch.zeros(max_rows + 1, dtype=torch.int32, device=dev)
        self.seg_slots = torch.full((max_rows,), -1, dtype=torch.int32, device=dev)
        self.ws = None
        if lora_pool is not None:
            self.ws = torch.zeros(T * 3 * lora_pool.max_rank, dtype=torch.float32, device=dev)


class _Bucket:
    """One padded token count: views of the static buffers and the captured graphs."""

    def __init__(self, Tp: int, st: _Static, lora_pool, sgmv, kernels: KernelChoices):
        self.Tp = Tp
        self.io = st.io.view(Tp)  # every logit row (one fp32 [max_rows, V] output for every bucket)
        self.seg_indptr, self.seg_slots = st.seg_indptr, st.seg_slots
        self.lora = None
        if lora_pool is not None:
            seg = SegmentTable(self.seg_indptr, self.seg_slots, (0,), (), Tp)
            self.lora = LoraStepImpl(lora_pool, sgmv, seg, st.ws, kernels=kernels)
            self.lora.active = True  # the kernels skip rows of slot -1; a graph always launches them
        self.graphs: list = []


class PiecewiseGraphs:
    def __init__(self, model, attention, lora_pool, sgmv, max_rows: int, buckets: list[int], scratch_slot: int,
                 kernels: KernelChoices = KernelChoices(), use_graphs: bool = True):
        self.model, self.attention = model, attention
        self.max_rows, self.scratch_slot = max_rows, scratch_slot
        self.use_graphs = use_graphs
        self.sizes = sorted(set(buckets))
        self.pool = None
        self.buckets: dict[int, _Bucket] = {}
        self.static = _Static(self.sizes[-1], model, max_rows, lora_pool)
        self.static.io.slots.fill_(scratch_slot)
        # one capture stream for every bucket: the graph pool reuses freed blocks only on their stream
        self.stream = torch.cuda.Stream(model.device) if use_graphs else None
        if use_graphs:
            gc.collect()
            torch.cuda.synchronize(model.device)
            torch.cuda.empty_cache()
        frozen = use_graphs and gc.isenabled()
        if frozen:
            gc.disable()  # no collection (which may destroy a graph) while capturing
        try:
            for Tp in sorted(self.sizes, reverse=True):  # the largest first: later captures reuse its memory
                b = _Bucket(Tp, self.static, lora_pool, sgmv, kernels)
                self._capture(b)
                self.buckets[Tp] = b
        finally:
            if frozen:
                gc.enable()
        if use_graphs:
            torch.cuda.synchronize(model.device)
            torch.cuda.empty_cache()  # the warm-ups' blocks, cached on the capture stream
            log.info("captured piecewise CUDA graphs for %d step sizes up to %d tokens", len(self.sizes),
                     self.sizes[-1])

    def bucket(self, num_tokens: int, num_rows: int, num_segments: int) -> _Bucket | None:
        if num_rows > self.max_rows or num_segments > self.max_rows:
            return None
        for Tp in self.sizes:
            if Tp >= num_tokens:
                return self.buckets[Tp]
        return None

    def _capture(self, b: _Bucket) -> None:
        L = self.model.num_layers
        if not self.use_graphs:
            return
        dev, stream = self.model.device, self.stream
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for j in range(L + 1):  # warm-up outside capture: lazy init, GEMM heuristics for this shape
                self.model.piece(j, b.io, b.lora)
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        with torch.inference_mode():
            for j in range(L + 1):
                g = torch.cuda.CUDAGraph()
                capture(g, lambda: self.model.piece(j, b.io, b.lora), self.pool, stream)
                if self.pool is None:
                    self.pool = g.pool()
                b.graphs.append(g)

    # -- one step -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch, d) -> torch.Tensor | None:
        """Logits [B, V] of a step batch (and its device copy `d`), or None when it fits no bucket
        (run it eagerly). The batch's segment table must have capacity `max_rows`."""
        T, B = batch.num_tokens, batch.batch_size
        seg = d.seg
        b = self.bucket(T, B, seg.num_segments)
        if b is None or seg.slots.shape[0] != self.max_rows:
            return None
        io = b.io
        io.input_ids[:T].copy_(d.input_ids, non_blocking=True)
        io.positions[:T].copy_(d.positions, non_blocking=True)
        io.slots[:T].copy_(d.slot_mapping, non_blocking=True)
        if T < b.Tp:
            io.slots[T:].fill_(self.scratch_slot)  # padded rows write the scratch page
        io.logit_rows[:B].copy_(d.logit_rows, non_blocking=True)
        if B < io.logit_rows.shape[0]:
            io.logit_rows[B:].zero_()  # rows left from a larger step may lie beyond this bucket's Tp
        if b.lora is not None:
            b.seg_indptr.copy_(seg.indptr, non_blocking=True)
            b.seg_slots.copy_(seg.slots, non_blocking=True)
            # the kernels read the static tensors; CPU code paths read the host lists of this step
            b.lora.seg = SegmentTable(b.seg_indptr, b.seg_slots, seg.host_indptr, seg.host_slots, b.Tp)
        io.rows = T  # attention runs over the real rows
        attn = self.attention.begin(d.attn_meta(batch))
        replay = (lambda j: b.graphs[j].replay()) if b.graphs else None
        self.model.forward(io, attn, b.lora, replay=replay)
        return io.logits[:B]

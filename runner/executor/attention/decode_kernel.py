"""The project's decode attention kernel (csrc/decode_attn.cu) for the decode rows of the flashinfer backend
(KernelChoices.decode_kernel = "lorafleet", or "auto" where `preferred`; LORAFLEET_DECODE_KERNEL).

It reads a request's K/V pages once, in bf16 / fp16 or e4m3 (FP8 pages, unit scale), with the model's softmax scale,
score soft-cap and per-layer window, from the page table in flashinfer's CSR form. Nothing is planned on the host:
a step copies its page table to the device and every layer launches once. A request's keys are cut into chunks of
CHUNK tokens (more when it would need more than MAX_CHUNKS), so its bits depend only on its own length; `workers`
CTAs per (request, K/V head) share its chunks and change no bit, nor do `stages` (how many passes ahead each lane's
next K/V rows are copied, through shared memory: 3 or 5; 0 is one pass ahead into registers; one query head per K/V
head only). With stages the kernel is also a programmatic dependent launch: it reads the page table while rope_kv, the
kernel before it, still runs. With `mma` and e4m3 pages it computes q . k and p v on the tensor cores (f16 operands,
fp32 sums; any group of query heads per K/V head, 3 stages): other bits than the CUDA-core kernel's, each request's
still its own.
"""

from __future__ import annotations

import torch

CHUNK = 256  # tokens per chunk
MAX_CHUNKS = 16  # chunks per request at most: longer contexts take longer chunks
# A launch's grid aims at this many CTAs per SM where it has few (request, head) pairs: measured on an H100 (7B shape,
# docs/benchmarks.md §10.18), one worker was fastest at batch 32 (7.8 pairs per SM) and two at batch 8 (1.9 per SM).
CTAS_PER_SM = 4


def workers(num_sms: int, rows: int, kv_heads: int, kv_lens: list[int] | None = None, chunk: int = CHUNK,
            ctas_per_sm: int = CTAS_PER_SM) -> int:
    """CTAs per (request, K/V head) of a launch over `rows` requests: the nearest to `ctas_per_sm` per SM, at most the
    chunks of `chunk` tokens the longest request has (all MAX_CHUNKS where the lengths are not known, as in a CUDA
    graph). A launch shape only: it changes no bit."""
    pairs = max(1, rows * kv_heads)
    want = (num_sms * ctas_per_sm + pairs // 2) // pairs
    most = MAX_CHUNKS if kv_lens is None else min(MAX_CHUNKS, -(-max(kv_lens, default=1) // chunk))
    return max(1, min(want, most))


def preferred(cfg, kv_dtype: torch.dtype) -> bool:
    """Whether `auto` takes the project's kernel: e4m3 pages where each K/V head serves one query head. Measured at the
    7B shape (docs/benchmarks.md 10.19) against flashinfer's decode with e4m3 pages: faster at every context from 128
    to 4,096 tokens on an H100 (1.05-2.1x), on an H200 up to a few hundred tokens (0.89-0.98x at 1,024-4,096, batch
    32), and faster end to end on both (+1.1 to +4.6 %). Slower with bf16 pages (0.67-0.85x) and with 8 query heads per
    K/V head (3-9x, where flashinfer's decode runs on tensor cores); groups of 2 to 7 were not measured."""
    return supported(cfg) and kv_dtype == torch.float8_e4m3fn and cfg.num_heads == cfg.num_kv_heads


def supported(cfg) -> bool:
    """Whether the kernel takes this model's head size and query heads per K/V head."""
    group = cfg.num_heads // cfg.num_kv_heads
    return cfg.head_dim in (64, 128, 256) and 1 <= group <= 8 and cfg.num_heads % cfg.num_kv_heads == 0


class Workspace:
    """The chunks' partial results of up to `rows` requests and the per-(request, K/V head) counters (zero; every
    launch leaves them zero)."""

    def __init__(self, rows: int, heads: int, kv_heads: int, head_dim: int, device: torch.device):
        self.rows = rows
        self.partial_o = torch.empty(rows * heads * MAX_CHUNKS * head_dim, dtype=torch.float32, device=device)
        self.partial_ml = torch.empty(rows * heads * MAX_CHUNKS * 2, dtype=torch.float32, device=device)
        self.counters = torch.zeros(rows * kv_heads, dtype=torch.int32, device=device)


class Tables:
    """A step's page table on the device: indptr [B + 1], indices, last_page_len [B] (int32)."""

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor):
        self.indptr, self.indices, self.last = indptr, indices, last


class LorafleetDecode:
    """The kernel with one model's shapes; the eager steps' workspace grows with their decode rows."""

    def __init__(self, kv, cfg, device: torch.device, choices=None):
        """`choices`: the KernelChoices whose decode_stages, decode_chunk, decode_ctas_per_sm, decode_int_convert and
        decode_mma shape the launches (None: the defaults)."""
        from lorafleet.runner import kernels
        from lorafleet.runner.config import KernelChoices

        c = KernelChoices() if choices is None else choices
        stages, chunk, ctas_per_sm = c.decode_stages, c.decode_chunk, c.decode_ctas_per_sm
        int_convert, mma = c.decode_int_convert, c.decode_mma
        self.ext = kernels.load()
        self.kv, self.device = kv, device
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # the tensor-core kernel: e4m3 pages, any group, 3 stages (its own bits)
        self.mma = mma and kv.k.dtype == torch.float8_e4m3fn
        # (else grouped heads take the register version, the same bits)
        self.stages = 3 if self.mma else stages if self.h == self.hkv else 0
        self.chunk, self.ctas_per_sm = chunk, ctas_per_sm
        # (e4m3 pages with 3 stages only: the bytes to fp32 by integer ops, the same bits)
        self.int_convert = int_convert and not self.mma and self.stages == 3 and kv.k.dtype == torch.float8_e4m3fn
        self.sm_scale, self.soft_cap = cfg.softmax_scale, cfg.attn_softcap or 0.0
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self._eager: Workspace | None = None

    def workspace(self, rows: int) -> Workspace:
        return Workspace(rows, self.h, self.hkv, self.d, self.device)

    def eager_workspace(self, rows: int) -> Workspace:
        if self._eager is None or self._eager.rows < rows:
            self._eager = self.workspace(max(rows, 2 * self._eager.rows if self._eager else rows))
        return self._eager

    def workers(self, rows: int, kv_lens: list[int] | None = None) -> int:
        return workers(self.num_sms, rows, self.hkv, kv_lens, self.chunk, self.ctas_per_sm)

    def tables(self, page_tables, kv_lens) -> Tables:
        """A step's page table, copied to the device on the current stream."""
        from lorafleet.runner.executor.attention.flashinfer_backend import page_table_arrays

        arrays = page_table_arrays(page_tables, kv_lens, self.kv.page_size, pin=True)
        return Tables(*(a.to(self.device, non_blocking=True) for a in arrays))

    def run(self, layer: int, window_left: int, q: torch.Tensor, out: torch.Tensor, tables: Tables, ws: Workspace,
            workers: int) -> None:
        """out [B, Hq, D] = attention of q [B, Hq, D] over layer `layer`'s pages."""
        k, v = self.kv.layer(layer)
        self.ext.decode_attention(out, q.contiguous(), k, v, tables.indptr, tables.indices, tables.last, ws.partial_o,
                                  ws.partial_ml, ws.counters, self.sm_scale, self.soft_cap, window_left, self.chunk,
                                  MAX_CHUNKS, workers, torch.cuda.current_stream(q.device).cuda_stream, self.stages,
                                  self.stages > 0, self.int_convert, self.mma)


class GraphDecodeTables:
    """Decode attention on the project's kernel for a CUDA graph of one batch size: fixed device buffers for the
    page table (`plan` fills them before each replay) and a workspace shared by every graph."""

    def __init__(self, backend, batch_size: int, max_pages: int, ws: Workspace):
        dev = backend.device
        self.b, self.own, self.ws = backend, backend.own, ws
        self.tables = Tables(torch.zeros(batch_size + 1, dtype=torch.int32, device=dev),
                             torch.zeros(max_pages, dtype=torch.int32, device=dev),
                             torch.ones(batch_size, dtype=torch.int32, device=dev))
        self.workers = self.own.workers(batch_size)

    def plan(self, page_tables, kv_lens) -> None:
        from lorafleet.runner.executor.attention.flashinfer_backend import page_table_arrays

        indptr, indices, last = page_table_arrays(page_tables, kv_lens, self.own.kv.page_size, pin=True)
        if indices.numel() > self.tables.indices.numel():
            raise ValueError(f"decode graph: {indices.numel()} pages exceed the captured {self.tables.indices.numel()}")
        self.tables.indptr.copy_(indptr, non_blocking=True)
        self.tables.indices[: indices.numel()].copy_(indices, non_blocking=True)
        self.tables.last.copy_(last, non_blocking=True)

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        T = q.shape[0]
        b = self.b
        out = torch.empty(T, b.h, b.d, dtype=q.dtype, device=q.device) if out is None else out.view(T, b.h, b.d)
        self.own.run(layer, b.layer_window[layer], q, out, self.tables, self.ws, self.workers)
        return out.view(T, b.h * b.d)

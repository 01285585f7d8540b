"""Paged attention through flashinfer's batch prefill and decode kernels (CUDA).

Per step: prefill requests (the first `num_prefill` of the batch) go through
`BatchPrefillWithPagedKVCacheWrapper` (causal), decode requests through
`BatchDecodeWithPagedKVCacheWrapper`; both are planned once per step and run per layer. On sm90 there
are two prefill wrappers, FA2 and FA3, and each step's prompt rows take the one `meta.prefill_kernel`
picks (FA2 for chunks too short to fill the card under FA3's plan); LORAFLEET_PREFILL_BACKEND=fa2 or
fa3 forces one.
K/V of the step's tokens are written into the page pool before attention.

Plans are made on the host while the device may still run the previous step (overlapped
scheduling). flashinfer stages each plan in a pinned host buffer of its wrapper and copies it to the
device asynchronously, so a plan waits until the device has consumed the copy of the same wrapper's
previous plan (an event recorded right after it) before it overwrites that buffer. The events are per
wrapper: with one event for all, a step's second plan (prompt rows, then decode rows) waited for the
first one's copy, queued behind the whole step in flight, and the host idled for a step.

With `decode_kernel="lorafleet"` (and with "auto", the default, for e4m3 pages without grouped heads:
decode_kernel.preferred) the decode rows take the project's own kernel instead (decode_kernel.py), where it takes the
model's head shapes: nothing is planned for them, the step's page table is copied to the device once.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

import flashinfer  # noqa: F401  (ImportError here makes select.py fall back to torch)
from flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper

from lorafleet.runner.executor.attention import decode_kernel
from lorafleet.runner.executor.attention.meta import AttnMeta, prefill_kernel
from lorafleet.runner.executor.kv_cache import KVCache

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 256 << 20
FA3_HEAD_DIMS = (64, 128, 256)  # head sizes flashinfer's FA3 prefill is built for


def page_table_arrays(page_tables: list[list[int]], kv_lens: list[int], page_size: int, pin: bool = False):
    """CSR page table (indptr, indices, last_page_len) as int32 CPU tensors (page-locked with `pin`, so
    their copies to the device are asynchronous)."""
    indptr, indices, last = [0], [], []
    for pages, n in zip(page_tables, kv_lens):
        used = -(-n // page_size)
        indices.extend(pages[:used])
        indptr.append(indptr[-1] + used)
        last.append(n - (used - 1) * page_size)
    return tuple(torch.tensor(a, dtype=torch.int32, pin_memory=pin) for a in (indptr, indices, last))


class _Wrappers:
    """The eager wrappers of one attention window (flashinfer plans a window into the kernel): prefill (FA2
    and, on sm90 with auto, FA3) and decode. Windows share the workspaces (their runs never overlap)."""

    def __init__(self, b: "FlashInferAttention", window_left: int, ws: dict):
        self.window_left = window_left
        self.prefill = {name: BatchPrefillWithPagedKVCacheWrapper(ws[name], "NHD", backend=name)
                        for name in b.prefill_kinds}
        self.decode = BatchDecodeWithPagedKVCacheWrapper(ws["decode"], "NHD", use_tensor_cores=b.decode_tc)


class FlashInferAttention:
    """flashinfer's paged attention for a model: per distinct attention window of its layers one set of
    wrappers; the model's softmax scale and score soft-cap in every plan. `kernels` (KernelChoices): the project's
    decode kernel's launch choices where it takes the decode rows (decode_kernel.LorafleetDecode)."""

    name = "flashinfer"

    def __init__(self, kv: KVCache, cfg, device: torch.device, prefill_choice: str = "auto",
                 q_dtype: torch.dtype | None = None, decode_tc: str = "auto", decode_kernel_choice: str = "auto",
                 decode_no_split: bool = False, kernels=None):
        self.kv, self.cfg, self.device = kv, cfg, device
        self.q_dtype = q_dtype or kv.k.dtype  # FP8 pages: queries stay in the model's dtype
        self.kv_dtype = kv.k.dtype
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sm_scale, self.soft_cap = cfg.softmax_scale, cfg.attn_softcap or 0.0
        # decode on tensor cores (flashinfer's prefill kernel) where >= 4 query heads share a K/V head, or as told
        self.decode_tc = {"1": True, "0": False}.get(decode_tc, self.h // self.hkv >= 4)
        # every request's K/V one chunk in the decode plans (KernelChoices.decode_no_split): its attention then does not
        # depend on the other requests of the step (flashinfer takes this for its tensor-core decode only)
        if decode_no_split and not self.decode_tc:
            raise ValueError("decode_no_split takes flashinfer's tensor-core decode (decode_tc 1)")
        self.decode_no_split = decode_no_split
        sm90 = torch.cuda.get_device_capability(device)[0] == 9
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        fp8_pages = self.kv_dtype != self.q_dtype
        if fp8_pages and prefill_choice == "fa3":
            raise ValueError("flashinfer's FA3 prefill takes FP8 K/V pages only with FP8 queries: use fa2 or auto")
        if fp8_pages:  # FA2 named: flashinfer's own auto picks FA3 on sm90, whose build fails for bf16 q + e4m3 K/V
            self.prefill_kinds = ("fa2",)
        elif prefill_choice == "auto" and sm90 and self.d in FA3_HEAD_DIMS:  # per step, meta.prefill_kernel
            self.prefill_kinds = ("fa2", "fa3")
        else:  # forced, or FA3 cannot run (not sm90, or a head size it lacks): flashinfer's auto is FA2 then
            self.prefill_kinds = (prefill_choice,)
        ws = {k: torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
              for k in (*self.prefill_kinds, "decode")}
        # window W (a query sees its last W keys) -> flashinfer's window_left W - 1; -1: full attention
        self.layer_window = [-1 if w is None else w - 1 for w in cfg.layer_window]
        self.sets = {wl: _Wrappers(self, wl, ws) for wl in sorted(set(self.layer_window))}
        self.layer_set = [self.sets[wl] for wl in self.layer_window]
        self._planned: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> recorded after its last plan's copies
        self.graph_ws: torch.Tensor | None = None
        self.own: decode_kernel.LorafleetDecode | None = None  # the project's decode kernel, when chosen and able
        self.own_graph_ws: decode_kernel.Workspace | None = None
        if decode_kernel_choice == "auto" and decode_kernel.preferred(cfg, self.kv_dtype):
            decode_kernel_choice = "lorafleet"
        if decode_kernel_choice == "lorafleet":
            if decode_kernel.supported(cfg):
                self.own = decode_kernel.LorafleetDecode(kv, cfg, device, kernels)
                log.info("decode rows on the lorafleet decode attention kernel (%s pages%s%s)",
                         str(self.kv_dtype)[6:], f", {self.own.stages} stages" if self.own.stages else "",
                         ", tensor cores" if self.own.mma else "")
                if self.h // self.hkv >= 8 and not self.own.mma:
                    log.warning("the lorafleet decode kernel was measured 3-9x slower than flashinfer's tensor-core "
                                "decode with 8 query heads per K/V head (docs/benchmarks.md 10.18); this model has %d",
                                self.h // self.hkv)
            else:
                log.warning("the lorafleet decode kernel takes head sizes 64, 128, 256 with at most 8 query heads per "
                            "K/V head, not %d with %d: decode rows stay on flashinfer's", self.d, self.h // self.hkv)
        self.warm_up()

    @contextmanager
    def planning(self, wrapper):
        """Around a wrapper's plan call: wait for its previous plan's staged copies, then mark this one's."""
        ev = self._planned.get(id(wrapper))
        if ev is not None:
            ev.synchronize()
        yield
        ev = torch.cuda.Event()
        ev.record()
        self._planned[id(wrapper)] = ev

    def plan_prefill(self, wrapper, window_left: int, qo_indptr: list[int], page_tables, kv_lens) -> None:
        """Plan a prefill wrapper for requests with these query row offsets, pages and KV lengths."""
        indptr, indices, last = page_table_arrays(page_tables, kv_lens, self.kv.page_size, pin=True)
        qo = torch.tensor(qo_indptr, dtype=torch.int32, pin_memory=True)
        with self.planning(wrapper):
            wrapper.plan(qo, indptr, indices, last, self.h, self.hkv, self.d, self.kv.page_size, causal=True,
                         q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, sm_scale=self.sm_scale,
                         window_left=window_left, logits_soft_cap=self.soft_cap)

    def plan_decode(self, wrapper, window_left: int, page_tables, kv_lens, indices_on_device: bool = False) -> None:
        indptr, indices, last = page_table_arrays(page_tables, kv_lens, self.kv.page_size, pin=True)
        if indices_on_device:
            # A CUDA-graph wrapper copies host page indices into its buffer synchronously (the host
            # would wait for the step in flight); indices already on the device are copied on the stream.
            indices = indices.to(self.device, non_blocking=True)
        with self.planning(wrapper):
            wrapper.plan(indptr, indices, last, self.h, self.hkv, self.d, self.kv.page_size,
                         q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, sm_scale=self.sm_scale,
                         window_left=window_left, logits_soft_cap=self.soft_cap,
                         **({"disable_split_kv": True} if self.decode_no_split else {}))

    def warm_up(self) -> None:
        """Run every kernel variant the eager wrappers can pick once, at start: FA2's CTA tiles of 16, 64
        and 128 packed query rows, each with a short and a long K/V (a long one splits the K/V and adds
        the merge kernel), the same shapes through FA3, and the decode kernel with and without a split,
        for every window. CUDA loads kernels lazily, and the first launch of one waits for the work in
        flight: measured on the H200, a step with a prompt chunk queued behind a 0.5 s kernel waited for all
        of it when its FA2 plan picked a variant not run before (with CUDA_MODULE_LOADING=EAGER it did not)."""
        ps, cap = self.kv.page_size, self.kv.num_pages * self.kv.page_size
        group = max(1, self.h // self.hkv)
        long_kv = min(2048, cap)
        cache = self.kv.layer(0)
        for ws in self.sets.values():
            for packed in (8, 32, 100):  # FA2's tile choice: <= 16, <= 64, > 64 packed rows
                rows = -(-packed // group)
                for kv in sorted({rows, long_kv}):
                    if kv < rows or kv > cap:
                        continue
                    q = torch.zeros(rows, self.h, self.d, dtype=self.q_dtype, device=self.device)
                    for wrapper in ws.prefill.values():
                        self.plan_prefill(wrapper, ws.window_left, [0, rows], [list(range(-(-kv // ps)))], [kv])
                        wrapper.run(q, cache)
            for kv in sorted({1, long_kv}):
                q = torch.zeros(1, self.h, self.d, dtype=self.q_dtype, device=self.device)
                if self.own is not None:
                    tables = self.own.tables([list(range(-(-kv // ps)))], [kv])
                    self.own.run(0, ws.window_left, q, torch.empty_like(q), tables, self.own.eager_workspace(1), 1)
                    continue
                self.plan_decode(ws.decode, ws.window_left, [list(range(-(-kv // ps)))], [kv])
                ws.decode.run(q, cache)
        torch.cuda.synchronize(self.device)

    def prefill_kind(self, qo_lens: list[int]) -> str:
        """The prefill kernel for a step's prompt rows of these lengths."""
        if len(self.prefill_kinds) == 1:
            return self.prefill_kinds[0]
        return prefill_kernel(qo_lens, self.h, self.d, self.num_sms)

    def begin(self, meta: AttnMeta) -> "FlashInferStep":
        return FlashInferStep(self, meta)

    def graph_step(self, batch_size: int, max_pages: int):
        """Decode attention for a CUDA graph of one batch size (its page tables of at most `max_pages` pages):
        `plan(page_tables, kv_lens)` before each replay, `attend` inside the captured forward."""
        if self.own is None:
            return GraphDecodeStep(self, self.make_graph_decoders(batch_size, max_pages))
        if self.own_graph_ws is None or self.own_graph_ws.rows < batch_size:  # graphs replay one at a time: one for all
            self.own_graph_ws = self.own.workspace(batch_size)
        return decode_kernel.GraphDecodeTables(self, batch_size, max_pages, self.own_graph_ws)

    def make_graph_decoders(self, batch_size: int, max_pages: int) -> dict[int, BatchDecodeWithPagedKVCacheWrapper]:
        """Per window, a decode wrapper with fixed buffers, for CUDA-graph capture at one batch size. Every
        graph wrapper shares one float workspace: graphs replay one after another on one stream, so their
        runs never overlap (each wrapper keeps its own plan buffers)."""
        if self.graph_ws is None:
            self.graph_ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        ws = self.graph_ws
        out = {}
        for wl in self.sets:
            out[wl] = BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tc,
                paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=self.device),
                paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=self.device),
            )
        return out


class FlashInferStep:
    def __init__(self, b: FlashInferAttention, meta: AttnMeta):
        self.b, self.meta = b, meta
        P = meta.num_prefill
        self.num_prefill_tokens = meta.qo_indptr[P]
        # Decode rows always take the decode kernel, also in steps with prompt rows, so a request's
        # tokens do not depend on what else shares its step (running every row through the prefill
        # kernel saved a host call per layer but made decode rows batch-dependent).
        self.prefill_kernel = None
        self.num_decode = meta.batch_size - P
        if P:
            lens = [meta.qo_indptr[i + 1] - meta.qo_indptr[i] for i in range(P)]
            self.prefill_kernel = b.prefill_kind(lens)
        self.own_tables = None
        if self.num_decode and b.own is not None:
            self.own_tables = b.own.tables(meta.page_tables[P:], meta.kv_lens[P:])
            self.own_ws = b.own.eager_workspace(self.num_decode)
            self.own_workers = b.own.workers(self.num_decode, meta.kv_lens[P:])
        for ws in b.sets.values():
            if P:
                b.plan_prefill(ws.prefill[self.prefill_kernel], ws.window_left, meta.qo_indptr[: P + 1],
                               meta.page_tables[:P], meta.kv_lens[:P])
            if self.num_decode and self.own_tables is None:
                b.plan_decode(ws.decode, ws.window_left, meta.page_tables[P:], meta.kv_lens[P:])

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the cache, whose K/V for this step's tokens are written."""
        b = self.b
        ws = b.layer_set[layer]
        cache = b.kv.layer(layer)
        T = q.shape[0]
        n = self.num_prefill_tokens
        out = torch.empty(T, b.h, b.d, dtype=q.dtype, device=q.device) if out is None else out.view(T, b.h, b.d)
        if n:
            ws.prefill[self.prefill_kernel].run(q[:n], cache, out=out[:n])
        if self.own_tables is not None:
            b.own.run(layer, ws.window_left, q[n:], out[n:], self.own_tables, self.own_ws, self.own_workers)
        elif self.num_decode:
            ws.decode.run(q[n:], cache, out=out[n:])
        return out.view(T, b.h * b.d)


class GraphDecodeStep:
    """Decode-only attention through the fixed-buffer wrappers of one batch size (captured in a CUDA graph;
    `plan` runs before each replay)."""

    def __init__(self, b: FlashInferAttention, wrappers: dict):
        self.b, self.wrappers = b, wrappers
        self.layer_wrapper = [wrappers[wl] for wl in b.layer_window]

    def plan(self, page_tables, kv_lens) -> None:
        for wl, w in self.wrappers.items():
            self.b.plan_decode(w, wl, page_tables, kv_lens, indices_on_device=True)

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        T = q.shape[0]
        res = self.layer_wrapper[layer].run(q, self.b.kv.layer(layer),
                                            out=None if out is None else out.view(T, self.b.h, self.b.d))
        return res.view(T, self.b.h * self.b.d)

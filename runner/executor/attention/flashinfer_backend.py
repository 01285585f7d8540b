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
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

import flashinfer  # noqa: F401  (ImportError here makes select.py fall back to torch)
from flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper

from lorafleet import env
from lorafleet.runner.executor.attention.meta import AttnMeta, prefill_kernel
from lorafleet.runner.executor.kv_cache import KVCache

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


def write_kv(cache: KVCache, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    k_flat, v_flat = cache.flat(layer)
    k_flat.index_copy_(0, slot_mapping, k)
    v_flat.index_copy_(0, slot_mapping, v)


class FlashInferAttention:
    name = "flashinfer"

    def __init__(self, kv: KVCache, cfg, device: torch.device, engine_cfg=None):
        self.kv, self.cfg, self.device = kv, cfg, device
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        ws_p = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        ws_d = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        choice = env.prefill_backend()
        sm90 = torch.cuda.get_device_capability(device)[0] == 9
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        if choice == "auto" and sm90 and self.d in FA3_HEAD_DIMS:  # per step the one meta.prefill_kernel picks
            ws_p2 = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self.prefill_wrappers = {"fa2": BatchPrefillWithPagedKVCacheWrapper(ws_p, "NHD", backend="fa2"),
                                     "fa3": BatchPrefillWithPagedKVCacheWrapper(ws_p2, "NHD", backend="fa3")}
        else:  # forced, or FA3 cannot run (not sm90, or a head size it lacks): flashinfer's auto is FA2 then
            self.prefill_wrappers = {choice: BatchPrefillWithPagedKVCacheWrapper(ws_p, "NHD", backend=choice)}
        self.decode = BatchDecodeWithPagedKVCacheWrapper(ws_d, "NHD", use_tensor_cores=self.h // self.hkv >= 4)
        self._planned: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> recorded after its last plan's copies
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

    def plan_prefill(self, wrapper, qo_indptr: list[int], page_tables, kv_lens) -> None:
        """Plan a prefill wrapper for requests with these query row offsets, pages and KV lengths."""
        indptr, indices, last = page_table_arrays(page_tables, kv_lens, self.kv.page_size, pin=True)
        qo = torch.tensor(qo_indptr, dtype=torch.int32, pin_memory=True)
        dt = self.kv.k.dtype
        with self.planning(wrapper):
            wrapper.plan(qo, indptr, indices, last, self.h, self.hkv, self.d, self.kv.page_size, causal=True,
                         q_data_type=dt, kv_data_type=dt)

    def warm_up(self) -> None:
        """Run every kernel variant the eager wrappers can pick once, at start: FA2's CTA tiles of 16, 64
        and 128 packed query rows, each with a short and a long K/V (a long one splits the K/V and adds
        the merge kernel), the same shapes through FA3, and the decode kernel with and without a split.
        CUDA loads kernels lazily, and the first launch of one waits for the work in flight: measured on
        the H200, a step with a prompt chunk queued behind a 0.5 s kernel waited for all of it when its
        FA2 plan picked a variant not run before (with CUDA_MODULE_LOADING=EAGER it did not)."""
        ps, cap = self.kv.page_size, self.kv.num_pages * self.kv.page_size
        group = max(1, self.h // self.hkv)
        long_kv = min(2048, cap)
        cache = self.kv.layer(0)
        for packed in (8, 32, 100):  # FA2's tile choice: <= 16, <= 64, > 64 packed rows
            rows = -(-packed // group)
            for kv in sorted({rows, long_kv}):
                if kv < rows or kv > cap:
                    continue
                q = torch.zeros(rows, self.h, self.d, dtype=self.kv.k.dtype, device=self.device)
                for wrapper in self.prefill_wrappers.values():
                    self.plan_prefill(wrapper, [0, rows], [list(range(-(-kv // ps)))], [kv])
                    wrapper.run(q, cache)
        for kv in sorted({1, long_kv}):
            self.plan_decode(self.decode, [list(range(-(-kv // ps)))], [kv])
            self.decode.run(torch.zeros(1, self.h, self.d, dtype=self.kv.k.dtype, device=self.device), cache)
        torch.cuda.synchronize(self.device)

    def prefill_for(self, qo_lens: list[int]):
        """(kernel name, wrapper) for a step's prompt rows of these lengths."""
        if len(self.prefill_wrappers) == 1:
            return next(iter(self.prefill_wrappers.items()))
        name = prefill_kernel(qo_lens, self.h, self.d, self.num_sms)
        return name, self.prefill_wrappers[name]

    def begin(self, meta: AttnMeta) -> "FlashInferStep":
        return FlashInferStep(self, meta)

    def make_graph_decoder(self, batch_size: int, max_pages: int) -> BatchDecodeWithPagedKVCacheWrapper:
        """A decode wrapper with fixed buffers, for CUDA-graph capture at one batch size."""
        ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=self.h // self.hkv >= 4,
            paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device),
            paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=self.device),
            paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=self.device),
        )

    def plan_decode(self, wrapper, page_tables, kv_lens) -> None:
        indptr, indices, last = page_table_arrays(page_tables, kv_lens, self.kv.page_size, pin=True)
        if wrapper is not self.decode:
            # A CUDA-graph wrapper copies host page indices into its buffer synchronously (the host
            # would wait for the step in flight); indices already on the device are copied on the stream.
            indices = indices.to(self.device, non_blocking=True)
        with self.planning(wrapper):
            wrapper.plan(indptr, indices, last, self.h, self.hkv, self.d, self.kv.page_size,
                         q_data_type=self.kv.k.dtype, kv_data_type=self.kv.k.dtype)


class FlashInferStep:
    def __init__(self, b: FlashInferAttention, meta: AttnMeta):
        self.b, self.meta = b, meta
        P = meta.num_prefill
        self.num_prefill_tokens = meta.qo_indptr[P]
        # Decode rows always take the decode kernel, also in steps with prompt rows, so a request's
        # tokens do not depend on what else shares its step (running every row through the prefill
        # kernel saved a host call per layer but made decode rows batch-dependent).
        self.prefill_kernel, self.prefill = None, None
        if P:
            lens = [meta.qo_indptr[i + 1] - meta.qo_indptr[i] for i in range(P)]
            self.prefill_kernel, self.prefill = b.prefill_for(lens)
            b.plan_prefill(self.prefill, meta.qo_indptr[: P + 1], meta.page_tables[:P], meta.kv_lens[:P])
        self.num_decode = meta.batch_size - P
        if self.num_decode:
            b.plan_decode(b.decode, meta.page_tables[P:], meta.kv_lens[P:])

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(self.b.kv, layer, self.meta.slot_mapping, k, v)
        return self.attend(layer, q, out)

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q [T, Hq, D] over the cache, whose K/V for this step's tokens are written."""
        b = self.b
        cache = b.kv.layer(layer)
        T = q.shape[0]
        n = self.num_prefill_tokens
        out = torch.empty(T, b.h, b.d, dtype=q.dtype, device=q.device) if out is None else out.view(T, b.h, b.d)
        if n:
            self.prefill.run(q[:n], cache, out=out[:n])
        if self.num_decode:
            b.decode.run(q[n:], cache, out=out[n:])
        return out.view(T, b.h * b.d)


class GraphDecodeStep:
    """Decode-only attention bound to static buffers, for capture and replay in a CUDA graph.
    With `rope_kv` (runner/model/rope_kv.py) it also offers `attend_qkv`: the model hands over the raw
    qkv rows, and RoPE plus the cache write are one launch into a static q buffer."""

    def __init__(self, b: FlashInferAttention, wrapper, slot_mapping: torch.Tensor, rope_kv=None):
        self.b, self.wrapper, self.slot_mapping = b, wrapper, slot_mapping
        if rope_kv is not None:
            self.rope_kv = rope_kv
            self.q = torch.empty(slot_mapping.shape[0], b.h, b.d, dtype=b.kv.k.dtype, device=b.device)
            self.attend_qkv = self._attend_qkv

    def _attend_qkv(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, lora_expand=None) -> torch.Tensor:
        """`lora_expand`: the qkv rows' LoRA expand left to the rope_kv kernel (LoraStepImpl.add_qkv)."""
        k_flat, v_flat = self.b.kv.flat(layer)
        q = self.rope_kv(self.q[: qkv.shape[0]], k_flat, v_flat, qkv, positions, self.slot_mapping, lora_expand)
        return self.wrapper.run(q, self.b.kv.layer(layer)).view(qkv.shape[0], self.b.h * self.b.d)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_kv(self.b.kv, layer, self.slot_mapping, k, v)
        return self.wrapper.run(q, self.b.kv.layer(layer)).view(q.shape[0], self.b.h * self.b.d)

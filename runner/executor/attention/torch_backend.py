"""Plain-torch paged attention: the CPU path and the reference for the CUDA one."""

from __future__ import annotations

import math

import torch

from lorafleet.runner.executor.attention.meta import AttnMeta
from lorafleet.runner.executor.kv_cache import KVCache


class TorchAttention:
    """Writes each step's K/V into pages, then attends per request over its pages.

    Prefill requests attend causally over their whole KV (query i sees keys up to
    kv_len - q_len + i); decode requests are batched with one padded gather.
    """

    name = "torch"

    def __init__(self, cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int):
        self.cache = cache
        self.h, self.hkv, self.d = num_heads, num_kv_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    def begin(self, meta: AttnMeta) -> "TorchAttentionStep":
        return TorchAttentionStep(self, meta)


class TorchAttentionStep:
    def __init__(self, backend: TorchAttention, meta: AttnMeta):
        self.b, self.meta = backend, meta
        dev = meta.slot_mapping.device
        ps = meta.page_size

        def slots(i: int) -> torch.Tensor:
            n = meta.kv_lens[i]
            pages = torch.tensor(meta.page_tables[i], dtype=torch.int64)
            pos = torch.arange(n)
            return pages[pos // ps] * ps + pos % ps

        self.prefill_slots = [slots(i).to(dev) for i in range(meta.num_prefill)]
        dec = range(meta.num_prefill, meta.batch_size)
        self.num_decode = len(dec)
        if self.num_decode:
            max_len = max(meta.kv_lens[i] for i in dec)
            idx = torch.zeros(self.num_decode, max_len, dtype=torch.int64)
            mask = torch.ones(self.num_decode, max_len, dtype=torch.bool)
            for j, i in enumerate(dec):
                s = slots(i)
                idx[j, : len(s)] = s
                mask[j, : len(s)] = False
            self.dec_idx, self.dec_mask = idx.to(dev), mask.to(dev)  # [Bd, L], True = padding
            self.dec_row0 = meta.qo_indptr[meta.num_prefill]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        b, meta = self.b, self.meta
        k_flat, v_flat = b.cache.flat(layer)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)
        T = q.shape[0]
        g = b.h // b.hkv
        out = torch.empty(T, b.h, b.d, dtype=q.dtype, device=q.device) if out is None else out.view(T, b.h, b.d)
        for i, s in enumerate(self.prefill_slots):
            lo, hi = meta.qo_indptr[i], meta.qo_indptr[i + 1]
            n, kv_len = hi - lo, len(s)
            qi = q[lo:hi].float().view(n, b.hkv, g, b.d)  # [n, Hkv, G, D]
            ki, vi = k_flat[s].float(), v_flat[s].float()  # [L, Hkv, D]
            scores = torch.einsum("nhgd,lhd->hgnl", qi, ki) * b.scale  # [Hkv, G, n, L]
            causal = torch.arange(kv_len, device=q.device)[None, :] > (
                torch.arange(n, device=q.device)[:, None] + (kv_len - n)
            )
            scores.masked_fill_(causal, float("-inf"))
            p = scores.softmax(-1)
            out[lo:hi] = torch.einsum("hgnl,lhd->nhgd", p, vi).reshape(n, b.h, b.d).to(q.dtype)
        if self.num_decode:
            r0 = self.dec_row0
            qd = q[r0:].float().view(self.num_decode, b.hkv, g, b.d)  # [Bd, Hkv, G, D]
            kd, vd = k_flat[self.dec_idx].float(), v_flat[self.dec_idx].float()  # [Bd, L, Hkv, D]
            scores = torch.einsum("bhgd,blhd->bhgl", qd, kd) * b.scale
            scores.masked_fill_(self.dec_mask[:, None, None, :], float("-inf"))
            p = scores.softmax(-1)
            out[r0:] = torch.einsum("bhgl,blhd->bhgd", p, vd).reshape(self.num_decode, b.h, b.d).to(q.dtype)
        return out.view(T, b.h * b.d)

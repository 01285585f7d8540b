"""Plain-torch paged attention: the CPU path and the reference for the CUDA one."""

from __future__ import annotations

import torch

from lorafleet.models.contract import ModelConfig
from lorafleet.runner.executor.attention.meta import AttnMeta
from lorafleet.runner.executor.kv_cache import KVCache


def gather(pages: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Token slots `idx` of a layer's pages as fp32 (FP8 pages gathered as bytes: torch indexes no float8)."""
    if pages.element_size() == 1 and pages.is_floating_point():
        return pages.view(torch.uint8)[idx].view(pages.dtype).float()
    return pages[idx].float()


class TorchAttention:
    """Attends per request over its pages (the step's K/V are written before, by the layer's K/V writer).

    Prefill requests attend causally over their whole KV (query i sees keys up to kv_len - q_len + i);
    decode requests are batched with one padded gather. A layer with a window W sees only the last W keys
    (key j for query i when i - W < j); the softmax scale and an optional score soft-cap come from the config.
    """

    name = "torch"

    def __init__(self, cache: KVCache, cfg: ModelConfig):
        self.cache, self.cfg = cache, cfg
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.softmax_scale

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
            # padding gathers slot 0, another request's: its V must not reach this row even as 0 x NaN
            self.dec_padded = bool(mask.any())
            # key position of each gathered column, and the query's own position (kv_len - 1)
            self.dec_pos = torch.arange(max_len, device=dev)[None, :]
            self.dec_qpos = torch.tensor([meta.kv_lens[i] - 1 for i in dec], device=dev)[:, None]
            self.dec_row0 = meta.qo_indptr[meta.num_prefill]
        self._window_masks: dict[int, torch.Tensor] = {}

    def _scores(self, scores: torch.Tensor) -> torch.Tensor:
        cap = self.b.cfg.attn_softcap
        scores = scores * self.b.scale
        return torch.tanh(scores / cap) * cap if cap is not None else scores

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D] -> out [T, Hq * D] over the cache (this step's K/V already written)."""
        b, meta = self.b, self.meta
        window = b.cfg.layer_window[layer]
        k_flat, v_flat = b.cache.flat(layer)
        T = q.shape[0]
        g = b.h // b.hkv
        out = torch.empty(T, b.h, b.d, dtype=q.dtype, device=q.device) if out is None else out.view(T, b.h, b.d)
        for i, s in enumerate(self.prefill_slots):
            lo, hi = meta.qo_indptr[i], meta.qo_indptr[i + 1]
            n, kv_len = hi - lo, len(s)
            qi = q[lo:hi].float().view(n, b.hkv, g, b.d)  # [n, Hkv, G, D]
            ki, vi = gather(k_flat, s), gather(v_flat, s)  # fp32 [L, Hkv, D]
            scores = self._scores(torch.einsum("nhgd,lhd->hgnl", qi, ki))  # [Hkv, G, n, L]
            kpos = torch.arange(kv_len, device=q.device)[None, :]
            qpos = torch.arange(n, device=q.device)[:, None] + (kv_len - n)
            hidden = kpos > qpos
            if window is not None:
                hidden |= kpos <= qpos - window
            scores.masked_fill_(hidden, float("-inf"))
            p = scores.softmax(-1)
            out[lo:hi] = torch.einsum("hgnl,lhd->nhgd", p, vi).reshape(n, b.h, b.d).to(q.dtype)
        if self.num_decode:
            r0 = self.dec_row0
            qd = q[r0:].float().view(self.num_decode, b.hkv, g, b.d)  # [Bd, Hkv, G, D]
            kd, vd = gather(k_flat, self.dec_idx), gather(v_flat, self.dec_idx)  # fp32 [Bd, L, Hkv, D]
            if self.dec_padded:
                vd = vd.masked_fill(self.dec_mask[:, :, None, None], 0.0)
            scores = self._scores(torch.einsum("bhgd,blhd->bhgl", qd, kd))
            mask = self.dec_mask
            if window is not None:
                wm = self._window_masks.get(window)
                if wm is None:
                    wm = self._window_masks[window] = mask | (self.dec_pos <= self.dec_qpos - window)
                mask = wm
            scores.masked_fill_(mask[:, None, None, :], float("-inf"))
            p = scores.softmax(-1)
            out[r0:] = torch.einsum("bhgl,blhd->bhgd", p, vd).reshape(self.num_decode, b.h, b.d).to(q.dtype)
        return out.view(T, b.h * b.d)

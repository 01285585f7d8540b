"""The torch attention's decode rows are padded to the longest request of the step with slot 0, which belongs to some
other request (or to a freed page that still holds what its last owner wrote). A NaN there once reached every
shorter row as 0 x NaN; each row must see nothing but its own keys."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from lorafleet.runner.executor.attention.meta import AttnMeta
from lorafleet.runner.executor.attention.torch_backend import TorchAttention
from lorafleet.runner.executor.kv_cache import KVCache


def test_padded_decode_rows_ignore_a_nan_in_slot_zero():
    H, Hkv, D, ps = 4, 2, 8, 4
    cfg = SimpleNamespace(num_layers=1, num_heads=H, num_kv_heads=Hkv, head_dim=D, kv_dim=Hkv * D, softmax_scale=0.3,
                          attn_softcap=None, layer_window=[None])
    kv = KVCache(cfg, num_pages=8, page_size=ps, dtype=torch.float32, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    kv.k[0, 0, 0] = float("nan")  # page 0, slot 0: no request of this step owns it
    kv.v[0, 0, 0] = float("nan")
    tables, lens = [[1], [2, 3, 4]], [3, 10]
    meta = AttnMeta(num_prefill=0, qo_indptr=[0, 1, 2], kv_lens=lens, page_tables=tables, page_size=ps,
                    slot_mapping=torch.zeros(2, dtype=torch.int64))
    q = torch.randn(2, H, D, generator=g)
    out = TorchAttention(kv, cfg).begin(meta).attend(0, q).view(2, H, D)
    assert torch.isfinite(out).all()
    for b, (pages, n) in enumerate(zip(tables, lens)):  # each row against its own keys only, in fp64
        slots = torch.tensor([pages[t // ps] * ps + t % ps for t in range(n)])
        k = kv.k[0].reshape(-1, Hkv, D)[slots].double()
        v = kv.v[0].reshape(-1, Hkv, D)[slots].double()
        qq = q[b].double().view(Hkv, H // Hkv, D)
        p = (torch.einsum("hgd,lhd->hgl", qq, k) * 0.3).softmax(-1)
        want = torch.einsum("hgl,lhd->hgd", p, v).reshape(H, D)
        torch.testing.assert_close(out[b].double(), want, rtol=1e-5, atol=1e-5)

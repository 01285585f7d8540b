"""Planning a step does not wait for the step in flight (runner/attention/flashinfer_backend.py).

Each flashinfer wrapper stages its plan in its own pinned buffer, so a plan only has to wait for the
copy of the same wrapper's previous plan. With one event shared by all wrappers, the decode-rows plan
of a step with prompt rows waited for the prompt-rows plan's copy, queued behind everything already on
the stream: the host stalled for a whole step. Here a long kernel stands in for that step."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("flashinfer")


@pytest.mark.parametrize("kernel", ["fa2", "fa3"])
def test_a_mixed_step_plans_without_waiting_for_queued_work(kernel, monkeypatch):
    from lorafleet.runner.executor.attention.flashinfer_backend import FlashInferAttention
    from lorafleet.runner.executor.attention.meta import AttnMeta
    from lorafleet.runner.executor.kv_cache import KVCache

    dev = torch.device("cuda")
    cfg = _cfg(2, 8, 8)
    kv = KVCache(cfg, num_pages=16, page_size=16, dtype=torch.bfloat16, device=dev)
    if kernel == "fa3" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FA3 needs sm90")
    attn = FlashInferAttention(kv, cfg, dev, kernel)  # the prompt rows' plan on this kernel
    assert attn.prefill_kinds == (kernel,)
    meta = AttnMeta(num_prefill=1, qo_indptr=[0, 20, 21, 22], kv_lens=[20, 40, 7], page_tables=[[0, 1], [2, 3, 4], [5]],
                    page_size=16, slot_mapping=torch.zeros(22, dtype=torch.int64, device=dev))
    attn.begin(meta)  # first plans of both wrappers (compiles or loads their modules)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of queued GPU work at ~2 GHz: the step in flight
    attn.begin(meta)  # both plans again: each waits only for its own previous copy (long done)
    planned = time.perf_counter() - t0
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    assert total > 0.3, f"the stand-in kernel ran only {total:.2f} s; the test needs a longer one"
    assert planned < total / 3, f"planning took {planned:.2f} s of {total:.2f} s: it waited for the queued work"


def _cfg(layers, heads, kv_heads, head_dim=128, window=None):
    """The attention fields of a ModelConfig."""
    return SimpleNamespace(num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           kv_dim=kv_heads * head_dim, layer_window=(window,) * layers, softmax_scale=head_dim ** -0.5,
                           attn_softcap=None)


def _paged_reference(kv_k, kv_v, meta, q, ps, window=None):
    """fp32 attention of q [T, H, D] over each request's pages (causal for prompt rows; with a window W a
    query at position i sees the keys j with i - W < j <= i, as transformers' sliding-window mask)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    h, hkv, d = q.shape[1], kv_k.shape[-2], q.shape[2]
    for i in range(meta.batch_size):
        lo, hi, n = meta.qo_indptr[i], meta.qo_indptr[i + 1], meta.kv_lens[i]
        pages = torch.tensor(meta.page_tables[i], device=q.device)
        pos = torch.arange(n, device=q.device)
        k = kv_k[pages[pos // ps], pos % ps].float().repeat_interleave(h // hkv, dim=1)  # [n, H, D]
        v = kv_v[pages[pos // ps], pos % ps].float().repeat_interleave(h // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k) / d ** 0.5
        qpos = torch.arange(n - (hi - lo), n, device=q.device)
        hidden = pos[None, None, :] > qpos[None, :, None]
        if window is not None:
            hidden = hidden | (pos[None, None, :] <= qpos[None, :, None] - window)
        s = s.masked_fill(hidden, float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


@pytest.mark.parametrize("window", [None, 500])
@pytest.mark.parametrize("case", ["short_chunk_long_prefix", "long_prompt"])
def test_prefill_kernels_match_fp32_attention(case, window):
    """Both of flashinfer's prefill kernels (FA2, FA3) against an fp32 reference on the same step, and
    the kernel `auto` picks for it on sm90: a 64-row chunk over a 3,000-token prefix (beside two decode
    rows) takes FA2, a 1,024-row prompt FA3 (runner/executor/attention/meta.py prefill_kernel); with and
    without a sliding window shorter than the prompts (the decode rows too)."""
    from lorafleet.runner.executor.attention.flashinfer_backend import FlashInferAttention
    from lorafleet.runner.executor.attention.meta import AttnMeta
    from lorafleet.runner.executor.kv_cache import KVCache

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FA3 needs sm90")
    dev, ps = torch.device("cuda"), 16
    cfg = _cfg(1, 32, 32, window=window)
    kv = KVCache(cfg, num_pages=512, page_size=ps, dtype=torch.bfloat16, device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    kv.k.normal_(generator=g)
    kv.v.normal_(generator=g)
    perm = torch.randperm(512, device=dev, generator=g).tolist()  # scattered pages
    if case == "short_chunk_long_prefix":
        lens, qo, want = [3064, 900, 37], [0, 64, 65, 66], "fa2"  # the decode row of 900 keys: past the window
    else:
        lens, qo, want = [1024], [0, 1024], "fa3"
    tables, k = [], 0
    for n in lens:
        used = -(-n // ps)
        tables.append(perm[k:k + used])
        k += used
    meta = AttnMeta(num_prefill=1, qo_indptr=qo, kv_lens=lens, page_tables=tables, page_size=ps,
                    slot_mapping=torch.zeros(qo[-1], dtype=torch.int64, device=dev))
    # scores of std 4: peaked softmax rows, so a key wrongly in or out of a row's window shows
    q = (4 * torch.randn(qo[-1], 32, 128, device=dev, generator=g)).to(torch.bfloat16)
    ref = _paged_reference(kv.k[0], kv.v[0], meta, q, ps, window)
    attn = FlashInferAttention(kv, cfg, dev, "auto")
    assert attn.prefill_kinds == ("fa2", "fa3")
    assert attn.begin(meta).prefill_kernel == want
    chosen = attn.prefill_kind
    for name in attn.prefill_kinds:
        attn.prefill_kind = lambda lens, name=name: name
        step = attn.begin(meta)
        assert step.prefill_kernel == name
        out = step.attend(0, q).view(q.shape).float()
        err = (out - ref).abs()
        assert err.max().item() < 5e-2 and err.mean().item() < 2e-3, \
            f"{name}: error max {err.max().item():.4f} mean {err.mean().item():.5f} against fp32 on {case}, window {window}"
    attn.prefill_kind = chosen

"""The rows' LoRA shrink on the FP8 wgmma product's own warps (KernelChoices.fp8_sm90_shrink; runner/model/fp8.py
fp8_linear's `shrink_sync`) in the decoder, on the CPU. The FP8 tensor-core path is taken as on an H100: the norms'
quantized rows are made by torch (quantize_tokens), and the product with its epilogue is replaced by a torch
emulation of their contract (x @ dequant(w).T + bias, plus each row's expand v[t, g, :r] @ B_g[slot, :r]; with A pools
handed over, v computed first from x and those pools, as the kernel's warps do). The LoRA kernels are the torch ones
under the CUDA kernels' name, counted, the shrink's rows summed as the emulation sums them. A CPU engine so
configured gives the tokens of the same engine with every shrink launched; the shrinks the products take are exactly
those of qkv and gate_up (the norm quantized their rows) but the step's first, each layer and group with counters of
its own, and every launch they replace is gone. The kernel itself: tests/gpu/test_fp8_sm90_cuda.py; the engine with
it against the fp32 FP8 reference: tests/gpu/test_fp8_cuda.py."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import lorafleet.runner.model.decoder as dec
import lorafleet.runner.model.fp8 as fp8
from family_models import family_targets, write_family_model
from lorafleet.runner.config import EngineConfig, KernelChoices
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.model.fp8 import Fp8Weight, fp8_linear, fp8_shrink_first_applies, quantize_tokens
from model_helpers import write_random_adapter
from test_bf16_sm90 import TorchUnderCudaName, emulated_lora, mixed_requests, row_v


class Fp32Shrinks(TorchUnderCudaName):
    """TorchUnderCudaName whose shrink writes each row's v with row_v, so that the launched shrink and the
    emulated product's give the same bits."""

    def shrink(self, v, x, a, ranks, host, seg, **_):
        self.shrinks += 1
        for i, s in enumerate(seg.host_slots):
            for t in range(seg.host_indptr[i], seg.host_indptr[i + 1]) if s >= 0 else ():
                for g, ag in enumerate(a):
                    r = host[g][s]
                    if r:
                        v[t, g, :r] = row_v(x[t], ag[s, :r])


def emulated_fp8(d, firsts: list, syncs: set):
    """Decoder._fp8_linear's contract in torch (weight-only products: the tokens compare two runs of the same
    emulation), recording each call that took the shrink first."""

    def run(x, w, b, epilogue=False, spans=None, lora=None, quantized=None, act=0, shrink_sync=None,
            shrink_producer=False, early=False):
        assert shrink_producer == (shrink_sync is not None and d.fp8_sm90_shrink_producer)
        assert early == d.epilogue_early  # (KernelChoices.epilogue_early; the same bits)
        y = F.linear(x, w.dequant(x.dtype), b)
        if lora is not None:
            a = lora[4]
            if a is not None:  # the shrink first, on the product's warps
                assert shrink_sync is not None and shrink_sync.dtype == torch.int32 and not shrink_sync.any()
                assert quantized is not None and quantized[0].shape == x.shape  # the norm's rows, not the shrink's
                syncs.add(shrink_sync.data_ptr())
                firsts.append(tuple(spans))
            else:
                assert shrink_sync is None
            emulated_lora(y, x, spans, lora)
        if act:
            return d.ops.act_mul(y, spans[0])
        return y

    return run


def run(model, ads, first: bool, monkeypatch, producer: bool = False, tweak=None):
    seqs = mixed_requests(ads, seed=5)
    kernels = KernelChoices(fp8_sm90_shrink=first, fp8_sm90_shrink_producer=producer)
    eng = Engine(str(model), EngineConfig(device="cpu", max_batch_size=8, page_size=4, num_pages=200, max_lora_rank=16,
                                          max_step_tokens=64, quantization="fp8", dtype="bfloat16", kernels=kernels))
    d = eng.model
    assert d.sm90_sync is None  # a CPU device: the choice is not taken by itself
    shim = Fp32Shrinks(eng.runner.sgmv)
    eng.runner.sgmv = shim
    if first:  # as Decoder.__init__ on a compute capability 9.0 GPU whose build has the kernel
        d.sm90_sync, d.fp8_sm90 = torch.zeros(d.num_layers * 4, 4, dtype=torch.int32), True
    if tweak is not None:
        tweak(d)
    firsts: list = []
    syncs: set[int] = set()
    norm = d._norm

    def quantizing_norm(i, group, h, residual, w, lora, proj, res_dst=None):  # as the project's norm on the GPU
        x, res, _ = norm(i, group, h, residual, w, lora, proj, res_dst)
        return x, res, quantize_tokens(x) if isinstance(proj, Fp8Weight) else None

    monkeypatch.setattr(d, "_norm", quantizing_norm)
    monkeypatch.setattr(dec, "epilogue_applies", lambda *a, **k: True)  # as on an H100 for at most 64 rows
    monkeypatch.setattr(d, "_fp8_linear", emulated_fp8(d, firsts, syncs))
    try:
        out = eng.run_to_completion(seqs)
    finally:
        eng.close()
    return [out[f"r{i}"].output_ids for i in range(len(seqs))], d, shim, firsts, syncs


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_the_shrink_first_gives_the_launched_shrinks_tokens(tmp_path, family, monkeypatch):
    model = write_family_model(family, tmp_path / "m", seed=2)
    ads = {"all": write_random_adapter(model, tmp_path / "all", r=8, alpha=16, targets=family_targets(family), seed=3),
           "mlp": write_random_adapter(model, tmp_path / "mlp", r=4, alpha=8, targets=family_targets(family, "mlp"),
                                       seed=4)}
    # (without, then with (the default) the epilogue's launch letting the next kernel start at once: every epilogue
    # asked for it exactly when chosen, emulated_fp8)
    late = lambda d: setattr(d, "epilogue_early", False)  # noqa: E731
    want, _, launched, none, _ = run(model, ads, False, monkeypatch, tweak=late)
    got, d, shim, firsts, syncs = run(model, ads, True, monkeypatch)
    assert d.epilogue_early
    assert got == want and none == []
    c = d.cfg
    qkv, gate_up = (c.q_dim, c.kv_dim, c.kv_dim), (c.intermediate_size, c.intermediate_size)
    assert firsts and set(firsts) <= {qkv, gate_up}
    # every shrink the products took is one launch less; per step with adapters qkv and gate_up of every layer take
    # it, but the step's first qkv (its row slots are made right before it)
    assert shim.shrinks + len(firsts) == launched.shrinks
    steps = firsts.count(gate_up) // d.num_layers
    assert steps > 0 and firsts.count(gate_up) == steps * d.num_layers
    assert firsts.count(qkv) == steps * (d.num_layers - 1)
    assert len(syncs) == 2 * d.num_layers - 1  # counters of its own per layer and group


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_the_shrink_on_the_producers_warps_takes_every_projections_launch(tmp_path, family, monkeypatch):
    """KernelChoices.fp8_sm90_shrink_producer with the shrink first: o and down too (their rows quantized by the
    activation kernel's own launch, not the shrink's), so every group's shrink but the step's first is inside its
    product, on the producer's warps; the tokens those of the launched shrinks."""
    model = write_family_model(family, tmp_path / "m", seed=2)
    ads = {"all": write_random_adapter(model, tmp_path / "all", r=8, alpha=16, targets=family_targets(family), seed=3),
           "mlp": write_random_adapter(model, tmp_path / "mlp", r=4, alpha=8, targets=family_targets(family, "mlp"),
                                       seed=4)}
    want, _, launched, _, _ = run(model, ads, False, monkeypatch)
    got, d, shim, firsts, syncs = run(model, ads, True, monkeypatch, producer=True)
    assert got == want
    c = d.cfg
    qkv, gate_up = (c.q_dim, c.kv_dim, c.kv_dim), (c.intermediate_size, c.intermediate_size)
    steps = firsts.count(gate_up) // d.num_layers
    assert steps > 0 and firsts.count(gate_up) == steps * d.num_layers
    assert firsts.count(qkv) == steps * (d.num_layers - 1)
    # o and down (one span each, the hidden size), every layer of every step with adapters
    assert firsts.count((c.hidden_size,)) == 2 * steps * d.num_layers
    assert shim.shrinks + len(firsts) == launched.shrinks and shim.shrinks == steps
    assert len(syncs) == 4 * d.num_layers - 1


@pytest.mark.parametrize("choice", ["fp8_sm90_split", "no_wgmma", "fp8_sm90_persistent"])
def test_the_shrink_first_keeps_its_launches_where_the_product_cannot_take_it(tmp_path, choice, monkeypatch):
    """With the counters made (fp8_sm90_shrink on, as by default) but the FP8 products off the wgmma kernel, on its
    persistent schedule (fp8_linear refuses the shrink first there), or in K parts (which the kernel serves, but no engine test has checked), no product is asked for the
    shrink first: every shrink is launched, the tokens those of the launches."""
    model = write_family_model("llama3", tmp_path / "m", seed=2)
    ads = {"all": write_random_adapter(model, tmp_path / "all", r=8, alpha=16, targets=family_targets("llama3"),
                                       seed=3)}
    want, _, launched, _, _ = run(model, ads, False, monkeypatch)

    def tweak(d):
        if choice == "no_wgmma":
            d.fp8_sm90 = False
        else:
            setattr(d, choice, True)

    got, d, shim, firsts, syncs = run(model, ads, True, monkeypatch, producer=True, tweak=tweak)
    assert got == want and firsts == [] and not syncs
    assert shim.shrinks == launched.shrinks > 0


def _operands(M: int, K: int, N: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = Fp8Weight((torch.randn(N, K, generator=g) * 40).to(torch.float8_e4m3fn), torch.rand(N, generator=g) / 100)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    return w, x, quantize_tokens(x)


def _shrink_first_case(seed: int):
    """4 rows, K 64, N 32 in two spans of 16: the weight, x, its e4m3 rows and scales, LoRA operands with A pools
    (v, B pools, ranks, row slots, A pools; zeros) and zero counters."""
    M, K, N = 4, 64, 32
    w, x, (xq, sx) = _operands(M, K, N, seed=seed)
    lora = (torch.zeros(M, 2, 8), [torch.zeros(3, 8, 16), torch.zeros(3, 8, 16)], torch.zeros(2, 3, dtype=torch.int32),
            torch.zeros(M, dtype=torch.int32), [torch.zeros(3, 8, K), torch.zeros(3, 8, K)])
    return w, x, xq, sx, lora, torch.zeros(4, dtype=torch.int32)


def test_fp8_linear_hands_the_wgmma_product_the_shrink_first(monkeypatch):
    """fp8_linear with A pools in its LoRA operands and `shrink_sync`: the wgmma product is asked once, with x's bf16
    rows, the spans, v, the B pools, ranks, row slots, A pools and the counters; the epilogue's launch then gets the
    same v. Without the counters, on the persistent schedule, with the expand inside the product, or without the wgmma
    product, it refuses before anything runs."""
    w, x, xq, sx, lora, sync = _shrink_first_case(seed=1)
    calls = []

    def gemm(y, xq_, wq, stream, parts, *rest, **kwargs):
        calls.append(("gemm", parts, rest, kwargs))
        y.copy_(xq_.float() @ wq.float().T)

    def epilogue_launch(out, y, sx_, ws, bias, spans, v, b, ranks, row_slot, pdl, stream, act):
        calls.append(("epilogue", v))
        out.copy_((y * sx_.view(-1, 1) * ws.view(1, -1)).to(out.dtype))

    ext = types.SimpleNamespace(fp8_gemm_sm90=gemm, fp8_epilogue=epilogue_launch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(fp8, "_sm_count", lambda index: 132)
    common = dict(ext=ext, quantized=(xq, sx), unit_scale_elems=1, epilogue=True, spans=[16, 16], lora=lora)
    fp8_linear(x, w, None, True, sm90=True, shrink_sync=sync, **common)
    assert [c[0] for c in calls] == ["gemm", "epilogue"] and calls[0][1:3] == (1, ())
    kw = calls[0][3]
    assert kw["lora_x"] is x and kw["cols"] == [16, 16] and kw["v"] is lora[0] and kw["b"] == lora[1]
    assert kw["ranks"] is lora[2] and kw["row_slot"] is lora[3] and kw["a"] == lora[4] and kw["sync"] is sync
    assert calls[1][1] is lora[0]
    for bad in (dict(sm90=True), dict(sm90=True, shrink_sync=sync, sm90_persistent=True),
                dict(sm90=False, shrink_sync=sync), dict(sm90=True, shrink_sync=sync, epilogue=False),
                dict(sm90=True, shrink_sync=sync, unit_scale_elems=0)):
        calls.clear()
        with pytest.raises(ValueError, match="shrink first"):
            fp8_linear(x, w, None, True, **{**common, **bad})
        assert calls == []


def test_fp8_linear_keeps_the_shrink_firsts_two_launches_where_the_epilogue_could_run_inside(monkeypatch):
    """With `sm90_fused` (the epilogue inside the product where it can be, as by default), a product with A pools
    still takes the shrink first and the epilogue's own launch, shrink_producer passed on (the e4m3 shrink inside
    fp8_gemm_sm90_fused measured slower and is not built); the same call without LoRA takes the one fused launch."""
    w, x, xq, sx, lora, sync = _shrink_first_case(seed=3)
    calls = []

    def fused(out, xq_, wq, sx_, ws, bias, spans, v, b, ranks, row_slot, pdl, stream, **kwargs):
        calls.append(("fused", spans, v, kwargs))
        out.copy_((xq_.float() @ wq.float().T * sx_.view(-1, 1) * ws.view(1, -1)).to(out.dtype))

    def gemm(y, xq_, wq, stream, parts, *rest, **kwargs):
        calls.append(("gemm", kwargs))
        y.copy_(xq_.float() @ wq.float().T)

    def epilogue_launch(out, y, sx_, ws, bias, spans, v, b, ranks, row_slot, pdl, stream, act):
        calls.append(("epilogue", act))
        out.copy_((y * sx_.view(-1, 1) * ws.view(1, -1))[:, :out.shape[1]].to(out.dtype))

    ext = types.SimpleNamespace(fp8_gemm_sm90_fused=fused, fp8_gemm_sm90=gemm, fp8_epilogue=epilogue_launch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(fp8, "_sm_count", lambda index: 1)  # (one part: the epilogue may run inside)
    common = dict(ext=ext, quantized=(xq, sx), unit_scale_elems=1, epilogue=True, spans=[16, 16], sm90=True,
                  sm90_fused=True)
    want = (xq.float() @ w.q.float().T * sx.view(-1, 1) * w.scale.view(1, -1)).to(x.dtype)
    out = fp8_linear(x, w, None, True, lora=lora, shrink_sync=sync, shrink_producer=True, **common)
    assert [c[0] for c in calls] == ["gemm", "epilogue"] and torch.equal(out, want)
    kw = calls[0][1]
    assert kw["lora_x"] is x and kw["a"] == lora[4] and kw["sync"] is sync and kw["shrink_producer"] is True
    calls.clear()
    out = fp8_linear(x, w, None, True, **common)  # no LoRA: the epilogue inside the product
    assert [c[0] for c in calls] == ["fused"] and calls[0][3] == {} and torch.equal(out, want)


def test_the_shrink_first_takes_only_the_products_it_can():
    w, x, (xq, _) = _operands(8, 64, 32, seed=2)
    assert fp8_shrink_first_applies(x, xq, w)
    refused = {
        "fp16 rows": (x.half(), xq, w),
        "65 rows": (torch.zeros(65, 64, dtype=torch.bfloat16), torch.zeros(65, 64).to(torch.float8_e4m3fn), w),
        "strided rows": (torch.zeros(8, 128, dtype=torch.bfloat16)[:, :64], xq, w),
        "other rows than the quantized": (x[:4].contiguous(), xq, w),
        "K not a multiple of 16": (x[:, :56].contiguous(), xq[:, :56].contiguous(),
                                   Fp8Weight(w.q[:, :56].contiguous(), w.scale)),
    }
    for why, args in refused.items():
        assert not fp8_shrink_first_applies(*args), why

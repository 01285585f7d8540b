"""The FP8 gate_up epilogue that also applies the activation (KernelChoices.fp8_epilogue_act) in the decoder, on the
CPU: the epilogue's launch is replaced by a torch emulation of its contract (the product, then with `act` the model's
act(gate) * up, [T, I]). A CPU engine's tokens are the default path's, the activation is asked of gate_up's epilogue
once per layer and step with the model's code (SiLU 1, GELU-tanh 2) and two spans of I columns, and never of another
projection; a decoder that applied the activation again, or kept the activation kernel's call, would change the
tokens. The kernel itself (flashinfer's act_and_mul bits) is checked on the GPU (tests/gpu/test_fp8_cuda.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lorafleet.runner.model.decoder as dec
from family_models import write_family_model
from lorafleet.runner.config import EngineConfig, KernelChoices
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import SamplingParams, Sequence

NEW = 5


def run(model, reqs, act: bool, monkeypatch):
    eng = Engine(str(model), EngineConfig(device="cpu", kv_cache_gb=0.02, quantization="fp8", enable_lora=False,
                                          kernels=KernelChoices(fp8_epilogue_act=act)))
    d = eng.model
    assert d.fp8_epilogue_act == act
    calls = []

    def emulated(x, w, b, epilogue=False, spans=None, lora=None, quantized=None, act=0, shrink_sync=None,
                 early=False):
        assert early == d.epilogue_early  # (KernelChoices.epilogue_early, on by default: the same bits)
        y = F.linear(x, w.dequant(x.dtype), b)
        calls.append((act, tuple(spans or ())))
        if act:
            return d.ops.act_mul(y, spans[0])  # the contract: act(gate) * up of the epilogue's output
        return y

    monkeypatch.setattr(dec, "epilogue_applies", lambda *a, **k: True)  # as on an H200 for at most 64 rows
    monkeypatch.setattr(d, "_fp8_linear", emulated)
    monkeypatch.setattr(d.ops, "name", "flashinfer")  # the fusion replaces flashinfer's act_and_mul only
    seqs = [Sequence(f"r{i}", ids, SamplingParams(max_tokens=NEW, ignore_eos=True)) for i, ids in enumerate(reqs)]
    out = eng.run_to_completion(seqs)
    return [out[f"r{i}"].output_ids for i in range(len(reqs))], d, calls


@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_gate_up_epilogue_with_the_activation_gives_the_default_tokens(tmp_path, family, monkeypatch):
    model = write_family_model(family, tmp_path / "m")
    g = torch.Generator().manual_seed(3)
    reqs = [torch.randint(3, 200, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(3)]
    want, _, plain = run(model, reqs, False, monkeypatch)
    got, d, calls = run(model, reqs, True, monkeypatch)
    assert got == want
    code = dec.ACT_CODES[d.cfg.activation]
    inter = d.cfg.intermediate_size
    with_act = [c for c in calls if c[0]]
    assert with_act and all(c == (code, (inter, inter)) for c in with_act)
    assert not any(c[0] for c in plain)
    # one epilogue per projection group and layer in both runs; with the choice, every gate_up one carries the act
    assert len(calls) == len(plain) and len(with_act) * 4 == len(calls)
    assert code == (2 if family == "gemma3" else 1)


def _unit_operands(M: int, K: int, N: int, seed: int):
    """An e4m3 weight with row scales, e4m3 rows with token scales, the (unused) bf16 rows they stand for, and the
    scaled product in bf16."""
    from lorafleet.runner.model.fp8 import Fp8Weight

    g = torch.Generator().manual_seed(seed)
    w = Fp8Weight((torch.randn(N, K, generator=g) * 40).to(torch.float8_e4m3fn), torch.rand(N, generator=g) / 100)
    xq = (torch.randn(M, K, generator=g) * 40).to(torch.float8_e4m3fn)
    sx = torch.rand(M, 1, generator=g) / 100
    want = (xq.float() @ w.q.float().T * sx * w.scale.view(1, -1)).to(torch.bfloat16)
    return w, xq, sx, torch.zeros(M, K, dtype=torch.bfloat16), want


def test_fp8_linear_keeps_its_products_and_takes_the_activation_only_in_the_epilogue(monkeypatch):
    """runner/model/fp8.py fp8_linear on the CPU with the tensor-core products emulated (torch._scaled_mm counted):
    every call (the unit-scale product finished by torch ops, the project's kernel, the per-row call) runs one
    product and returns the scaled result; `act` is refused wherever the epilogue does not finish the product, before
    anything runs; with the epilogue the extension is asked for act(gate) * up into [M, I]."""
    import types

    from lorafleet.runner.model.fp8 import fp8_linear

    products = []

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        products.append(out_dtype)
        return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    M, K, N = 4, 64, 32
    w, xq, sx, x, want = _unit_operands(M, K, N, seed=1)
    own_calls = []
    ext = types.SimpleNamespace(
        fp8_gemm=lambda y, xq_, s, wq, ws, st: own_calls.append(1) or y.copy_(
            (xq_.float() @ wq.float().T * s.view(-1, 1) * ws.view(1, -1)).to(y.dtype)))
    import lorafleet.runner.model.fp8 as fp8

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(fp8, "unit_scale", lambda device: torch.ones(()))  # a CUDA scalar on a GPU
    for kw, n_products in ((dict(unit_scale_elems=1), 1), (dict(unit_scale_elems=0), 1),
                           (dict(ext=ext, own_rows=64), 0)):
        products.clear()
        y = fp8_linear(x, w, None, True, quantized=(xq, sx), **kw)
        assert len(products) == n_products, kw
        assert torch.allclose(y.float(), want.float(), rtol=1e-2, atol=1e-3), kw
    assert own_calls == [1]
    for kw in (dict(unit_scale_elems=1), dict(unit_scale_elems=0, epilogue=True), dict(ext=ext, own_rows=64,
                                                                                       epilogue=True)):
        products.clear()
        with pytest.raises(ValueError, match="activation rides only in the epilogue"):
            fp8_linear(x, w, None, True, quantized=(xq, sx), act=1, **kw)
        assert not products
    seen = {}
    ext2 = types.SimpleNamespace(fp8_epilogue=lambda out, *args, **kw: seen.update(shape=tuple(out.shape),
                                                                                   act=args[-1], kw=kw))
    fp8_linear(x, w, None, True, ext=ext2, quantized=(xq, sx), unit_scale_elems=1, epilogue=True, spans=[16, 16],
               act=2)
    assert seen == {"shape": (M, N // 2), "act": 2, "kw": {}} and products == [torch.float32]
    # (early: the epilogue's launch lets the next kernel start at once, asked of the extension only when set)
    fp8_linear(x, w, None, True, ext=ext2, quantized=(xq, sx), unit_scale_elems=1, epilogue=True, early=True)
    assert seen == {"shape": (M, N), "act": 0, "kw": {"early": True}}


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("epilogue", [False, True])
def test_fp8_linear_asks_the_wgmma_product_for_its_schedule(monkeypatch, persistent, epilogue):
    """fp8_linear with `sm90` on the CPU, the extension emulated: the unit-scale product is asked of fp8_gemm_sm90 once,
    with the persistent schedule exactly when `sm90_persistent` is given (the kernel's own arguments then: pdl and
    persistent), and the scaled result is the product's, with and without the epilogue's launch."""
    import types

    import lorafleet.runner.model.fp8 as fp8
    from lorafleet.runner.model.fp8 import fp8_linear

    M, K, N = 4, 64, 32
    w, xq, sx, x, want = _unit_operands(M, K, N, seed=2)
    calls = []

    def gemm(y, xq_, wq, stream, parts, *rest):
        calls.append((parts, rest))
        y.copy_(xq_.float() @ wq.float().T)

    def epilogue_launch(out, y, sx_, ws, bias, spans, v, b, ranks, row_slot, pdl, stream, act):
        out.copy_((y * sx_.view(-1, 1) * ws.view(1, -1)).to(out.dtype))

    ext = types.SimpleNamespace(fp8_gemm_sm90=gemm, fp8_epilogue=epilogue_launch)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(fp8, "_sm_count", lambda index: 132)
    y = fp8_linear(x, w, None, True, ext=ext, quantized=(xq, sx), unit_scale_elems=1, epilogue=epilogue,
                   spans=[N] if epilogue else None, sm90=True, sm90_persistent=persistent)
    assert calls == [(1, (True, True) if persistent else ())]
    assert torch.allclose(y.float(), want.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("persistent", [False, True])
def test_fp8_linear_asks_the_fused_product_for_its_schedule(monkeypatch, persistent):
    """With the epilogue inside the wgmma product (`sm90_fused`), fp8_linear asks fp8_gemm_sm90_fused once, for the
    persistent ping-pong kernel exactly when `sm90_persistent` is given, and returns the kernel's output."""
    import types

    import lorafleet.runner.model.fp8 as fp8
    from lorafleet.runner.model.fp8 import fp8_linear

    M, K, N = 4, 64, 32
    w, xq, sx, x, want = _unit_operands(M, K, N, seed=3)
    calls = []

    def fused(out, xq_, wq, sx_, ws, bias, spans, v, b, ranks, row_slot, pdl, stream, **kwargs):
        calls.append((spans, pdl, kwargs))
        out.copy_((xq_.float() @ wq.float().T * sx_.view(-1, 1) * ws.view(1, -1)).to(out.dtype))

    ext = types.SimpleNamespace(fp8_gemm_sm90_fused=fused)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(fp8, "_sm_count", lambda index: 132)
    y = fp8_linear(x, w, None, True, ext=ext, quantized=(xq, sx), unit_scale_elems=1, epilogue=True, spans=[N],
                   sm90=True, sm90_fused=True, sm90_persistent=persistent)
    assert calls == [([N], True, {"persistent": True} if persistent else {})]
    assert torch.allclose(y.float(), want.float(), rtol=1e-2, atol=1e-3)

"""The L2 warm-up of FP8 products (KernelChoices.fp8_l2_prefetch, csrc/l2_prefetch.cuh) on the CPU: what
runner/model/fp8.py asks the quantizing launch to prefetch (each weight row's first k-tiles, in each K part the
product cuts, at most the part), that nothing is asked where the activations come quantized or the choice is off,
and the choice's reading from the environment. The launch's bits with and without it are checked on the GPU
(tests/gpu/test_fp8_cuda.py)."""

from __future__ import annotations

import types

import pytest
import torch

import lorafleet.runner.model.fp8 as fp8
from lorafleet import env
from lorafleet.runner.config import KernelChoices
from lorafleet.runner.model.fp8 import Fp8Weight, fp8_linear, l2_prefetch


def weight(n: int, k: int) -> Fp8Weight:
    g = torch.Generator().manual_seed(n + k)
    return Fp8Weight((torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn), torch.rand(n, generator=g) / 100)


def test_the_first_k_tiles_of_each_row_of_each_part():
    w = weight(64, 1024)
    assert l2_prefetch(w, 0) is None
    assert l2_prefetch(w, 2)[1:] == (1, 512)
    assert l2_prefetch(w, 8)[1:] == (1, 1024)  # at most the row
    assert l2_prefetch(w, 2, parts=2)[1:] == (2, 512)
    assert l2_prefetch(w, 4, parts=4)[1:] == (4, 256)  # at most the part
    assert l2_prefetch(w, 2)[0] is w.q
    assert l2_prefetch(w, 2, parts=3) is None  # K not cut into equal parts
    assert l2_prefetch(weight(64, 48), 1, parts=2) is None  # 24-byte parts: not 16-byte aligned
    t = Fp8Weight(weight(64, 1024).q.t(), torch.ones(1024))
    assert l2_prefetch(t, 2) is None  # not row-major


@pytest.mark.parametrize("split,parts", [(False, 1), (True, 16)])
def test_fp8_linear_asks_the_quantizing_launch_for_its_weight(monkeypatch, split, parts):
    """fp8_linear on the CPU with the extension's calls emulated: the activations' launch is asked for the product's
    weight, in the parts the wgmma product cuts K into (64 rows on 132 SMs: 16 parts of 64 bytes), only with
    l2_ktiles, and never where the rows come quantized."""
    asked = []

    def quantize_tokens(x, ext=None, prefetch=None):
        asked.append(prefetch)
        return (x.float() / 64).to(torch.float8_e4m3fn), torch.full((x.shape[0], 1), 1 / 64)

    def gemm(y, xq, wq, stream, parts, *rest):
        y.copy_((xq.float() @ wq.float().T).expand_as(y) / parts)

    ext = types.SimpleNamespace(fp8_gemm_sm90=gemm)
    monkeypatch.setattr(fp8, "quantize_tokens", quantize_tokens)
    monkeypatch.setattr(fp8, "_sm_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: types.SimpleNamespace(cuda_stream=0))
    w, x = weight(64, 1024), torch.randn(4, 1024).to(torch.bfloat16)
    call = dict(ext=ext, unit_scale_elems=1, sm90=True, sm90_split=split)
    fp8_linear(x, w, None, True, l2_ktiles=2, **call)
    assert len(asked) == 1 and asked[0][0] is w.q and asked[0][1:] == (parts, 512 if parts == 1 else 64)
    fp8_linear(x, w, None, True, **call)
    assert asked[1] is None
    fp8_linear(x, w, None, True, l2_ktiles=2, quantized=quantize_tokens(x), **call)
    assert len(asked) == 3 and asked[2] is None  # (the call above, made by the test)


def test_the_choice_from_the_environment(monkeypatch):
    monkeypatch.delenv("LORAFLEET_FP8_L2_PREFETCH", raising=False)
    assert env.fp8_l2_prefetch() == 0 and KernelChoices.from_env().fp8_l2_prefetch == 0
    monkeypatch.setenv("LORAFLEET_FP8_L2_PREFETCH", "4")
    assert KernelChoices.from_env().describe() == "kernel choices: fp8_l2_prefetch=4"
    for bad in ("-1", "65"):
        monkeypatch.setenv("LORAFLEET_FP8_L2_PREFETCH", bad)
        with pytest.raises(ValueError, match=r"LORAFLEET_FP8_L2_PREFETCH must be in \[0, 64\]"):
            env.fp8_l2_prefetch()
    monkeypatch.setenv("LORAFLEET_FP8_L2_PREFETCH", "two")
    with pytest.raises(ValueError, match="LORAFLEET_FP8_L2_PREFETCH must be an integer"):
        env.fp8_l2_prefetch()
    for bad in (-1, 65, 2.0, True):
        with pytest.raises(ValueError, match="fp8_l2_prefetch must be in"):
            KernelChoices(fp8_l2_prefetch=bad)


@pytest.mark.parametrize("ktiles,in_shrink", [(0, True), (4, True), (4, False)])
def test_the_shrink_that_quantizes_asks_for_the_weight(monkeypatch, ktiles, in_shrink):
    """runner/model/decoder.py with adapters in the step: the LoRA shrink's launch, where it quantizes the
    activations (fp8_quant_in_shrink), is the one asked to warm L2 with the product's weight, and only with the
    choice on; where it does not quantize, the product's own quantizing launch is (fp8_linear's l2_ktiles)."""
    import lorafleet.runner.model.decoder as dec

    asked = {}

    class Step:
        epilogue_ready = True

        def epilogue_operands(self, i, group, x, quant=None, prefetch=None):
            asked.update(shrink=prefetch, quant=quant is not None)
            return ("v", [], "ranks", "slots")

    def linear(x, w, b, **finish):
        asked.update(linear=finish.get("quantized") is not None)
        return x

    monkeypatch.setattr(dec, "epilogue_applies", lambda *a, **k: True)
    w, x = weight(64, 1024), torch.randn(4, 1024).to(torch.bfloat16)
    me = types.SimpleNamespace(fp8_epilogue=True, fp8_tensor_cores=True, fp8_ext=None, fp8_gemm_rows=0,
                               fp8_unit_scale_elems=1, fp8_quant_in_shrink=in_shrink, fp8_l2_prefetch=ktiles,
                               fp8_sm90=True, fp8_sm90_split=False, _fp8_linear=linear)
    dec.Decoder._fp8_finished(me, 0, 1, x, w, None, Step(), [64])
    assert asked["quant"] == in_shrink and asked["linear"] == in_shrink
    if ktiles and in_shrink:
        assert asked["shrink"][0] is w.q and asked["shrink"][1:] == (1, 1024)
    else:
        assert asked["shrink"] is None

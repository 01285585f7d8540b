"""The decoder's own-norm path (KernelChoices.norm_shrink, runner/model/norm.py) on the CPU, with the CUDA launch
replaced by a torch emulation of its contract (x = Hugging Face's norm of h + res, the new residual written out of
place into res_out): the tokens of a CPU engine are exactly the default path's (the residual handed through the
layers from the norms' separate outputs, the LoRA add-on unchanged), and the norm is asked for twice per layer and
step. A decoder that kept using the old residual, or wrote the new one in place of an input still to be read,
would change the tokens. The kernel itself is checked on the GPU (tests/gpu/test_norm_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from family_models import family_targets, write_family_model
from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
from lorafleet.runner.model.norm import OwnNorm
from lorafleet.runner.model.ops import rms_norm
from model_helpers import write_random_adapter

NEW = 6


class TorchEmulatedNorm(OwnNorm):
    """The launch's contract in torch, for CPU tensors."""

    def __init__(self, eps, offset):
        super().__init__(None, eps, offset)
        self.calls, self.outputs, self.early = 0, set(), set()

    @staticmethod
    def applies(h, w):
        return h.dim() == 2 and h.is_contiguous() and w.dtype == h.dtype

    def run(self, x_out, n, quant=None, early=False):
        assert quant is None  # no FP8 tensor cores on the CPU
        self.calls += 1
        self.early.add(early)
        r = n.h if n.res is None else n.h + n.res
        if n.res is not None:
            assert n.res_out.data_ptr() not in (n.h.data_ptr(), n.res.data_ptr())
            n.res_out.copy_(r)
            self.outputs.add(n.res_out.data_ptr())
        x_out.copy_(rms_norm(r, n.w, self.eps, self.offset))


def run(model, reqs, own: bool, early: bool = False):
    eng = Engine(str(model), EngineConfig(max_lora_rank=8, device="cpu", kv_cache_gb=0.02))
    norm = None
    if own:
        c = eng.model.cfg
        eng.model.own_norm = norm = TorchEmulatedNorm(c.rms_norm_eps, c.norm_offset)
        eng.model.norm_early = early  # as Decoder.__init__ sets it with KernelChoices.norm_early and bf16_sm90 taken
    seqs = [Sequence(f"r{i}", ids, SamplingParams(max_tokens=NEW, ignore_eos=True), AdapterRef(n, str(p)) if n else None)
            for i, (ids, n, p) in enumerate(reqs)]
    out = eng.run_to_completion(seqs)
    return [out[f"r{i}"].output_ids for i in range(len(reqs))], eng, norm


@pytest.mark.parametrize("early", [False, True], ids=["at_its_end", "early"])
@pytest.mark.parametrize("family", ["llama3", "gemma3"])
def test_own_norm_path_gives_the_default_tokens(tmp_path, family, early):
    """(early: KernelChoices.norm_early, every norm's launch asked to let the next kernel start at once)"""
    model = write_family_model(family, tmp_path / "m")
    ads = {"a8": write_random_adapter(model, tmp_path / "a8", r=8, alpha=16, targets=family_targets(family), seed=3)}
    g = torch.Generator().manual_seed(5)
    reqs = [(torch.randint(3, 200, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist(),
             ["a8", None][i % 2], ads["a8"] if i % 2 == 0 else None) for i in range(4)]
    want, _, _ = run(model, reqs, own=False)
    got, eng, norm = run(model, reqs, own=True, early=early)
    assert got == want and norm.early == {early}
    assert norm.calls >= 2 * eng.model.num_layers * NEW  # at least one step per new token, two norms per layer
    assert norm.calls % (2 * eng.model.num_layers) == 0
    assert norm.outputs  # the new residuals went to tensors of their own


@pytest.mark.parametrize("weights", ["fp8", "bf16_sm90"])
def test_a_group_shrunk_in_the_norms_launch_is_not_shrunk_again(monkeypatch, weights):
    """With FP8 weights the norm's launch always makes the e4m3 rows (also under fp8_gemm_bf16, whose bf16-row kernel
    may not be the call a step takes), so a group whose shrink rode in that launch is finished without a second
    shrink and without asking the LoRA step to quantize (which it refuses once the shrink is done). bf16 weights on
    the wgmma kernel (KernelChoices.bf16_sm90): no e4m3 rows, and the product with the expand inside likewise takes
    the norm's shrink without a second one, nor one of its own (KernelChoices.sm90_shrink: no A pools handed over)."""
    import types

    import lorafleet.runner.model.decoder as dec
    from lorafleet.runner.lora.step import LoraStepImpl
    from lorafleet.runner.model.fp8 import Fp8Weight

    calls = []

    class FakeSGMV:
        name = "cuda"

        def shrink(self, *a, **k):
            calls.append("shrink")

        def norm_shrink(self, v, x_out, norm, a, ranks, seg, quant):
            calls.append("norm_shrink")
            assert (quant is not None) == (weights == "fp8")
            x_out.copy_(rms_norm(norm.h + norm.res, norm.w, norm.eps, norm.offset))
            norm.res_out.copy_(norm.h + norm.res)

    lora = LoraStepImpl.__new__(LoraStepImpl)
    lora.active, lora.mma, lora.dense, lora.sgmv, lora.seg, lora._shrunk = True, False, None, FakeSGMV(), None, None
    lora.norm_shrink_on = True  # KernelChoices(norm_shrink=True)
    lora.views = {1: None, 2: None, 3: None}
    lora.pool = types.SimpleNamespace(group_args=[[(None, None, None, None)] * 4])
    lora._row_slots = lambda *a: None
    finished = {}
    me = types.SimpleNamespace(
        own_norm=TorchEmulatedNorm(1e-6, 0.0), own_norm_quant=True, norm_early=False, fp8_tensor_cores=True,
        fp8_gemm_bf16=True, fp8_epilogue=True, fp8_ext=None, fp8_gemm_rows=0, fp8_unit_scale_elems=1,
        fp8_quant_in_shrink=True, sm90_sync=None, fp8_sm90_persistent=False,
        sm90_shrink_producer=False, sm90_shrink_first=False,
        fp8_sm90_shrink_producer=False, _early=dict,
        _fp8_linear=lambda x, w, b, **k: finished.update(k) or x)
    h, res = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(4, 16, dtype=torch.bfloat16)
    if weights == "bf16_sm90":
        me.bf16_sm90, me.sm90_ext, me.unit_scales = True, "ext", torch.ones(16)
        me.sm90_sync = torch.zeros(16, 4, dtype=torch.int32)
        monkeypatch.setattr(dec, "bf16_sm90_applies", lambda *a: True)  # as on an H100 for at most 64 rows
        monkeypatch.setattr(dec, "bf16_sm90_linear", lambda ext, x, w, b, spans, lora, unit, sync:
                            finished.update(lora=lora, spans=spans) or x)
        w = torch.zeros(16, 16, dtype=torch.bfloat16)
        x, new_res, quant = dec.Decoder._norm(me, 0, 2, h, res, torch.ones(16, dtype=torch.bfloat16), lora, w)
        assert quant is None and torch.equal(new_res, h + res) and calls == ["norm_shrink"]
        dec.Decoder._finished(me, 0, 2, x, w, None, lora, [8, 8], quant)
        assert calls == ["norm_shrink"]  # no second shrink
        assert finished["lora"] is not None and finished["spans"] == [8, 8]
        assert finished["lora"][4] is None  # v is the norm's: the product must not shrink again
        return
    w = Fp8Weight(torch.zeros(16, 16, dtype=torch.float8_e4m3fn), torch.ones(16))
    x, new_res, quant = dec.Decoder._norm(me, 0, 2, h, res, torch.ones(16, dtype=torch.bfloat16), lora, w)
    assert quant is not None and quant[0].dtype == torch.float8_e4m3fn and quant[1].shape == (4, 1)
    assert torch.equal(new_res, h + res) and calls == ["norm_shrink"]
    monkeypatch.setattr(dec, "epilogue_applies", lambda *a, **k: True)  # as on an H200 for at most 64 rows
    dec.Decoder._finished(me, 0, 2, x, w, None, lora, [8, 8], quant)
    assert calls == ["norm_shrink"]  # no second shrink
    assert finished["quantized"] is quant and finished["lora"] is not None

"""The fused K/V writer's launch (runner/model/rope_kv.py FusedKvWriter) on the CPU: the rope_kv kernel's contract
stood in for by the torch writer's ops, so that a CPU engine with the fused writer gives the logits of the engine with
the torch writer; with KernelChoices.rope_kv_pdl every launch, with and without the qkv rows' LoRA expand, asks for
programmatic dependent launch, and without it none does (the kernel itself: tests/gpu/test_rope_kv_cuda.py; its
launch in the families' engines: tests/gpu/test_families_cuda.py test_family_early_epilogue)."""

from __future__ import annotations

import types

import pytest
import torch

import lorafleet.runner.executor.executor as executor
from lorafleet.runner.config import EngineConfig, KernelChoices
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.model.decoder import StepIO
from lorafleet.runner.model.rope_kv import FusedKvWriter, TorchKvWriter


class RopeKvContract:
    """The extension's rope_kv / rope_kv_lora on the CPU: the torch writer's ops on the step's `io` (RoPE, the K/V
    index copies, q into q_out; the expand here is all-zero rows), recording each launch's keyword arguments."""

    def __init__(self, torch_writer: TorchKvWriter, layer: int, io):
        self.inner, self.layer, self.io, self.launches = torch_writer, layer, io, []

    def rope_kv(self, q_out, k_flat, v_flat, qkv, positions, slots, cos_sin, heads, kv_heads, stream, **kwargs):
        assert positions is self.io.positions and slots is self.io.slots
        c = self.inner.model.cfg
        k_pages, v_pages = self.inner.flat(self.layer)
        assert k_flat is k_pages and v_flat is v_pages  # (the layer's own pages, K then V)
        assert cos_sin is self.caches[c.layer_rope[self.layer]] and (heads, kv_heads) == (c.num_heads, c.num_kv_heads)
        self.launches.append(dict(kwargs))
        q_out.copy_(self.inner(self.layer, qkv, self.io).view_as(q_out))

    def rope_kv_lora(self, q_out, k_flat, v_flat, qkv, positions, slots, cos_sin, heads, kv_heads, stream, v, b,
                     ranks, row_slot, **kwargs):
        assert not v.any()  # (no add-on: every row's slot is negative)
        self.rope_kv(q_out, k_flat, v_flat, qkv, positions, slots, cos_sin, heads, kv_heads, stream, **kwargs)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = Engine(str(tiny_llama), EngineConfig(device="cpu", dtype="float32", num_pages=64, page_size=16,
                                                max_batch_size=4, kernels=KernelChoices()))
    yield eng
    eng.close()


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("lora", [False, True])
def test_every_rope_kv_launch_asks_for_pdl_exactly_when_chosen(engine, pdl, lora, monkeypatch):
    """Both launches of the writer (without and with the qkv rows' expand) pass pdl=True when the writer was made
    with it and no pdl argument otherwise (an extension built before the argument existed still serves); q is
    the torch writer's, bit for bit, and so are the K/V pages."""
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=0))
    model = engine.model
    c, layer, T = model.cfg, 0, 3
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, c.q_dim + 2 * c.kv_dim, generator=g)
    positions, slots = torch.tensor([0, 5, 9]), torch.tensor([1, 17, 30])
    io = StepIO(torch.zeros(T, dtype=torch.int64), positions, slots, torch.arange(T))
    io.cos_sin = model.ops.rope_cos_sin(positions, model.dtype)
    ext = RopeKvContract(TorchKvWriter(model, engine.kv.flat), layer, io)
    ext.caches = {r: torch.zeros(1, c.head_dim) for r in set(c.layer_rope)}  # (one cos/sin cache per RoPE)
    shim = types.SimpleNamespace(cfg=c, ops=types.SimpleNamespace(caches=ext.caches))
    writer = FusedKvWriter(ext, shim, engine.kv.flat, pdl)
    expand = None
    if lora:
        expand = (torch.zeros(T, 3, 4), [torch.zeros(1, 4, n) for n in (c.q_dim, c.kv_dim, c.kv_dim)],
                  torch.zeros(3, 1, dtype=torch.int32), torch.full((T,), -1, dtype=torch.int32))
    got = writer(layer, qkv.clone(), io, expand)
    pages = [t[slots].clone() for t in engine.kv.flat(layer)]
    for t in engine.kv.flat(layer):
        t.zero_()
    want = TorchKvWriter(model, engine.kv.flat)(layer, qkv.clone(), io)
    assert torch.equal(got, want)
    assert all(torch.equal(a, t[slots]) for a, t in zip(pages, engine.kv.flat(layer)))
    assert any(a.any() for a in pages)
    assert ext.launches == [{"pdl": True} if pdl else {}]


@pytest.mark.parametrize("pdl", [False, True])
def test_the_engine_hands_its_choice_to_the_writer(tiny_llama, pdl, monkeypatch):
    """build_executor makes the K/V writer with KernelChoices.rope_kv_pdl (and rope_kv, rope_kv_fp8 as before)."""
    seen = []
    real = executor.make_kv_writer

    def recording(model, flat, fused=True, fp8_pages=False, pdl=False):
        seen.append((fused, fp8_pages, pdl))
        return real(model, flat, fused, fp8_pages, pdl)

    monkeypatch.setattr(executor, "make_kv_writer", recording)
    eng = Engine(str(tiny_llama), EngineConfig(device="cpu", dtype="float32", num_pages=16, page_size=16,
                                                max_batch_size=2, kernels=KernelChoices(rope_kv_pdl=pdl)))
    try:
        assert seen == [(True, True, pdl)]
        assert isinstance(eng.model.kv_write, TorchKvWriter)  # (the CPU: the torch writer, whatever the choice)
    finally:
        eng.close()

"""The bf16 decode products on the wgmma kernel (KernelChoices.bf16_sm90; runner/model/fp8.py bf16_sm90_linear) in the
decoder, on the CPU. The kernel's launch is replaced by a torch emulation of its contract (x @ w.T + bias, plus each
row's LoRA expand v[t, g, :r] @ B_g[slot, :r] over the output spans), and the LoRA kernels by the torch ones under the
CUDA kernels' name, so that the decoder takes its CUDA path: the group's shrink (LoraStepImpl.epilogue_operands), then
the product with the expand inside. A CPU engine so configured gives the default path's tokens with adapters on every
projection and mixed ranks; every projection group of every layer goes through the product once per step, with its
spans and, in steps with adapters, the step's LoRA operands; the shrink runs once per such call and no expand launch
remains. A decoder that dropped the expand, added it twice, passed another group's B or spans, or kept cuBLAS's product
beside it would change the tokens or the counts. With the shrink inside the product too (KernelChoices.sm90_shrink) the
emulation computes v from x and the A pools it is handed, and no shrink launch remains either. The kernel itself:
tests/gpu/test_fp8_sm90_cuda.py; the engine with it against HF + PEFT: tests/gpu/test_families_cuda.py."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import lorafleet.runner.model.decoder as dec
from family_models import family_targets, write_family_model
from lorafleet.runner.config import EngineConfig, KernelChoices
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
from lorafleet.runner.model.fp8 import Fp8Weight, bf16_sm90_applies
from model_helpers import write_random_adapter

NEW = 6


class TorchUnderCudaName:
    """The torch LoRA kernels behind the CUDA kernels' name and keyword arguments, counting shrinks and expands."""

    name = "cuda"

    def __init__(self, inner):
        self.inner, self.shrinks, self.expands = inner, 0, 0

    def shrink(self, v, x, a, ranks, host, seg, **_):
        self.shrinks += 1
        self.inner.shrink(v, x, a, ranks, host, seg)

    def expand(self, ys, v, b, ranks, host, seg, **_):
        self.expands += 1
        self.inner.expand(ys, v, b, ranks, host, seg)

    def add(self, ys, v, x, a, b, ranks, host, seg, *_, **__):
        self.shrink(v, x, a, ranks, host, seg)
        self.expand(ys, v, b, ranks, host, seg)


def row_v(x_row: torch.Tensor, a_rows: torch.Tensor) -> torch.Tensor:
    """One row's shrink in fp32: the formula of every emulation here (the kernels' sums differ in order; on the GPU
    the engine is checked against HF + PEFT instead)."""
    return a_rows.float() @ x_row.float()


def emulated_lora(y: torch.Tensor, x: torch.Tensor, spans, lora) -> None:
    """y += each row's LoRA expand v[t, g, :r] @ B_g[slot, :r] over the output spans, v first computed from x and the
    A pools where `lora` = (v, B pools, ranks, row slots, A pools) has them (the shrink inside the product)."""
    v, b, ranks, row_slot, a = lora
    start = 0
    for g, n in enumerate(spans):
        for t in range(x.shape[0]):
            s = int(row_slot[t])
            if 0 <= s < b[g].shape[0]:
                r = min(int(ranks[g, s]), b[g].shape[1])
                if a is not None:
                    v[t, g, :r] = row_v(x[t], a[g][s, :r])
                y[t, start:start + n] += (v[t, g, :r] @ b[g][s, :r].float()).to(y.dtype)
        start += n


def mixed_requests(ads: dict, seed: int) -> list[Sequence]:
    """Six greedy requests of 5-19 random tokens: the base model and each adapter of `ads` in turn."""
    g = torch.Generator().manual_seed(seed)
    names = [None] + sorted(ads)
    return [Sequence(f"r{i}", torch.randint(3, 256, (int(torch.randint(5, 20, (1,), generator=g)),),
                                            generator=g).tolist(), SamplingParams(max_tokens=NEW, ignore_eos=True),
                     AdapterRef(names[i % len(names)], str(ads[names[i % len(names)]])) if names[i % len(names)]
                     else None) for i in range(6)]


def emulated_product(calls, syncs=None):
    """bf16_sm90_linear's contract in torch, recording (spans, whether LoRA operands came) per call. With A pools in
    the operands, the kernel's shrink first: v[t, g, :r] = A_g[slot, :r] @ x[t] (the counters `sync`, zero int32, of
    one layer and group: recorded by address in `syncs`)."""

    def run(ext, x, w, bias, spans, lora, unit, sync=None, shrink_producer=False):
        assert ext == "ext" and unit.numel() >= max(x.shape[0], w.shape[0]) and bool((unit == 1).all())
        assert not shrink_producer or (sync is not None and sync.numel() >= 4)  # (four counters on those warps)
        calls.append((tuple(spans), lora is not None)
                     + (("producer",) if shrink_producer and lora is not None and lora[4] is not None else ()))
        y = F.linear(x, w, bias)
        if lora is not None:
            v, b, ranks, row_slot, a = lora
            assert len(b) == len(spans) and all(bg.shape[2] == n for bg, n in zip(b, spans))
            if a is not None:  # the shrink inside the product
                assert syncs is not None and sync.dtype == torch.int32 and sync.numel() >= 3
                assert not sync.any()
                syncs.add(sync.data_ptr())
                assert len(a) == len(spans) and all(ag.shape[2] == x.shape[1] for ag in a)
            emulated_lora(y, x, spans, lora)
        return y
    return run


def emulated_shrink_first(calls, syncs, ops):
    """bf16_sm90_shrink_first's contract in torch (emulated_product's arithmetic: the same bits as the one launch;
    with `act`, the ops' act_mul on it), recording (spans, whether LoRA operands came, "first"[, "act"][, "early"])
    per call (`early`: the epilogue's launch lets the next kernel start at once, the same bits)."""
    product = emulated_product(calls, syncs)

    def run(ext, x, w, bias, spans, lora, unit, sync, act=0, early=False):
        assert sync is not None and (act or (lora is not None and lora[4] is not None))
        y = product(ext, x, w, bias, spans, lora, unit, sync if lora is not None and lora[4] is not None else None)
        calls[-1] = calls[-1] + ("first",) + (("act",) if act else ()) + (("early",) if early else ())
        if act:
            assert len(spans) == 2 and spans[0] == spans[1]
            y = ops.act_mul(y, spans[0])
        return y
    return run


def run(model, ads, on: bool, monkeypatch, in_product: bool | str = False, syncs=None):
    seqs = mixed_requests(ads, seed=11)
    eng = Engine(str(model), EngineConfig(device="cpu", max_batch_size=8, page_size=4, num_pages=200, max_lora_rank=16,
                                          max_step_tokens=64, kernels=KernelChoices(
                                              bf16_sm90=on, sm90_shrink_producer=in_product == "producer",
                                              sm90_shrink_first=in_product == "shrink_first")))
    calls: list = []
    shim = TorchUnderCudaName(eng.runner.sgmv)
    eng.runner.sgmv = shim
    d = eng.model
    assert d.bf16_sm90 is False  # a CPU device: the choice is not taken by itself
    if on:  # as on a compute capability 9.0 GPU whose build has the kernel
        d.bf16_sm90, d.sm90_ext, d.unit_scales = True, "ext", torch.ones(512)
        if in_product:  # as Decoder._take_bf16_sm90 with KernelChoices.sm90_shrink
            d.sm90_sync = torch.zeros(d.num_layers * 4, 4, dtype=torch.int32)
        monkeypatch.setattr(dec, "bf16_sm90_applies", lambda x, w, b, spans: x.shape[0] <= 64)
        product = emulated_product(calls, syncs)
        monkeypatch.setattr(dec, "bf16_sm90_linear", product)
        monkeypatch.setattr(dec, "bf16_sm90_shrink_first", emulated_shrink_first(calls, syncs, d.ops))
        if in_product == "shrink_first":  # (gate_up's activation in the epilogue: asked with flashinfer's ops)
            monkeypatch.setattr(d.ops, "name", "flashinfer")
    try:
        out = eng.run_to_completion(seqs)
    finally:
        eng.close()
    return [out[f"r{i}"].output_ids for i in range(len(seqs))], d, calls, shim


@pytest.mark.parametrize("in_product", [False, True, "short_k", "producer", "shrink_first"])
@pytest.mark.parametrize("family", ["llama3", "qwen2", "phi3"])
def test_bf16_products_with_the_expand_inside_give_the_default_tokens(tmp_path, family, in_product, monkeypatch):
    """(qwen2: q, k and v biases; phi3: fused qkv and gate_up in the checkpoint; in_product: the shrink inside the
    product too, each layer and group with counters of its own; "short_k": only where K is the hidden size, as
    SM90_SHRINK_MAX_K below the intermediate size makes it: down keeps the shrink's own launch; "producer":
    KernelChoices.sm90_shrink_producer with SM90_SHRINK_MAX_K as "short_k" sets it: down takes the shrink inside too,
    and every product with A pools asks for the producer's warps; "shrink_first": KernelChoices.sm90_shrink_first with
    "short_k"'s SM90_SHRINK_MAX_K: every product with A pools, down's too, takes bf16_sm90_shrink_first's two
    launches, no other asks for the producer's warps)"""
    model = write_family_model(family, tmp_path / "m", seed=2)
    ads = {"all": write_random_adapter(model, tmp_path / "all", r=8, alpha=16, targets=family_targets(family), seed=3),
           "mlp": write_random_adapter(model, tmp_path / "mlp", r=4, alpha=8, targets=family_targets(family, "mlp"),
                                       seed=4)}
    want, d0, none, plain = run(model, ads, False, monkeypatch)
    if in_product in ("short_k", "producer", "shrink_first"):
        assert d0.cfg.intermediate_size > d0.cfg.hidden_size
        monkeypatch.setattr(dec, "SM90_SHRINK_MAX_K", d0.cfg.hidden_size)
    syncs: set[int] = set()
    got, d, calls, shim = run(model, ads, True, monkeypatch, in_product, syncs if in_product else None)
    assert got == want
    if in_product:
        # no LoRA launch of its own left but the step's first shrink (its launch stands between the ops that compute
        # the row slots and the first product, which reads them before its wait)
        with_lora = sum(1 for c in calls if c[1])
        if in_product == "producer":  # (every call with LoRA but the step's first, whose shrink was launched)
            assert all(len(c) == 2 + (c[1] and len(c) == 3) for c in calls)
            assert sum(1 for c in calls if len(c) == 3) == (4 * d.num_layers - 1) * shim.shrinks
        elif in_product == "shrink_first":  # (every call with LoRA but the step's first, whose shrink was launched;
            # gate_up's also applies the activation)
            firsts = [c for c in calls if "first" in c]
            assert all(c[1] and c[2] == "first" for c in firsts) and len(calls) - len(firsts) == sum(
                1 for c in calls if len(c) == 2)
            assert len(firsts) == (4 * d.num_layers - 1) * shim.shrinks
            gate_up = (d.cfg.intermediate_size, d.cfg.intermediate_size)
            assert [c[0] for c in firsts if "act" in c] == [gate_up] * (d.num_layers * shim.shrinks)
        else:
            assert all(len(c) == 2 for c in calls)
        launched = 1 + d.num_layers if in_product == "short_k" else 1  # the first shrink (and each layer's down's)
        assert shim.expands == 0 and shim.shrinks > 0 and with_lora * launched == 4 * d.num_layers * shim.shrinks
        assert len(syncs) == 4 * d.num_layers - launched  # one set of counters per layer and group that shrinks inside
        return
    assert none == [] and plain.shrinks > 0 and plain.expands == plain.shrinks
    c = d.cfg
    kinds = {(c.q_dim, c.kv_dim, c.kv_dim): 0, (c.hidden_size,): 0, (c.intermediate_size, c.intermediate_size): 0,
             (c.vocab_size,): 0}
    for spans, *_ in calls:
        kinds[spans] += 1  # a KeyError: spans of no group
    layers_steps = kinds[(c.q_dim, c.kv_dim, c.kv_dim)]
    assert layers_steps > 0 and layers_steps % c.num_layers == 0
    # the lm_head on the same kernel: every step's logit rows (a step of more than 64 token rows has fewer logit rows)
    assert kinds[(c.vocab_size,)] >= layers_steps // c.num_layers
    assert kinds[(c.intermediate_size, c.intermediate_size)] == layers_steps  # gate_up
    assert kinds[(c.hidden_size,)] == 2 * layers_steps  # o and down
    with_lora = sum(1 for c in calls if c[1])
    assert with_lora > 0
    assert shim.expands == 0 and shim.shrinks == with_lora  # the expand only inside the product


def test_gemma3_in_the_two_launches_gives_the_default_tokens(tmp_path, monkeypatch):
    """The same for gemma3 in the two launches (GELU-tanh in gate_up's epilogue; sandwich norms)."""
    test_bf16_products_with_the_expand_inside_give_the_default_tokens(tmp_path, "gemma3", "shrink_first", monkeypatch)


def test_the_products_launch_hands_the_kernel_its_operands(monkeypatch):
    """bf16_sm90_linear against a stand-in for the extension: the output [M, N] in x's dtype, x and w as given (a
    strided weight too), unit scales of M and N ones, the bias, the spans as a list, the LoRA operands in order (or
    none: no v, no B pools, no ranks, no row slots), programmatic dependent launch on, the current stream."""
    from lorafleet.runner.model.fp8 import bf16_sm90_linear

    seen = {}

    class Ext:
        def fp8_gemm_sm90_fused(self, *args, **kwargs):
            seen["args"] = args
            if kwargs:
                seen["kwargs"] = kwargs
            args[0].fill_(7)

    bf = torch.bfloat16
    x, w = torch.zeros(3, 64, dtype=bf), torch.zeros(48, 128, dtype=bf)[:, :64]
    bias, unit = torch.zeros(48, dtype=bf), torch.ones(100)
    lora = (torch.zeros(3, 2, 8), (torch.zeros(4, 8, 16), torch.zeros(4, 8, 32)), torch.zeros(2, 4, dtype=torch.int32),
            torch.zeros(3, dtype=torch.int32), None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=1234))
    out = bf16_sm90_linear(Ext(), x, w, bias, (16, 32), lora, unit)
    got = seen["args"]
    assert out.shape == (3, 48) and out.dtype == bf and bool((out == 7).all()) and got[0] is out
    assert got[1] is x and got[2] is w and got[5] is bias and got[6] == [16, 32]
    assert got[3].shape == (3,) and got[4].shape == (48,) and bool((got[3] == 1).all() and (got[4] == 1).all())
    assert got[7] is lora[0] and got[8] == list(lora[1]) and got[9] is lora[2] and got[10] is lora[3]
    assert got[11] is True and got[12] == 1234
    assert "kwargs" not in seen  # no shrink inside: no A pools, no counters
    bf16_sm90_linear(Ext(), x, w, None, [48], None, unit)
    got = seen["args"]
    assert got[5] is None and got[7:11] == (None, [], None, None)
    pools, sync = (torch.zeros(4, 8, 64), torch.zeros(4, 8, 64)), torch.zeros(4, dtype=torch.int32)
    bf16_sm90_linear(Ext(), x, w, bias, (16, 32), lora[:4] + (pools,), unit, sync)
    assert seen["kwargs"]["a"] == list(pools) and seen["kwargs"]["sync"] is sync and seen["args"][7] is lora[0]
    assert "persistent" not in seen["kwargs"]  # the one-CTA-a-tile kernel, the only one for bf16 operands


def test_the_two_launches_hand_the_kernels_their_operands(monkeypatch):
    """bf16_sm90_shrink_first against a stand-in for the extension: fp8_gemm_sm90 into a fresh fp32 [M, N] with x and
    w as given, one part, and with A pools the shrink's operands (lora_x x itself, the spans, LoRA in order, the
    counters, the producer's warps by default); without A pools no shrink operands; then fp8_epilogue from that fp32
    output with unit scales of M and N ones, the bias, the spans, LoRA (or none), programmatic dependent launch on, the
    current stream, `act`; its output [M, N] in x's dtype, [M, N / 2] with `act`."""
    from lorafleet.runner.model.fp8 import bf16_sm90_shrink_first

    seen = {}

    class Ext:
        def fp8_gemm_sm90(self, *args, **kwargs):
            seen["gemm"], seen["gemm_kw"] = args, kwargs

        def fp8_epilogue(self, *args, **kwargs):
            seen["epi"], seen["epi_kw"] = args, kwargs
            args[0].fill_(7)

    bf = torch.bfloat16
    x, w = torch.zeros(3, 64, dtype=bf), torch.zeros(48, 128, dtype=bf)[:, :64]
    bias, unit, sync = torch.zeros(48, dtype=bf), torch.ones(100), torch.zeros(4, dtype=torch.int32)
    pools = (torch.zeros(4, 8, 64), torch.zeros(4, 8, 64))
    lora = (torch.zeros(3, 2, 8), (torch.zeros(4, 8, 24), torch.zeros(4, 8, 24)), torch.zeros(2, 4, dtype=torch.int32),
            torch.zeros(3, dtype=torch.int32), pools)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=1234))
    out = bf16_sm90_shrink_first(Ext(), x, w, bias, (24, 24), lora, unit, sync)
    g, kw, e = seen["gemm"], seen["gemm_kw"], seen["epi"]
    y = g[0]
    assert y.shape == (3, 48) and y.dtype == torch.float32 and g[1] is x and g[2] is w and g[3:] == (1234, 1)
    assert kw["lora_x"] is x and kw["cols"] == [24, 24] and kw["v"] is lora[0] and kw["b"] == list(lora[1])
    assert kw["ranks"] is lora[2] and kw["row_slot"] is lora[3] and kw["a"] == list(pools) and kw["sync"] is sync
    assert kw["shrink_producer"] is True
    assert out.shape == (3, 48) and out.dtype == bf and bool((out == 7).all()) and e[0] is out and e[1] is y
    assert e[2].shape == (3,) and e[3].shape == (48,) and bool((e[2] == 1).all() and (e[3] == 1).all())
    assert e[4] is bias and e[5] == [24, 24] and e[6] is lora[0] and e[7] == list(lora[1]) and e[8] is lora[2]
    assert e[9] is lora[3] and e[10:] == (True, 1234, 0) and seen["epi_kw"] == {}
    bf16_sm90_shrink_first(Ext(), x, w, bias, (24, 24), lora, unit, sync, early=True)  # the next kernel at once
    assert seen["epi_kw"] == {"early": True} and seen["epi"][10:] == (True, 1234, 0)
    out = bf16_sm90_shrink_first(Ext(), x, w, None, [24, 24], lora[:4] + (None,), unit, None, act=1)  # v written
    assert seen["gemm_kw"] == {} and out.shape == (3, 24) and seen["epi"][6] is lora[0] and seen["epi"][-1] == 1
    bf16_sm90_shrink_first(Ext(), x, w, None, [48], None, unit, None)  # no LoRA: no expand
    assert seen["gemm_kw"] == {} and seen["epi"][6:10] == (None, [], None, None)
    with pytest.raises(ValueError, match="needs the call site's counters"):
        bf16_sm90_shrink_first(Ext(), x, w, bias, (24, 24), lora, unit, None)


def test_the_wgmma_kernel_takes_only_the_products_it_can():
    bf = torch.bfloat16
    x, w = torch.zeros(32, 64, dtype=bf), torch.zeros(48, 64, dtype=bf)
    assert bf16_sm90_applies(x, w, None, [16, 16, 16])
    assert bf16_sm90_applies(x, w, torch.zeros(48, dtype=bf), [48])
    wide = torch.zeros(48, 64 + 64, dtype=bf)[:, :64]  # spare columns (Decoder.widen_for_lora)
    assert bf16_sm90_applies(x, wide, None, [48])
    refused = {
        "65 rows": (torch.zeros(65, 64, dtype=bf), w, None, [48]),
        "fp16": (x.half(), w.half(), None, [48]),
        "fp32 weight": (x, w.float(), None, [48]),
        "an FP8 weight": (x, Fp8Weight(torch.zeros(48, 64, dtype=torch.float8_e4m3fn), torch.ones(48)), None, [48]),
        "K not a multiple of 16": (torch.zeros(32, 40, dtype=bf), torch.zeros(48, 40, dtype=bf), None, [48]),
        "N not a multiple of 8": (x, torch.zeros(44, 64, dtype=bf), None, [44]),
        "spans not covering N": (x, w, None, [16, 16]),
        "a span not a multiple of 8": (x, w, None, [20, 28]),
        "four spans": (x, w, None, [8, 8, 16, 16]),
        "rows closer than K": (x, torch.zeros(48, 64, dtype=bf).as_strided((48, 64), (56, 1)), None, [48]),
        "rows not 16-byte aligned": (x, torch.zeros(48, 64 + 4, dtype=bf)[:, :64], None, [48]),
        "strided x": (torch.zeros(32, 128, dtype=bf)[:, :64], w, None, [48]),
        "an fp32 bias": (x, w, torch.zeros(48), [48]),
    }
    for why, args in refused.items():
        assert not bf16_sm90_applies(*args), why

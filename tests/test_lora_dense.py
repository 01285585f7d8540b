"""LoRA's dense path for long prompt chunks (runner/lora/step.py): which steps take it, its product against
an independent per-row fp32 loop, and an engine on it against HF transformers + PEFT."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lorafleet.runner.config import EngineConfig, KernelChoices
from lorafleet.runner.lora import step as lora_step
from lorafleet.runner.lora.segments import build_segments
from lorafleet.runner.lora.sgmv import TorchSGMV, fp32_loop_reference
from lorafleet.runner.lora.step import LoraStepImpl, dense_lora_bounds

K, R, S = 12, 4, 3
OUTS = (8, 4, 4)


def _rows(*runs):
    out = []
    for n, slot in runs:
        out += [slot] * n
    return out


LLAMA2_7B_LAYER = 202_375_168  # projection weight elements of one layer


@pytest.mark.parametrize("runs,tokens,rows,elems,want", [
    ([(1200, 0)], 1200, 256, LLAMA2_7B_LAYER, [(0, 1200, 0)]),
    ([(600, 0), (10, -1), (600, 2)], 1210, 256, LLAMA2_7B_LAYER, [(0, 600, 0), (610, 1210, 2)]),  # unadapted rows
    ([(1000, 0)], 1000, 256, LLAMA2_7B_LAYER, None),  # too little work in the step
    ([(1200, 0)], 1200, 256, LLAMA2_7B_LAYER // 2, None),  # ... e.g. a rank's half of the layer
    ([(2048, 0)], 2048, 256, LLAMA2_7B_LAYER // 2, [(0, 2048, 0)]),  # ... with twice the rows
    ([(2048, 0)], 2048, 256, 3_500_000, None),  # a 135M model never qualifies
    ([(1200, 0), (100, 1)], 1300, 256, LLAMA2_7B_LAYER, None),  # one segment too short
    ([(300, s % 5) for s in range(5)], 1500, 256, LLAMA2_7B_LAYER, None),  # more than DENSE_LORA_MAX_SEGMENTS
    ([(1200, 0)], 1200, 0, LLAMA2_7B_LAYER, None),  # switched off
    ([(1200, -1)], 1200, 256, LLAMA2_7B_LAYER, None),  # no adapter at all
])
def test_which_steps_take_the_dense_path(runs, tokens, rows, elems, want):
    seg = build_segments(_rows(*runs))
    assert dense_lora_bounds(seg, tokens, KernelChoices(dense_lora_rows=rows), elems) == want


def _pool(gen, dtype):
    """A group's pool: A and B of 3 slots, rows beyond each slot's rank filled with large values that must never
    be read; slot 1 leaves projection 1 unadapted, slot 2 adapts only projection 1."""
    host = [[4, 4, 0], [3, 0, 1], [2, 4, 0]]  # [G][S]: slot 2 adapts projection 1 only
    a = [torch.randn(S, R, K, generator=gen).to(dtype) for _ in OUTS]
    b = [torch.randn(S, R, n, generator=gen).to(dtype) for n in OUTS]
    for g in range(len(OUTS)):
        for s in range(S):
            a[g][s, host[g][s]:] = 1e4
            b[g][s, host[g][s]:] = 1e4
    ranks = torch.tensor(host, dtype=torch.int32)
    return SimpleNamespace(group_args=[[(a, b, ranks, host)]], device=torch.device("cpu"), max_rank=R), a, b, host


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("runs", [
    [(10, 2), (4, -1), (16, 0), (10, 1)],  # a row run without adapter: zeros there
    [(20, 1), (20, 0)],  # every row adapted; slot 1 leaves projection 1 at zero
])
def test_dense_linear_equals_the_fp32_loop(runs, bias):
    gen = torch.Generator().manual_seed(len(runs) + bias)
    pool, a, b, host = _pool(gen, torch.float32)
    row_slots = _rows(*runs)
    seg = build_segments(row_slots)
    T = len(row_slots)
    x = torch.randn(T, K, generator=gen)
    w = torch.randn(sum(OUTS), K, generator=gen)
    bvec = torch.randn(sum(OUTS), generator=gen) if bias else None
    bounds = [(seg.host_indptr[i], seg.host_indptr[i + 1], s) for i, s in enumerate(seg.host_slots) if s >= 0]
    impl = LoraStepImpl(pool, TorchSGMV(), seg, dense=bounds)
    y = impl.dense_linear(0, 0, x, w, bvec)
    want = x.double() @ w.double().t() + torch.cat(fp32_loop_reference(x, a, b, host, row_slots), 1).double()
    if bias:
        want += bvec.double()
    assert y.shape == (T, sum(OUTS))
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    # the add-on is really there, and absent on rows without an adapter
    base = x.double() @ w.double().t() + (bvec.double() if bias else 0)
    adapted = torch.tensor([s >= 0 for s in row_slots])
    assert (y.double() - base)[adapted].abs().max() > 1e-2
    torch.testing.assert_close(y.double()[~adapted], base[~adapted], rtol=1e-5, atol=1e-4)


def _wide(t: torch.Tensor, spare: int, fill: float = 0.0) -> torch.Tensor:
    """t as the [:, :K] view of a [N, K + spare] tensor whose spare columns hold `fill` (Decoder.widen_for_lora's
    layout; NaN: what no product may read before the step writes it)."""
    wide = torch.full((t.shape[0], t.shape[1] + spare), fill, dtype=t.dtype)
    wide[:, :t.shape[1]] = t
    return wide[:, :t.shape[1]]


def _reference(x, w, bvec, a, b, host, row_slots):
    want = x.double() @ w.double().t() + torch.cat(fp32_loop_reference(x, a, b, host, row_slots), 1).double()
    return want + bvec.double() if bvec is not None else want


@pytest.mark.parametrize("x_spare", [0, 8, 24])  # 0, 8: no room beside x for the blocks: the add-on written first
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("runs", [
    [(10, 2), (4, -1), (16, 0), (10, 1)],  # blocks: slot 2: 1 column, slot 0: 4 + 3 + 2, slot 1: 4 + 4 (18)
    [(20, 1), (20, 0)],  # 17 columns
])
def test_k_extended_gemm_equals_the_fp32_loop(runs, bias, x_spare, monkeypatch):
    """With spare columns in the weight and room for the blocks beside x (the previous projection's wide output),
    dense_linear is one GEMM over [x | V] and [W | B]; without that room the add-on is written first. Either way the
    fp32 loop's result, x's own columns untouched."""
    gen = torch.Generator().manual_seed(len(runs) + 2 * bias + x_spare)
    pool, a, b, host = _pool(gen, torch.float32)
    row_slots = _rows(*runs)
    seg = build_segments(row_slots)
    T = len(row_slots)
    # spare columns full of NaN (torch.empty's garbage in the engine): the step must write every one it reads
    x = _wide(torch.randn(T, K, generator=gen), x_spare, math.nan) if x_spare else torch.randn(T, K, generator=gen)
    x0 = x.clone()
    w = _wide(torch.randn(sum(OUTS), K, generator=gen), 3 * 6, math.nan)
    bvec = torch.randn(sum(OUTS), generator=gen) if bias else None
    bounds = [(seg.host_indptr[i], seg.host_indptr[i + 1], s) for i, s in enumerate(seg.host_slots) if s >= 0]
    calls = []
    real = LoraStepImpl._kext_linear
    monkeypatch.setattr(LoraStepImpl, "_kext_linear",
                        staticmethod(lambda *args: calls.append(args[-2][1]) or real(*args)))
    y = LoraStepImpl(pool, TorchSGMV(), seg, dense=bounds).dense_linear(0, 0, x, w, bvec, out_spare=7)
    used = sum(r for g in range(3) for r in [host[g][s] for _, _, s in bounds])
    assert calls == ([used] if x_spare >= used else [])  # the columns used
    torch.testing.assert_close(y.double(), _reference(x0, w, bvec, a, b, host, row_slots), rtol=1e-5, atol=1e-4)
    assert torch.equal(x, x0)
    assert y.stride(0) == sum(OUTS) + 7  # the room asked for beside the output
    if x_spare:  # V went into x's own spare columns where they hold the blocks
        beside = x.as_strided((T, K + x_spare), (x.stride(0), 1))[:, K:K + used]
        assert (not beside.isnan().any() and beside.abs().sum() > 0) == (x_spare >= used)


def test_k_extended_gemm_rewrites_every_spare_column_it_reads():
    """The spare columns of one step (slot 0: all three projections) hold nothing the next step (slot 2: only
    projection 1; then slot 1) reads: each result is the fp32 loop's, and a step whose blocks do not fit takes the
    add-on-first path and leaves the spare columns alone."""
    gen = torch.Generator().manual_seed(5)
    pool, a, b, host = _pool(gen, torch.float32)
    w = _wide(torch.randn(sum(OUTS), K, generator=gen), 3 * 4, math.nan)
    for slot in (0, 2, 1, 0):
        seg = build_segments([slot] * 12)
        x = _wide(torch.randn(12, K, generator=gen), 12, math.nan)
        y = LoraStepImpl(pool, TorchSGMV(), seg, dense=[(0, 12, slot)]).dense_linear(0, 0, x, w, None)
        torch.testing.assert_close(y.double(), _reference(x, w, None, a, b, host, [slot] * 12), rtol=1e-5, atol=1e-4)
    spare = w.as_strided((w.shape[0], w.shape[1] + 12), (w.stride(0), 1))[:, K:].clone()
    # the widest step (slot 0: 4 + 3 + 2 columns) wrote 9 columns; the 3 beyond were never touched
    assert not spare[:, :9].isnan().any() and spare[:, 9:].isnan().all()
    seg = build_segments([0] * 6 + [1] * 6 + [2] * 6)  # 9 + 8 + 1 = 18 columns > 12: add-on first
    x = _wide(torch.randn(18, K, generator=gen), 24, math.nan)
    y = LoraStepImpl(pool, TorchSGMV(), seg, dense=[(0, 6, 0), (6, 12, 1), (12, 18, 2)]).dense_linear(0, 0, x, w, None)
    torch.testing.assert_close(y.double(), _reference(x, w, None, a, b, host, [0] * 6 + [1] * 6 + [2] * 6),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(w.as_strided((w.shape[0], w.shape[1] + 12), (w.stride(0), 1))[:, K:], spare, rtol=0,
                               atol=0, equal_nan=True)
    assert x.as_strided((18, K + 24), (x.stride(0), 1))[:, K:].isnan().all()  # nor x's


def test_k_extended_weight_blocks_are_kept_while_their_slots_are_unchanged():
    """The weight's spare columns keep a step's B blocks, and the pool the stacked A rows of a one-segment step: a
    next step with the same blocks of slots not written since (LoraPool.slot_writes) reuses them, so a slot changed
    behind the pool's back would go unseen (shown here on purpose), and any write to one of the step's slots, or
    another layout, has them written again."""
    gen = torch.Generator().manual_seed(9)
    pool, a, b, host = _pool(gen, torch.float32)
    pool.slot_writes, pool.uid, pool.kext_a_rows = [0] * S, 1, {}
    w = _wide(torch.randn(sum(OUTS), K, generator=gen), 3 * 4, math.nan)

    def step(slot):
        seg = build_segments([slot] * 10)
        x = _wide(torch.randn(10, K, generator=gen), 12, math.nan)
        y = LoraStepImpl(pool, TorchSGMV(), seg, dense=[(0, 10, slot)]).dense_linear(0, 0, x, w, None)
        return x, y

    x, y = step(0)
    torch.testing.assert_close(y.double(), _reference(x, w, None, a, b, host, [0] * 10), rtol=1e-5, atol=1e-4)
    kept, kept_a = [t.clone() for t in b], [t.clone() for t in a]
    assert set(pool.kext_a_rows) == {(0, 0)}
    for g in range(3):
        b[g][0, :host[g][0]] += 1.0  # slot 0 changed without the pool knowing
        a[g][0, :host[g][0]] -= 0.5
    x, y = step(0)  # the blocks in the weight and the stacked A rows are the earlier ones
    torch.testing.assert_close(y.double(), _reference(x, w, None, kept_a, kept, host, [0] * 10), rtol=1e-5, atol=1e-4)
    pool.slot_writes[0] += 1  # what LoraPool.write does
    x, y = step(0)
    torch.testing.assert_close(y.double(), _reference(x, w, None, a, b, host, [0] * 10), rtol=1e-5, atol=1e-4)
    assert len(pool.kext_a_rows) == 1  # one stack per layer and group
    for slot in (2, 0):  # another layout, then back: written again each time
        x, y = step(slot)
        torch.testing.assert_close(y.double(), _reference(x, w, None, a, b, host, [slot] * 10), rtol=1e-5, atol=1e-4)
    for g in range(3):
        b[g][0, :host[g][0]] -= 1.0  # (unseen again) ...
    pool.uid = 2  # ... but another pool's engine wrote the same weight's spare columns last
    x, y = step(0)
    torch.testing.assert_close(y.double(), _reference(x, w, None, a, b, host, [0] * 10), rtol=1e-5, atol=1e-4)


def test_k_extended_weight_zeros_are_kept_for_blocks_of_the_same_layout():
    """One adapter after another with the same ranks (the distinct-prompts case): only the blocks are written, the
    zeros around them stay from the first step (shown on purpose: NaN put there afterwards is read); a step of
    another layout zeroes the spare columns again."""
    gen = torch.Generator().manual_seed(13)
    pool, a, b, host = _pool(gen, torch.float32)
    for g in range(3):  # slot 1 gets slot 0's ranks (the same layout), with fresh rows
        host[g][1] = host[g][0]
        a[g][1, :host[g][1]] = torch.randn(host[g][1], K, generator=gen)
        b[g][1, :host[g][1]] = torch.randn(host[g][1], OUTS[g], generator=gen)
    pool.group_args[0][0] = (a, b, torch.tensor(host, dtype=torch.int32), host)
    pool.slot_writes, pool.uid, pool.kext_a_rows = [0] * S, 1, {}
    w = _wide(torch.randn(sum(OUTS), K, generator=gen), 3 * 4, math.nan)
    spare = w.as_strided((w.shape[0], K + 12), (w.stride(0), 1))[:, K:]

    def step(slot):
        seg = build_segments([slot] * 10)
        x = _wide(torch.randn(10, K, generator=gen), 12, math.nan)
        y = LoraStepImpl(pool, TorchSGMV(), seg, dense=[(0, 10, slot)]).dense_linear(0, 0, x, w, None)
        return y, _reference(x, w, None, a, b, host, [slot] * 10)

    for slot in (0, 1, 0):
        y, want = step(slot)
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    spare[0, 4] = math.nan  # q's row, k's block column: a zero the layout keeps
    y, _ = step(1)
    assert y[:, 0].isnan().all() and not y[:, 1:].isnan().any()
    for slot in (2, 1):  # another layout zeroes again, then slot 1's blocks are written afresh
        y, want = step(slot)
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)


def test_dense_linear_refuses_a_weight_that_does_not_match_the_group():
    gen = torch.Generator().manual_seed(0)
    pool, *_ = _pool(gen, torch.float32)
    seg = build_segments(_rows((8, 0)))
    impl = LoraStepImpl(pool, TorchSGMV(), seg, dense=[(0, 8, 0)])
    with pytest.raises(ValueError, match="cover 16 columns, the weight has 20"):
        impl.dense_linear(0, 0, torch.randn(8, K), torch.randn(20, K), None)


@pytest.mark.parametrize("kext,slots", [(0, None), (64, None), (64, 1)])
def test_engine_on_the_dense_path_equals_hf_peft(tiny_llama, tmp_path, monkeypatch, kext, slots):
    """Prompts of 40-90 tokens with the work floor lowered: the prompt steps take the dense path (counted), with
    spare weight columns (kext) as K-extended GEMMs (counted), decode steps the usual one; greedy tokens equal
    HF + PEFT's, request by request. One slot: the adapters take turns in it, so the B blocks kept in the weights'
    spare columns must be written again after each load (LoraPool.slot_writes)."""
    from model_helpers import write_random_adapter
    from reference import HFReference
    from lorafleet.runner.engine.engine import Engine
    from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence

    adapters = {
        "a16": write_random_adapter(tiny_llama, tmp_path / "a16", r=16, alpha=32,
                                    targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"), seed=11),
        "a4": write_random_adapter(tiny_llama, tmp_path / "a4", r=4, alpha=8, targets=("v_proj", "up_proj"), seed=12),
        "b16": write_random_adapter(tiny_llama, tmp_path / "b16", r=16, alpha=32,
                                    targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"), seed=13),  # a16's layout, other weights
    }
    calls, kcalls = [], []
    real, kreal = LoraStepImpl.dense_linear, LoraStepImpl._kext_linear

    def counted(self, layer, group, x, w, bias, **kw):
        calls.append((layer, group, x.shape[0]))
        return real(self, layer, group, x, w, bias, **kw)

    monkeypatch.setattr(LoraStepImpl, "dense_linear", counted)
    monkeypatch.setattr(LoraStepImpl, "_kext_linear", staticmethod(lambda *args: kcalls.append(1) or kreal(*args)))
    g = torch.Generator().manual_seed(3)
    # one slot: a16 and b16 take turns in it with the same rank blocks, so only the slot's write count tells them apart
    names = ["a16", "a4", None, "a16"] if slots is None else ["a16", "b16", "a16", "b16"]
    requests = []
    for name in names:
        n = int(torch.randint(40, 90, (1,), generator=g))
        requests.append((torch.randint(3, 512, (n,), generator=g).tolist(), name))
    eng = Engine(str(tiny_llama), EngineConfig(max_batch_size=8, kv_cache_gb=0.25, max_lora_rank=16, page_size=4,
                                               lora_slots=slots,
                                               kernels=KernelChoices(dense_lora_rows=16, dense_lora_kext=kext,
                                                                     dense_lora_min_work=1)))
    lw = eng.executor.model.layers[0]  # the weights carry spare columns exactly when asked to
    assert lw.qkv.stride(0) - lw.qkv.shape[1] == 3 * kext
    assert lw.gate_up.stride(0) - lw.gate_up.shape[1] == 2 * kext
    seqs = [Sequence(f"r{i}", ids, SamplingParams(max_tokens=12), AdapterRef(name, str(adapters[name])) if name else None)
            for i, (ids, name) in enumerate(requests)]
    out = eng.run_to_completion(seqs)
    assert calls, "no step took the dense path"
    assert {grp for _, grp, _ in calls} == {0, 1, 2, 3}
    # the qkv (from layer 1 on) and gate_up inputs normalized inside the previous projection's wide output
    assert (len(kcalls) > 0) == (kext > 0)
    ref = HFReference(tiny_llama, adapters)
    for i, (ids, name) in enumerate(requests):
        assert out[f"r{i}"].output_ids == ref.greedy(ids, name, 12, eos=2), name
    if slots == 1:  # a16, b16, a16, b16 through the one slot
        assert eng.executor.lora_pool.slot_writes[0] >= 2


def _runner(qkv, min_work=1, pool=True):
    from lorafleet.runner.executor.model_runner import ModelRunner

    r = ModelRunner.__new__(ModelRunner)
    r.lora_pool = object() if pool else None
    r.kernels = KernelChoices(dense_lora_rows=256, dense_lora_min_work=min_work)
    r.model = SimpleNamespace(layers=[SimpleNamespace(qkv=qkv, o=torch.empty(8, 8), gate_up=torch.empty(16, 8),
                                                      down=torch.empty(8, 8))])
    r._layer_elems = None
    return r


def test_the_runner_sends_only_prompt_steps_with_plain_weights_down_the_dense_path():
    from lorafleet.runner.model.fp8 import Fp8Weight

    seg = build_segments(_rows((600, 0)))
    prompt = SimpleNamespace(decode_only=False, num_tokens=600)
    d = SimpleNamespace(seg=seg)
    assert _runner(torch.empty(24, 8))._dense_lora(prompt, d) == [(0, 600, 0)]
    assert _runner(torch.empty(24, 8))._dense_lora(SimpleNamespace(decode_only=True, num_tokens=600), d) is None
    assert _runner(torch.empty(24, 8), pool=False)._dense_lora(prompt, d) is None
    # work: 600 rows x 448 elements of this layer
    assert _runner(torch.empty(24, 8), min_work=600 * 448)._dense_lora(prompt, d) == [(0, 600, 0)]
    assert _runner(torch.empty(24, 8), min_work=600 * 448 + 1)._dense_lora(prompt, d) is None
    fp8 = Fp8Weight(torch.zeros(24, 8).to(torch.float8_e4m3fn), torch.ones(24))
    assert _runner(fp8, min_work=0)._dense_lora(prompt, d) is None  # FP8 products cannot accumulate onto it


def test_weights_get_spare_columns_only_where_the_dense_path_can_run(tiny_llama):
    """The default work floor (1,024 rows of a Llama-2-7B layer) is out of a tiny model's reach: its weights stay
    as loaded; so do they without adapters, with the path off, or with LORAFLEET_DENSE_LORA_KEXT=0."""
    from lorafleet.runner.engine.engine import Engine

    def spare(**kw):
        cfg = dict(max_batch_size=4, kv_cache_gb=0.05, max_lora_rank=16, page_size=4)
        cfg.update({k: v for k, v in kw.items() if k == "enable_lora"})
        kernels = KernelChoices(**{k: v for k, v in kw.items() if k != "enable_lora"})
        lw = Engine(str(tiny_llama), EngineConfig(**cfg, kernels=kernels)).executor.model.layers[0]
        return [t.stride(0) - t.shape[1] for t in (lw.qkv, lw.o, lw.gate_up, lw.down)]

    assert spare() == [0, 0, 0, 0]
    assert spare(dense_lora_min_work=1) == [192, 0, 128, 0]  # qkv and gate_up only
    assert spare(dense_lora_min_work=1, dense_lora_kext=8) == [24, 0, 16, 0]
    assert spare(dense_lora_min_work=1, dense_lora_kext=0) == [0, 0, 0, 0]
    assert spare(dense_lora_min_work=1, dense_lora_rows=0) == [0, 0, 0, 0]
    assert spare(dense_lora_min_work=1, enable_lora=False) == [0, 0, 0, 0]


def test_sandwich_norms_leave_their_projection_narrow():
    """A post norm writes the next projection's input into a new tensor: no room beside x, so no spare columns for
    that weight (post_mlp_norm before qkv, post_attn_norm before gate_up)."""
    from lorafleet.runner.model.decoder import Decoder, LayerWeights

    def layer(post_attn, post_mlp):
        return LayerWeights(attn_norm=None, qkv=torch.randn(24, 8), o=torch.randn(8, 8), mlp_norm=None,
                            gate_up=torch.randn(32, 8), down=torch.randn(8, 16),
                            post_attn_norm=torch.ones(8) if post_attn else None,
                            post_mlp_norm=torch.ones(8) if post_mlp else None)

    net = Decoder.__new__(Decoder)
    net.layers = [layer(False, False), layer(True, False), layer(False, True)]
    assert net.widen_for_lora({"qkv": 24, "gate_up": 16}) == 4 * (2 * 24 * 24 + 2 * 32 * 16)  # fp32: two of each
    assert [(lw.qkv.stride(0) - 8, lw.gate_up.stride(0) - 8) for lw in net.layers] == [(24, 16), (24, 0), (0, 16)]

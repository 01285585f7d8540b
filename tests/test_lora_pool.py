"""The adapter pool: slot writes from packed adapters land where the kernels read them."""

from __future__ import annotations

import pytest
import torch

from lorafleet.common.peft_config import AdapterSpec, BaseShape
from lorafleet.models.contract import PROJ_INDEX, PROJECTIONS
from lorafleet.runner.lora.adapter import LoadedAdapter, pack
from lorafleet.runner.lora.pool import LoraPool

BASE = BaseShape(num_layers=3, hidden_size=32, intermediate_size=48, q_dim=32, kv_dim=16)


def adapter(name: str, modules: dict[tuple[int, str], int], seed: int, stacked: bool) -> LoadedAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for (layer, proj), r in modules.items():
        i, o = BASE.shape(proj)
        weights[(layer, proj)] = (torch.randn(r, i, generator=g), torch.randn(r, o, generator=g))
    spec = AdapterSpec(name, None, None, (), 0, "F32")
    if stacked:
        return LoadedAdapter(spec, packed=pack(weights, BASE.num_layers))
    return LoadedAdapter(spec, weights)


def check_slot(pool: LoraPool, slot: int, ad: LoadedAdapter) -> None:
    for layer in range(BASE.num_layers):
        for p, proj in enumerate(PROJECTIONS):
            want = ad.weights.get((layer, proj))
            r = 0 if want is None else want[0].shape[0]
            assert int(pool.ranks[layer, p, slot]) == r == pool.host_ranks[layer][p][slot], (layer, proj)
            if r:
                assert torch.equal(pool.a[layer][p][slot, :r], want[0])
                assert torch.equal(pool.b[layer][p][slot, :r], want[1])


def test_mixed_ranks_and_partial_modules_land_in_their_slot():
    pool = LoraPool(BASE, num_slots=3, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    # ranks differ per layer (rank_pattern) and per projection; layer 1 lacks q; no k at all
    mods = {(0, "q"): 8, (2, "q"): 2, (0, "v"): 4, (1, "v"): 4, (1, "down"): 3, (0, "gate"): 5, (2, "up"): 1}
    for stacked in (True, False):
        a1 = adapter("a1", mods, seed=1, stacked=stacked)
        a2 = adapter("a2", {(layer, "o"): 6 for layer in range(3)}, seed=2, stacked=stacked)
        pool.write(1, a1)
        pool.write(2, a2)
        check_slot(pool, 1, a1)
        check_slot(pool, 2, a2)
        assert int(pool.ranks[:, :, 0].abs().sum()) == 0  # untouched slot
        # reuse slot 1 for a2: nothing of a1 stays visible
        pool.write(1, a2)
        check_slot(pool, 1, a2)
        pool.clear(1)
        pool.clear(2)
        assert int(pool.ranks.abs().sum()) == 0 and all(r == 0 for lay in pool.host_ranks for p in lay for r in p)


def test_a_slot_change_counts_and_lets_go_of_its_stacked_a_rows():
    """write() and clear() move the slot's write count on (what copies of its weights elsewhere are checked against)
    and drop the dense path's stacked A rows of that slot only."""
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv import TorchSGMV
    from lorafleet.runner.lora.step import LoraStepImpl

    pool = LoraPool(BASE, num_slots=3, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    pool.write(0, adapter("a0", {(0, "q"): 4, (0, "k"): 2, (1, "q"): 4, (1, "v"): 1}, seed=3, stacked=True))
    pool.write(1, adapter("a1", {(0, "q"): 4, (0, "v"): 4}, seed=4, stacked=True))
    assert pool.slot_writes == [1, 1, 0]
    w = torch.zeros(BASE.q_dim + 2 * BASE.kv_dim, BASE.hidden_size + 16)[:, :BASE.hidden_size]
    for layer, slot in ((0, 0), (1, 0)):  # one stack per (layer, qkv) of slot 0 ...
        x = torch.zeros(4, BASE.hidden_size + 16)[:, :BASE.hidden_size]
        LoraStepImpl(pool, TorchSGMV(), build_segments([slot] * 4), dense=[(0, 4, slot)]).dense_linear(layer, 0, x, w,
                                                                                                        None)
    x = torch.zeros(4, BASE.hidden_size + 16)[:, :BASE.hidden_size]
    LoraStepImpl(pool, TorchSGMV(), build_segments([1] * 4), dense=[(0, 4, 1)]).dense_linear(0, 0, x, w, None)
    # ... layer 0's replaced by slot 1's (one per layer and group); layer 1 still slot 0's
    assert {k: hit[0][0] for k, hit in pool.kext_a_rows.items()} == {(0, 0): 1, (1, 0): 0}
    pool.clear(0)
    assert pool.slot_writes == [2, 1, 0] and set(pool.kext_a_rows) == {(0, 0)}
    pool.write(1, adapter("a2", {(0, "o"): 2}, seed=5, stacked=True))
    assert pool.slot_writes == [2, 2, 0] and pool.kext_a_rows == {}


def test_packed_views_share_memory_with_the_packed_tensors():
    a = adapter("a", {(0, "q"): 4, (2, "q"): 2}, seed=3, stacked=True)
    pk = a.packed
    assert pk.a[PROJ_INDEX["q"]].shape == (3, 4, 32)
    assert pk.a[PROJ_INDEX["q"]][1].abs().sum() == 0  # layer 1 not adapted: zero rows
    assert a.weights[(2, "q")][0].data_ptr() == pk.a[PROJ_INDEX["q"]][2].data_ptr()
    assert a.nbytes == sum(t.numel() * 4 for t in (*pk.a.values(), *pk.bt.values()))


def test_step_passes_each_groups_tensor_core_thresholds(monkeypatch):
    """Steps with prompt rows give every group its own tensor-core thresholds (GROUP_MMA_ROWS); decode
    steps (mma=False) keep every segment on CUDA cores, in two launches; KernelChoices.sgmv_fused sets the
    launch count of the others. The add-on is the same on every path: here
    TorchSGMV computes it, checked against the independent fp32 loop."""
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv import TorchSGMV, fp32_loop_reference
    from lorafleet.runner.config import KernelChoices
    from lorafleet.runner.lora.step import GROUP_MMA_ROWS, LoraStepImpl

    class Recording(TorchSGMV):
        def __init__(self):
            self.calls = []
            self.ready = []

        def add(self, ys, v, x, a, b, ranks, host_ranks, seg, mma=True, mma_rows=None, fused=True, x_ready=False,
                decode_ranks=0, row_items=False):
            self.calls.append((mma, mma_rows, fused))
            self.ready.append((x_ready, decode_ranks, row_items) if decode_ranks or row_items else x_ready)
            super().add(ys, v, x, a, b, ranks, host_ranks, seg, mma, mma_rows, fused)

    pool = LoraPool(BASE, num_slots=3, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    pool.write(1, adapter("a", {(0, p): 4 for p in PROJECTIONS}, seed=5, stacked=True))
    g = torch.Generator().manual_seed(9)
    row_slots = [1] * 70 + [-1] * 5 + [1] * 3
    # (mma, LORAFLEET_SGMV_FUSED) -> fused: decode graphs (mma=False) always two launches; eager and
    # piecewise steps fused by default (MIXED_FUSED), or as the variable says
    cases = [(True, None, True), (False, None, False), (True, "0", False), (True, "1", True), (False, "1", False)]
    for mma, knob, fused in cases:
        sg = Recording()
        step = LoraStepImpl(pool, sg, build_segments(row_slots), mma=mma,
                            kernels=KernelChoices(sgmv_fused=knob or "auto"))
        x = torch.randn(len(row_slots), BASE.hidden_size, generator=g)
        for group, (p0, n) in enumerate(((0, 3), (3, 1))):  # qkv and o of layer 0: inputs of width hidden
            ys = tuple(torch.zeros(len(row_slots), BASE.shape(PROJECTIONS[p])[1]) for p in range(p0, p0 + n))
            step.add(0, group, x, ys)
            ref = fp32_loop_reference(x, pool.a[0][p0:p0 + n], pool.b[0][p0:p0 + n],
                                      pool.host_ranks[0][p0:p0 + n], row_slots)
            for y, r in zip(ys, ref):
                assert torch.allclose(y, r, rtol=1e-4, atol=1e-4)
        assert sg.calls == [(mma, GROUP_MMA_ROWS[0], fused), (mma, GROUP_MMA_ROWS[1], fused)]
        assert sg.ready == [False, False]  # the shrink waits for the kernel before it unless told otherwise
    # KernelChoices.shrink_early: every call tells the kernels that the base GEMM right before left x alone
    sg = Recording()
    step = LoraStepImpl(pool, sg, build_segments(row_slots), mma=False, kernels=KernelChoices(shrink_early=True))
    x = torch.randn(len(row_slots), BASE.hidden_size, generator=g)
    step.add(0, 1, x, (torch.zeros(len(row_slots), BASE.shape(PROJECTIONS[3])[1]),))
    assert sg.ready == [True]
    # KernelChoices.decode_ranks: the shrink's items of one-row segments, asked of every call, each group its own
    sg = Recording()
    step = LoraStepImpl(pool, sg, build_segments(row_slots), mma=False, kernels=KernelChoices(decode_ranks=4))
    step.add(0, 1, x, (torch.zeros(len(row_slots), BASE.shape(PROJECTIONS[3])[1]),))
    assert sg.ready == [(False, 4, False)]
    sg = Recording()
    step = LoraStepImpl(pool, sg, build_segments(row_slots), mma=False,
                        kernels=KernelChoices(decode_ranks=(4, 1, 2, 0), shrink_row_items=True))
    qkv = tuple(torch.zeros(len(row_slots), BASE.shape(PROJECTIONS[p])[1]) for p in range(3))
    step.add(0, 0, x, qkv)
    step.add(0, 1, x, (torch.zeros(len(row_slots), BASE.shape(PROJECTIONS[3])[1]),))
    assert sg.ready == [(False, 4, True), (False, 1, True)]
    with pytest.raises(ValueError, match="decode_ranks must be 0, 1, 2 or 4"):
        KernelChoices(decode_ranks=3)


def test_qkv_expand_left_to_rope_kv_keeps_the_add_on():
    """Decode graphs with the rope_kv kernel (qkv_expand_in_rope): `add_qkv` runs only the shrink and
    hands over (v, B pools, ranks, slot of each row); the rows stay untouched, and v @ B over those
    operands is the add-on of the independent fp32 loop. Rows past the segment table get slot -1.
    Without the flag `add_qkv` adds the whole add-on itself and hands over nothing."""
    from lorafleet.runner.lora.segments import SegmentTable, build_segments
    from lorafleet.runner.lora.sgmv import TorchSGMV, fp32_loop_reference
    from lorafleet.runner.lora.step import LoraStepImpl

    pool = LoraPool(BASE, num_slots=4, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    pool.write(1, adapter("a", {(0, p): 4 for p in PROJECTIONS}, seed=5, stacked=True))
    pool.write(2, adapter("b", {(0, "q"): 8, (0, "v"): 2}, seed=6, stacked=True))
    g = torch.Generator().manual_seed(11)
    row_slots = [1, 2, 2, -1, 1, 2]
    T = len(row_slots) + 2  # a padded batch: two rows past the table
    table = build_segments(row_slots, capacity=T)
    seg = SegmentTable(table.indptr, table.slots, table.host_indptr, table.host_slots, T)  # as a decode graph's
    x = torch.randn(T, BASE.hidden_size, generator=g)
    widths = [BASE.q_dim, BASE.kv_dim, BASE.kv_dim]
    want = fp32_loop_reference(x[: len(row_slots)], pool.a[0][0:3], pool.b[0][0:3], pool.host_ranks[0][0:3],
                               row_slots)

    step = LoraStepImpl(pool, TorchSGMV(), seg, mma=False, qkv_expand_in_rope=True)
    ys = tuple(torch.zeros(T, w) for w in widths)
    handed = step.add_qkv(0, x, ys)
    assert all(not y.any() for y in ys)  # the expand is left to the kernel
    v, b, ranks, row_slot = handed
    assert row_slot.tolist() == row_slots + [-1, -1]
    for gi, (y_want, w) in enumerate(zip(want, widths)):
        got = torch.zeros(len(row_slots), w)
        for t, s in enumerate(row_slots):
            if s >= 0:
                r = int(ranks[gi, s])
                got[t] = v[t, gi, :r] @ b[gi][s, :r].float()
        assert torch.allclose(got, y_want, rtol=1e-5, atol=1e-5)

    # a table without empty trailing segments: the rows past it still get -1
    tight = build_segments(row_slots)
    seg2 = SegmentTable(tight.indptr, tight.slots, tight.host_indptr, tight.host_slots, T)
    step2 = LoraStepImpl(pool, TorchSGMV(), seg2, mma=False, qkv_expand_in_rope=True)
    assert step2.add_qkv(0, x, tuple(torch.zeros(T, w) for w in widths))[3].tolist() == row_slots + [-1, -1]

    plain = LoraStepImpl(pool, TorchSGMV(), seg, mma=False)
    ys2 = tuple(torch.zeros(T, w) for w in widths)
    assert plain.add_qkv(0, x, ys2) is None
    for y, y_want in zip(ys2, want):
        assert torch.allclose(y[: len(row_slots)], y_want, rtol=1e-5, atol=1e-5)


def test_row_slots_are_made_at_a_step_objects_first_call_whatever_its_layer():
    """The per-row adapter slots the FP8 epilogue and the rope_kv expand read: computed at the first call of a step
    object even when that is not layer 0, recomputed at the layer-0 call of the first group that asks, reused by
    later calls, and sized to the rows asked for (rows past the segment table: -1)."""
    from lorafleet.runner.lora.segments import SegmentTable, build_segments
    from lorafleet.runner.lora.sgmv import TorchSGMV
    from lorafleet.runner.lora.step import LoraStepImpl

    pool = LoraPool(BASE, num_slots=4, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    row_slots = [1, 2, 2, -1, 1]
    table = build_segments(row_slots, capacity=8)
    seg = SegmentTable(table.indptr, table.slots, table.host_indptr, table.host_slots, 5)
    step = LoraStepImpl(pool, TorchSGMV(), seg, mma=False)
    assert step._row_slots(7, 1, 5).tolist() == row_slots  # first call, layer 7
    assert step._row_slots(8, 1, 7).tolist() == row_slots + [-1, -1]  # more rows than before: resized, recomputed
    seg.slots[0] = 3  # the table changes between steps (a graph's static table)
    assert step._row_slots(9, 1, 7).tolist() == row_slots + [-1, -1]  # a later layer reuses the slots
    assert step._row_slots(0, 1, 7).tolist() == [3, 2, 2, -1, 1, -1, -1]  # layer 0 recomputes them (segment 0: row 0)

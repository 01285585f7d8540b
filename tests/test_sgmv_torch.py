"""The plain-torch SGMV against an independent per-row fp32 loop."""

from __future__ import annotations

import pytest
import torch

from lorafleet.runner.lora.segments import build_segments
from lorafleet.runner.lora.sgmv import TorchSGMV, fp32_loop_reference
from lorafleet.common.workloads import WORKLOADS, assign

S, R = 24, 16


def make_pool(in_dim, out_dims, ranks_per_slot, seed):
    g = torch.Generator().manual_seed(seed)
    G = len(out_dims)
    a = [torch.randn(S, R, in_dim, generator=g) * 0.1 for _ in range(G)]
    b = [torch.randn(S, R, od, generator=g) * 0.1 for od in out_dims]
    ranks = [[ranks_per_slot[s] if (g_i + s) % 5 else 0 for s in range(S)] for g_i in range(G)]  # some modules unadapted
    return a, b, ranks


def run_torch(x, a, b, ranks, row_slots, out_dims, fused=False):
    seg = build_segments(row_slots)
    T = x.shape[0]
    if fused:  # outputs as column views of one fused buffer, like q,k,v
        fused_out = torch.randn(T, sum(out_dims) + 7)
        base = fused_out.clone()
        ys = list(fused_out[:, :-7].split(out_dims, dim=-1))
    else:
        ys = [torch.randn(T, od) for od in out_dims]
        base = None
    before = [y.clone() for y in ys]
    v = torch.full((T, len(a), R), float("nan"))
    sg = TorchSGMV()
    sg.shrink(v, x, a, torch.tensor(ranks, dtype=torch.int32), ranks, seg)
    sg.expand(ys, v, b, torch.tensor(ranks, dtype=torch.int32), ranks, seg)
    if fused:
        assert torch.equal(fused_out[:, -7:], base[:, -7:]), "columns outside the views were touched"
    return [y - y0 for y, y0 in zip(ys, before)]


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("n", [1, 7, 24])
def test_workloads_match_loop(workload, n):
    ranks_per_slot = [1 + (s * 5) % R for s in range(S)]  # mixed ranks 1..16
    out_dims = [96, 32, 32]  # a GQA-like q,k,v group
    a, b, ranks = make_pool(64, out_dims, ranks_per_slot, seed=n)
    adapters = assign(workload, n, S, seed=n)
    row_slots = sorted(adapters)  # rows grouped by adapter, as the batch builder does
    # some rows have no adapter
    row_slots = [-1 if i % 6 == 5 else s for i, s in enumerate(row_slots)]
    x = torch.randn(n, 64)
    got = run_torch(x, a, b, ranks, row_slots, out_dims, fused=True)
    want = fp32_loop_reference(x, a, b, ranks, row_slots)
    for gi, (g_, w_) in enumerate(zip(got, want)):
        torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-5, msg=f"projection {gi}")
        for i, s in enumerate(row_slots):
            if s < 0 or ranks[gi][s] == 0:
                assert torch.equal(g_[i], torch.zeros_like(g_[i])), "row without adapter was changed"


def test_prefill_segments_and_ungrouped_rows():
    """Long segments (prefill) and an adapter appearing in two separate segments."""
    ranks_per_slot = [8] * S
    a, b, ranks = make_pool(48, [40], ranks_per_slot, seed=3)
    row_slots = [2] * 100 + [5] * 3 + [-1] * 4 + [2] * 2 + [7]
    x = torch.randn(len(row_slots), 48)
    got = run_torch(x, a, b, ranks, row_slots, [40])
    want = fp32_loop_reference(x, a, b, ranks, row_slots)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)


def test_segment_table_shape():
    seg = build_segments([3, 3, -1, 4, 4, 4, 3], capacity=10)
    assert seg.host_indptr == (0, 2, 3, 6, 7)
    assert seg.host_slots == (3, -1, 4, 3)
    assert seg.indptr.tolist() == [0, 2, 3, 6, 7, 7, 7, 7, 7, 7, 7]
    assert seg.slots.tolist() == [3, -1, 4, 3, -1, -1, -1, -1, -1, -1]
    assert not build_segments([-1, -1]).any_adapter

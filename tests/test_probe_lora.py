"""The LoRA probe's alternative formulations (bench/probe_lora.py) are the same math as the base GEMM plus
each row's own adapter: checked in fp64 on the CPU against an independent per-row loop, so the GPU probe
times what it says it times."""

import importlib.util
from pathlib import Path

import pytest
import torch

spec = importlib.util.spec_from_file_location("probe_lora", Path(__file__).parent.parent / "bench" / "probe_lora.py")
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def per_row_loop(x, w, a, b, row_adapter, outs):
    """y[t] = x[t] W^T + (x[t] A_g^T) B_g for row t's adapter, one row and one projection at a time."""
    y = x @ w.t()
    for t in range(x.shape[0]):
        s, lo = int(row_adapter[t]), 0
        for g, n in enumerate(outs):
            y[t, lo:lo + n] += (a[s, g] @ x[t]) @ b[s, g]
            lo += n
    return y


def case(T, S, K, outs, seed):
    g = torch.Generator().manual_seed(seed)
    R = 4
    x = torch.randn(T, K, generator=g, dtype=torch.float64)
    w = torch.randn(sum(outs), K, generator=g, dtype=torch.float64)
    a = torch.randn(S, len(outs), R, K, generator=g, dtype=torch.float64)
    assert len(set(outs)) == 1  # stacked as [S, G, R, N_g]
    b = torch.randn(S, len(outs), R, outs[0], generator=g, dtype=torch.float64)
    row_adapter = torch.randint(0, S, (T,), generator=g)
    return x, w, a, b, row_adapter


@pytest.mark.parametrize("T,S,K,outs", [(7, 3, 16, (8, 8, 8)), (5, 1, 24, (16,)), (9, 4, 32, (12, 12))])
def test_kcat_operands_give_base_plus_each_rows_adapter(T, S, K, outs):
    x, w, a, b, row_adapter = case(T, S, K, outs, seed=T + S)
    want = per_row_loop(x, w, a, b, row_adapter, outs)
    xe, we = probe.formulations.kcat_operands(x, w, a, b, row_adapter, outs)
    assert xe.shape == (T, K + S * len(outs) * a.shape[2]) and we.shape == (sum(outs), xe.shape[1])
    torch.testing.assert_close(xe @ we.t(), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(probe.formulations.reference(x, w, a, b, row_adapter, outs), want.to(x.dtype),
                               rtol=1e-5, atol=1e-4)  # the reference's fp32 products
    # a row's v sits only in its own adapter's block
    blocks = xe[:, K:].view(T, S, -1)
    for t in range(T):
        others = [s for s in range(S) if s != int(row_adapter[t])]
        assert not blocks[t, others].any()


@pytest.mark.parametrize("K,outs", [(16, (8, 8, 8)), (24, (16,))])
def test_merged_weight_gives_base_plus_the_adapter(K, outs):
    x, w, a, b, _ = case(6, 1, K, outs, seed=K)
    want = per_row_loop(x, w, a, b, torch.zeros(6, dtype=torch.long), outs)
    torch.testing.assert_close(x @ probe.formulations.merged_weight(w, a, b, outs).t(), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("T,S,K,outs", [(7, 3, 16, (8, 8, 8)), (5, 1, 24, (16,)), (9, 4, 32, (12, 12))])
def test_rowcat_weight_gives_y_and_every_slots_v(T, S, K, outs):
    """x @ [W; A_pool]^T: y in the first N columns, slot s's v in its block; each row's own block through its B gives
    the base plus its adapter."""
    x, w, a, b, row_adapter = case(T, S, K, outs, seed=3 * T + S)
    we = probe.formulations.rowcat_weight(w, a)
    G, R = len(outs), a.shape[2]
    assert we.shape == (sum(outs) + S * G * R, K)
    ye = x @ we.t()
    torch.testing.assert_close(ye[:, :sum(outs)], x @ w.t(), rtol=1e-12, atol=1e-12)
    for s in range(S):
        for g in range(G):
            col = sum(outs) + (s * G + g) * R
            torch.testing.assert_close(ye[:, col:col + R], x @ a[s, g].t(), rtol=1e-12, atol=1e-12)
    want = per_row_loop(x, w, a, b, row_adapter, outs)
    torch.testing.assert_close(probe.formulations.rowcat_apply(ye, b, row_adapter, outs, R), want, rtol=1e-10,
                               atol=1e-10)

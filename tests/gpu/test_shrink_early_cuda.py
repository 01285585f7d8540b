"""The LoRA shrink that does not wait for its base GEMM (KernelChoices.shrink_early, csrc/sgmv.h
LaunchOptions::x_ready) on the GPU.

- Kernels: a kernel writes x, the base GEMM reads it, then the shrink (told that x is ready) and the expand;
  eager and captured in a CUDA graph replayed with new x: v, the add-on and the GEMM's output bit for bit those
  of the shrink that waits, and v against an fp64 reference. Decode-shaped tables on CUDA-core items, and a
  long segment on tensor-core items beside one-row segments.
- Engine: a decode step replayed from its CUDA graph with the choice on gives the logits of the same step with
  it off, bit for bit, and the graph's shrinks were launched with it."""

from __future__ import annotations

import math

import pytest
import torch

import teacher
from lorafleet.runner.config import KernelChoices
from lorafleet.runner.lora.segments import build_segments
from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = "cuda"
K, OUT, S, R = 4096, [4096, 1024, 1024], 40, 16
TABLES = {
    # 32 decode rows: distinct adapters, some rows without one
    "decode": [-1 if i % 7 == 3 else (5 * i) % S for i in range(32)],
    # a 150-row segment (tensor-core items at the default thresholds) beside one-row segments and base rows
    "mma": [3] * 150 + [-1 if i % 5 == 0 else (7 * i) % S for i in range(42)],
}


def pool(dtype):
    g = torch.Generator(device=DEV).manual_seed(3)
    ranks = [[0 if (s + p) % 9 == 0 else (16, 8, 13)[p] for s in range(S)] for p in range(3)]
    a = [(torch.randn(S, R, K, generator=g, device=DEV) / math.sqrt(K)).to(dtype) for _ in OUT]
    b = [(torch.randn(S, R, n, generator=g, device=DEV) / 4).to(dtype) for n in OUT]
    return a, b, torch.tensor(ranks, dtype=torch.int32, device=DEV), ranks


def case(table: str, dtype, seed: int):
    """TABLES[table]'s rows, their count, the pool (a, b, ranks, host ranks), the segment table and a generator."""
    row_slots = TABLES[table]
    seg = build_segments(row_slots, device=DEV, capacity=len(row_slots) + 8)
    return row_slots, len(row_slots), pool(dtype), seg, torch.Generator(device=DEV).manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("table", list(TABLES))
def test_shrink_right_after_the_gemm_without_waiting_keeps_the_bits(dtype, table):
    row_slots, T, (a, b, ranks, host), seg, g = case(table, dtype, 5)
    w = (torch.randn(sum(OUT), K, generator=g, device=DEV) / 64).to(dtype)  # the base weight of the 3 projections
    src = torch.randn(T, K, generator=g, device=DEV).to(dtype)
    x, out = torch.empty(T, K, device=DEV, dtype=dtype), torch.empty(T, sum(OUT), device=DEV, dtype=dtype)
    v = torch.empty(T, 3, R, device=DEV)
    sg = CudaSGMV()
    mma = table == "mma"

    def step(ready: bool):
        x.fill_(float("nan"))  # poison: a shrink that read x before the kernels below finished would see NaN
        x.copy_(src)  # a kernel writes x ...
        torch.matmul(x, w.t(), out=out)  # ... the base GEMM reads it and writes y, which the expand adds to
        sg.add(list(out.split(OUT, dim=1)), v, x, a, b, ranks, host, seg, mma=mma, fused=False, x_ready=ready)

    def fresh():
        out.fill_(float("nan"))
        v.fill_(float("nan"))

    results = {}
    for ready in (False, True, False, True):
        fresh()
        step(ready)
        torch.cuda.synchronize()
        got = (out.clone(), v.nan_to_num(nan=-7.0))
        assert not torch.isnan(out).any()
        if ready in results:
            assert all(torch.equal(p, q) for p, q in zip(got, results[ready])), "not reproducible"
        results[ready] = got
    assert all(torch.equal(p, q) for p, q in zip(results[True], results[False])), f"{table}: x_ready changed a bit"

    # v against fp64 where an adapter has a rank, untouched elsewhere
    for p in range(3):
        for t, s in enumerate(row_slots):
            r = host[p][s] if s >= 0 else 0
            got_v = results[True][1][t, p]
            if r == 0:
                assert (got_v == -7.0).all(), (table, p, t)
                continue
            want = src[t].double() @ a[p][s, :r].double().T
            assert (got_v[:r].double() - want).abs().max() <= 1e-4 * want.abs().max() + 1e-6, (table, p, t)
            assert (got_v[r:] == -7.0).all()
    assert not torch.equal(results[True][0], (src @ w.t()).to(dtype))  # the add-on is there

    # captured once with the early shrink, replayed with new x (first), then the waiting shrink eagerly: the same bits
    fresh()
    step(True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(True)
    for seed in (11, 12, 13):
        src.copy_(torch.randn(T, K, generator=torch.Generator(device=DEV).manual_seed(seed), device=DEV).to(dtype))
        fresh()
        graph.replay()
        torch.cuda.synchronize()
        got = (out.clone(), v.nan_to_num(nan=-7.0))
        fresh()
        step(False)
        torch.cuda.synchronize()
        want = (out, v.nan_to_num(nan=-7.0))
        assert all(torch.equal(p, q) for p, q in zip(got, want)), f"{table}: graph replay {seed} differs"


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return teacher.family_with_two_adapters("llama3", tmp_path_factory.mktemp("gpu-early"))


def test_decode_graph_with_the_early_shrink_gives_the_same_logits(fam, monkeypatch):
    """One engine, one decode step of 24 rows, replayed from the engine's graphs (the shrink waits) and from graphs
    captured with the choice on over the same model, pools and pages: the same logits, bit for bit."""
    import dataclasses

    from lorafleet.runner.executor.executor import make_graphs

    model, _, reqs = fam
    told = []
    real = CudaSGMV.shrink

    def recording(self, *args, **kw):
        told.append(bool(kw.get("x_ready", False)))
        return real(self, *args, **kw)

    monkeypatch.setattr(CudaSGMV, "shrink", recording)
    # (cuBLAS's products: with bf16_sm90 the shrink comes before the wgmma product, not after a GEMM)
    eng, batch = teacher.decode_step(model, reqs[:4] * 2, kernels=KernelChoices(bf16_sm90=False))
    assert not (eng.config.kernels or KernelChoices()).shrink_early and not any(told)
    d = batch.to_device(eng.device)
    waiting = [eng.runner.graphs.run(batch, d).clone() for _ in range(2)]
    assert torch.equal(waiting[0], waiting[1])  # a replay is reproducible
    early = make_graphs(eng.model, eng.attention, eng.lora_pool, eng.sgmv,
                        dataclasses.replace(eng.config, kernels=dataclasses.replace(
                            eng.config.kernels or KernelChoices(), shrink_early=True)),
                        eng.runner.graphs.scratch_page)
    assert told.count(True) >= 4 * eng.model.num_layers  # captured with the early shrink
    got = early.run(batch, d)
    assert torch.equal(got, waiting[0])
    assert torch.equal(eng.runner.graphs.run(batch, d), waiting[0])

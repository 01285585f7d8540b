"""The norm with LoRA on either side of it in one launch of thread-block clusters (csrc/sgmv.cu `norm_lora`,
KernelChoices.norm_lora) on the GPU.

- The launch against the separate launches it replaces (the expand of the projection before the norm, the project's
  norm, the CUDA-core shrink of the group after it): x, the residual and v bit for bit, for decode-shaped tables (one
  row per adapter, rows without one), one long segment and short runs; ranks 0 to 128 over one to three projections
  (past the rank rows the launch stages in shared memory); with and without a residual, Llama's and Gemma's scaling;
  widths of the 7B and 70B shapes and a small one. v against an fp64 product, x against an fp64 norm.
- The engine: decode graphs with the choice on (the launch counted while they are captured) give the same logits,
  bit for bit, as decode graphs with the separate launches; against the eager step; teacher-forced against HF + PEFT
  fp32 (llama3, and gemma3 for the (1 + w) scaling, whose sandwich norms keep the separate expands)."""

from __future__ import annotations

import pytest
import torch

import teacher
from lorafleet.runner.config import KernelChoices

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                 reason="needs CUDA with thread-block clusters (compute capability 9.0)")]
BIG = 1 << 30
ROW_LAYOUTS = {
    "decode": lambda T: [(i % 5) - 1 for i in range(T)],  # one row per segment, slot -1 rows too
    "one_segment": lambda T: [2] * T,  # the identical mix: one long segment
    "runs": lambda T: [i // 3 % 4 for i in range(T)],  # three-row segments
}


def ext():
    from lorafleet.runner.kernels import load

    return load()


def pools(S, R, H, groups, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = [(torch.randn(S, R, H, device="cuda", generator=g) * 0.05).to(dtype) for _ in range(groups)]
    b = (torch.randn(S, R, H, device="cuda", generator=g) * 0.05).to(dtype)
    return a, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", sorted(ROW_LAYOUTS))
@pytest.mark.parametrize("T,H,groups,offset,with_res,expand,R", [
    (1, 4096, 3, 0.0, True, True, 16), (32, 4096, 3, 0.0, True, True, 16), (24, 4096, 2, 1.0, True, True, 64),
    (7, 8192, 3, 0.0, True, True, 128), (5, 576, 2, 0.0, True, True, 16), (9, 4096, 3, 0.0, False, False, 16),
    (6, 4096, 1, 0.0, True, False, 32)])
def test_norm_lora_is_the_separate_launches(dtype, layout, T, H, groups, offset, with_res, expand, R):
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV
    from lorafleet.runner.model.norm import OwnNorm

    eps = 1e-6
    g = torch.Generator(device="cuda").manual_seed(T * 31 + H + groups)
    h = (torch.randn(T, H, device="cuda", generator=g) * 3).to(dtype)
    res = (torch.randn(T, H, device="cuda", generator=g) * 5).to(dtype) if with_res else None
    w = (1 + torch.randn(H, device="cuda", generator=g) * 0.2).to(dtype)
    S = 4
    a, b = pools(S, R, H, groups, dtype, H + R)
    # ranks per (projection, slot): 0 (not adapted), 1, a middle one and the pool's full rank
    mid = max(1, R // 4)
    ranks_out = torch.tensor([[R, mid, 0, 1], [mid, R, 1, 4], [2, 0, R, mid]][:groups], dtype=torch.int32,
                             device="cuda")
    ranks_in = torch.tensor([mid, 0, R, 1], dtype=torch.int32, device="cuda")
    slots = ROW_LAYOUTS[layout](T)
    seg = build_segments(slots, "cuda", capacity=64)
    row_slot = torch.tensor(slots, dtype=torch.int32, device="cuda")
    v_in = torch.randn(T, 1, R, device="cuda", generator=g)
    sgmv = CudaSGMV()
    own = OwnNorm(ext(), eps, offset)

    # the separate launches
    y2 = h.clone()
    if expand:
        sgmv.expand((y2,), v_in, (b,), ranks_in[None], None, seg, mma_min_rows=BIG)
    n2 = own.operands(y2, res, w)
    x2 = torch.empty_like(h)
    own.run(x2, n2)
    v2 = torch.full((T, groups, R), float("nan"), device="cuda")
    sgmv.shrink(v2, x2, a, ranks_out, None, seg, mma_min_rows=BIG)
    # one launch
    h_before = h.clone()
    n1 = own.operands(h, res, w)
    x1 = torch.empty_like(h)
    v1 = torch.full((T, groups, R), float("nan"), device="cuda")
    sgmv.norm_lora(x1, n1, row_slot, (v_in, b, ranks_in) if expand else None, (v1, a, ranks_out))
    torch.cuda.synchronize()
    assert torch.equal(h, h_before)  # h is read, not written
    assert torch.equal(x1, x2)
    if with_res:
        assert torch.equal(n1.res_out, n2.res_out)
    assert torch.equal(v1.nan_to_num(7.0), v2.nan_to_num(7.0)), (v1 - v2).abs().nan_to_num(0).max().item()
    # independent references: the norm of h + the expand in fp64, and v as the fp64 product of the x written
    hh = h.double()
    for t in range(T):
        s = slots[t]
        if expand and s >= 0:
            r = int(ranks_in[s])
            hh[t] += v_in[t, 0, :r].double() @ b[s, :r].double()
    r64 = hh + res.double() if with_res else hh
    rs64 = torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + eps)
    ref = r64 * rs64 * (offset + w.double())
    # the kernel rounds h + the expand, then that + res, then x (twice for Llama's scaling) to the dtype
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    ins = hh.abs() + (res.double().abs() if with_res else 0)
    tol = rs64 * (offset + w.double()).abs() * ins * 2 * u + ref.abs() * 3 * u + 1e-6
    assert bool(((x1.double() - ref).abs() <= tol).all()), ((x1.double() - ref).abs() / tol).max().item()
    for t in range(T):
        if slots[t] < 0:
            assert bool(v1[t].isnan().all())  # rows without an adapter are not written
            continue
        for gi in range(groups):
            r = int(ranks_out[gi, slots[t]])
            want = x1[t].double() @ a[gi][slots[t], :r].double().T
            torch.testing.assert_close(v1[t, gi, :r].double(), want, rtol=1e-4, atol=1e-4)
            assert bool(v1[t, gi, r:].isnan().all())  # entries past the rank are not written


def test_norm_lora_in_a_graph_replays_with_new_tables():
    """Captured once, replayed with new row slots, ranks and inputs: each replay the separate launches' bits."""
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV
    from lorafleet.runner.model.norm import OwnNorm

    T, H, R, S, dtype = 32, 4096, 16, 4, torch.bfloat16
    a, b = pools(S, R, H, 3, dtype, 3)
    h = torch.randn(T, H, device="cuda").to(dtype)
    res = torch.randn(T, H, device="cuda").to(dtype)
    w = torch.ones(H, device="cuda", dtype=dtype)
    v_in = torch.randn(T, 1, R, device="cuda")
    ranks_out = torch.full((3, S), 16, dtype=torch.int32, device="cuda")
    ranks_in = torch.full((S,), 16, dtype=torch.int32, device="cuda")
    row_slot = torch.zeros(T, dtype=torch.int32, device="cuda")
    own = OwnNorm(ext(), 1e-5, 0.0)
    sgmv = CudaSGMV()
    n = own.operands(h, res, w)
    x = torch.empty_like(h)
    v = torch.zeros(T, 3, R, device="cuda")
    sgmv.norm_lora(x, n, row_slot, (v_in, b, ranks_in), (v, a, ranks_out))  # warm-up (attributes, first launch)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sgmv.norm_lora(x, n, row_slot, (v_in, b, ranks_in), (v, a, ranks_out), late_tables=True)
    for trial in range(3):
        slots = [(i * (trial + 1)) % 5 - 1 for i in range(T)]
        row_slot.copy_(torch.tensor(slots, dtype=torch.int32))
        ranks_out.copy_(torch.randint(0, R + 1, (3, S), dtype=torch.int32))
        ranks_in.copy_(torch.randint(0, R + 1, (S,), dtype=torch.int32))
        h.copy_(torch.randn(T, H, device="cuda").to(dtype))
        v_in.copy_(torch.randn(T, 1, R, device="cuda"))
        v.fill_(float("nan"))
        graph.replay()
        seg = build_segments(slots, "cuda", capacity=64)
        y2 = h.clone()
        sgmv.expand((y2,), v_in, (b,), ranks_in[None], None, seg, mma_min_rows=BIG)
        n2 = own.operands(y2, res, w)
        x2 = torch.empty_like(h)
        own.run(x2, n2)
        v2 = torch.full((T, 3, R), float("nan"), device="cuda")
        sgmv.shrink(v2, x2, a, ranks_out, None, seg, mma_min_rows=BIG)
        torch.cuda.synchronize()
        assert torch.equal(x, x2) and torch.equal(n.res_out, n2.res_out)
        assert torch.equal(v.nan_to_num(7.0), v2.nan_to_num(7.0))


def test_norm_lora_refuses_bad_operands():
    e = ext()
    T, H, R, S = 4, 64, 8, 2
    h = torch.randn(T, H, device="cuda").bfloat16()
    w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(h)
    row_slot = torch.zeros(T, dtype=torch.int32, device="cuda")
    a = [torch.zeros(S, R, H, device="cuda", dtype=torch.bfloat16)]
    ranks = torch.ones(1, S, dtype=torch.int32, device="cuda")
    v = torch.zeros(T, 1, R, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(RuntimeError, match="neither an expand nor a shrink"):
        e.norm_lora(x, h, None, None, w, 1e-6, 0.0, row_slot, None, None, None, None, [], None, True, stream)
    with pytest.raises(RuntimeError, match="row_slot must be"):
        e.norm_lora(x, h, None, None, w, 1e-6, 0.0, row_slot[:2], None, None, None, v, a, ranks, True, stream)
    with pytest.raises(RuntimeError, match="v_out must not overlap v_in"):
        e.norm_lora(x, h, None, None, w, 1e-6, 0.0, row_slot, v, a[0], ranks[0], v, a, ranks, True, stream)
    with pytest.raises(RuntimeError, match="go together"):
        e.norm_lora(x, h, None, None, w, 1e-6, 0.0, row_slot, v, None, None, v, a, ranks, True, stream)


@pytest.fixture(scope="module", params=["llama3", "gemma3"])
def fam(request, tmp_path_factory):
    name = request.param
    return (name,) + teacher.family_with_two_adapters(name, tmp_path_factory.mktemp(f"gpu-norm-lora-{name}"))


def test_engine_with_norm_lora_matches_hf_fp32_teacher_forced(fam):
    eng = teacher.family_teacher_forced(fam, "norm_lora", 8, kernels=KernelChoices(norm_lora=True, bf16_sm90=False))
    assert eng.model.own_norm is not None


def test_decode_graph_with_norm_lora_is_bit_for_bit_the_separate_launches(fam, monkeypatch):
    """One engine, one decode step of 24 rows: its graphs captured with norm_lora's launch (counted), replayed; the
    graphs captured again with the choice off (the project's norm and the separate LoRA launches), replayed: the
    same logits bit for bit; and against the eager step within kernel-choice noise."""
    import dataclasses

    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    name, model, _, reqs = fam
    calls = teacher.count_calls(monkeypatch, CudaSGMV, "norm_lora")
    eng, batch = teacher.decode_step(model, reqs[:4] * 2, kernels=KernelChoices(norm_lora=True, bf16_sm90=False))
    graphs = eng.runner.graphs
    got = graphs.run(batch, batch.to_device(eng.device)).clone()
    # llama3: every norm before qkv and gate_up in every captured graph; gemma3's sandwich norms keep the separate
    # expands, but its norms still take the launch for their shrinks
    assert len(calls) >= 2 * eng.model.num_layers * len(graphs.buckets), len(calls)
    n_cluster = len(calls)
    graphs.kernels = dataclasses.replace(graphs.kernels, norm_lora=False)
    graphs.static, graphs.pool = {}, None
    graphs.capture_all()
    assert len(calls) == n_cluster  # the second capture never takes the launch
    want = graphs.run(batch, batch.to_device(eng.device)).clone()
    assert torch.equal(got, want), (got - want).abs().max().item()
    # (last: the eager step rewrites the step's K/V with its own kernels' bits)
    eager = eng.runner.forward(batch, batch.to_device(eng.device)).clone()
    span = (eager.max(-1).values - eager.min(-1).values)[:, None]
    rel = ((got - eager).abs() / span).max().item()
    print(f"{name} norm_lora decode graph vs eager: max |diff| {rel:.4f} of the logit range")
    assert rel < teacher.TOL and (got.argmax(-1) == eager.argmax(-1)).float().mean().item() >= 0.9

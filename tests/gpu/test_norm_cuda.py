"""The project's RMSNorm kernel and the norm + LoRA shrink launch (csrc/sgmv.cu `rms_norm`, `norm_shrink`;
KernelChoices.norm_shrink) on the GPU.

- The norm against runner/model/ops.py's torch norm (Hugging Face's roundings) and an fp64 one; the residual
  sum bit for bit torch's; the e4m3 rows bit for bit quantize_tokens' of the norm's output.
- The one-launch norm + shrink against the two launches (the norm, then the shrink of its output): every output
  bit for bit, for decode-shaped tables (one row per adapter, rows without one), one long segment, and ranks
  1 to 64 over one to three projections.
- The engine with the choice on: teacher-forced against HF + PEFT fp32 (llama3, and gemma3 for the (1 + w)
  norm), and decode graphs, where the fused launch runs (counted), against the eager step."""

from __future__ import annotations

import pytest
import torch

import teacher
from lorafleet.runner.config import KernelChoices

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
NEW = 8


def ext():
    from lorafleet.runner.kernels import load

    return load()


def torch_norm(h, res, w, eps, offset):
    from lorafleet.runner.model.ops import TorchOps

    ops = TorchOps.__new__(TorchOps)
    ops.eps, ops.offset = eps, offset
    if res is None:
        return ops.rms_norm(h, w), h
    return ops.add_rms_norm(h, res, w)


def inputs(T, H, dtype, seed, with_res=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = (torch.randn(T, H, device="cuda", generator=g) * 3).to(dtype)
    res = (torch.randn(T, H, device="cuda", generator=g) * 5).to(dtype) if with_res else None
    w = (1 + torch.randn(H, device="cuda", generator=g) * 0.2).to(dtype)
    if T > 2:
        h[1] = 0  # a zero row (rs = 1 / sqrt(eps))
        if res is not None:
            res[1] = 0
    return h, res, w


def run_norm(h, res, w, eps, offset, quant=False):
    from lorafleet.runner.model.norm import OwnNorm

    own = OwnNorm(ext(), eps, offset)
    n = own.operands(h, res, w)
    x = torch.empty_like(h)
    q = (torch.empty(h.shape, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(h.shape[0], device="cuda")) \
        if quant else None
    own.run(x, n, q)
    return x, n.res_out, q


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# (widths up to 8,192 run with the row in registers, two or four vectors a lane; 8,200 and 11,008 on the strided path)
@pytest.mark.parametrize("T,H", [(1, 4096), (7, 64), (33, 4096), (300, 2048), (3, 11008), (2, 8192), (2, 8200),
                                 (5, 3840)])
@pytest.mark.parametrize("with_res,offset", [(True, 0.0), (False, 0.0), (True, 1.0)])
def test_rms_norm_is_the_torch_norm(dtype, T, H, with_res, offset):
    """The residual sum bit for bit torch's; x within one rounding of torch's (the sum of squares is added in
    another order, so rs may differ in its last bit) and within the dtype's rounding of an fp64 norm; the e4m3
    rows bit for bit quantize_tokens' of x."""
    from lorafleet.runner.model.fp8 import quantize_tokens

    eps = 1e-5
    h, res, w = inputs(T, H, dtype, T * 7 + H, with_res)
    x, res_out, (q, sc) = run_norm(h, res, w, eps, offset, quant=True)
    want_x, want_res = torch_norm(h, res, w, eps, offset)
    if with_res:
        assert torch.equal(res_out, want_res)
    else:
        assert res_out is None
    diff = (x.float() - want_x.float()).abs()
    ulp = want_x.float().abs() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10) + 1e-30
    assert bool((diff <= ulp * 2.01).all()), diff.max().item()  # one rounding apart, twice at most
    assert (diff > 0).float().mean().item() < 0.02  # nearly all the same bits
    r64 = want_res.double()
    ref = r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.double())
    tol = ref.abs() * (2 ** -6 if dtype == torch.bfloat16 else 2 ** -9) + 1e-6
    assert bool(((x.double() - ref).abs() <= tol).all())
    want_q, want_s = quantize_tokens(x, ext())
    assert torch.equal(sc, want_s.view(-1))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("H", [72, 1000, 3840, 4096, 5120, 8192])
def test_norm_rows_in_registers_are_the_strided_bits(H):
    """The norm's own launch keeps rows up to 8,192 wide in registers (norm_row_regs); the norm + shrink launch
    computes the rows the strided way (norm_row). x, the residual, the e4m3 rows and scales bit for bit: widths whose
    slices are uneven or empty (72, 1000) or give a lane 1 to 4 vectors, rows with a NaN and with an inf, several rows
    per block (max_blocks 1 and 3), and an e4m3 output that is not 8-byte aligned (which takes the strided path)."""
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV
    from lorafleet.runner.model.norm import OwnNorm

    T, eps, dtype = 40, 1e-5, torch.bfloat16
    h, res, w = inputs(T, H, dtype, H + 3)
    h[3, H // 2] = float("nan")
    h[4, 1] = float("inf")
    bits = lambda t: t.contiguous().view(torch.uint8)  # NaN-proof comparison

    def q_buffers(offset=0):
        raw = torch.empty(T * H + 8, dtype=torch.uint8, device="cuda")[offset:offset + T * H]
        return raw.view(torch.float8_e4m3fn).view(T, H), torch.empty(T, device="cuda")

    own = OwnNorm(ext(), eps, 0.0)
    # the strided path: the norm + shrink launch with every rank 0 (each row's norm, no v)
    n = own.operands(h, res, w)
    x_ref = torch.empty_like(h)
    q_ref = q_buffers()
    seg = build_segments([0] * T, "cuda", capacity=64)
    a = [torch.zeros(1, 16, H, device="cuda", dtype=dtype)]
    CudaSGMV().norm_shrink(torch.zeros(T, 1, 16, device="cuda"), x_ref, n, a,
                           torch.zeros(1, 1, dtype=torch.int32, device="cuda"), seg, q_ref)
    res_ref = n.res_out.clone()
    stream = torch.cuda.current_stream().cuda_stream
    for max_blocks, offset in ((0, 0), (1, 0), (3, 0), (0, 4)):
        x, q = torch.empty_like(h), q_buffers(offset)
        res_out = torch.empty_like(res)
        ext().rms_norm(x, h, res, res_out, w, eps, 0.0, q[0], q[1], True, stream, max_blocks)
        torch.cuda.synchronize()
        case = (H, max_blocks, offset)
        assert torch.equal(bits(res_out), bits(res_ref)), case
        assert torch.equal(bits(x), bits(x_ref)), case
        assert torch.equal(bits(q[0]), bits(q_ref[0])) and torch.equal(bits(q[1]), bits(q_ref[1])), case
    assert torch.isnan(q_ref[1][3]) and torch.isfinite(q_ref[1][5])  # the NaN row's scale, a plain row's


ROW_LAYOUTS = {
    "decode": lambda T: [(i % 5) - 1 for i in range(T)],  # one row per segment, slot -1 rows too
    "one_segment": lambda T: [2] * T,  # the identical mix: one long segment
    "runs": lambda T: [i // 3 % 4 for i in range(T)],  # three-row segments
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", sorted(ROW_LAYOUTS))
@pytest.mark.parametrize("T,K,groups,offset,quant", [(1, 4096, 3, 0.0, False), (24, 4096, 3, 0.0, True),
                                                       (37, 4096, 2, 1.0, False), (32, 2048, 1, 0.0, True),
                                                       (5, 512, 3, 0.0, False), (3, 8192, 1, 0.0, True),
                                                       (4, 3840, 2, 1.0, True)])
def test_norm_shrink_is_the_norm_then_the_shrink(dtype, layout, T, K, groups, offset, quant):
    """One launch against two (the norm, then the CUDA-core shrink of its output): x, the residual, v and the
    e4m3 rows, bit for bit; ranks 16, 4, 0 and 1 per slot and projection, and 64 in one of them. (The norm's own
    launch keeps rows up to 8,192 wide in registers; the one launch reads them as norm_row does: the same bits.)"""
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV
    from lorafleet.runner.model.norm import OwnNorm

    eps = 1e-6
    h, res, w = inputs(T, K, dtype, T + K + groups)
    g = torch.Generator(device="cuda").manual_seed(K)
    S, R = 4, 64
    a = [(torch.randn(S, R, K, device="cuda", generator=g) * 0.05).to(dtype) for _ in range(groups)]
    ranks = torch.tensor([[16, 4, 0, 1], [64, 16, 1, 4], [2, 0, 16, 8]][:groups], dtype=torch.int32, device="cuda")
    seg = build_segments(ROW_LAYOUTS[layout](T), "cuda", capacity=64)
    sgmv = CudaSGMV()
    # two launches
    x2, res2, q2 = run_norm(h, res, w, eps, offset, quant)
    v2 = torch.zeros(T, groups, R, device="cuda")
    sgmv.shrink(v2, x2, a, ranks, None, seg, mma_min_rows=1 << 30)
    # one
    own = OwnNorm(ext(), eps, offset)
    n = own.operands(h, res, w)
    x1 = torch.empty_like(h)
    v1 = torch.zeros(T, groups, R, device="cuda")
    q1 = (torch.empty(h.shape, dtype=torch.float8_e4m3fn, device="cuda"), torch.empty(T, device="cuda")) \
        if quant else None
    sgmv.norm_shrink(v1, x1, n, a, ranks, seg, q1)
    torch.cuda.synchronize()
    assert torch.equal(x1, x2)
    assert torch.equal(n.res_out, res2)
    assert torch.equal(v1, v2), (v1 - v2).abs().max().item()
    if quant:
        assert torch.equal(q1[1], q2[1]) and torch.equal(q1[0].view(torch.uint8), q2[0].view(torch.uint8))
    # and v is the product it should be (fp64 of x and A's rows, within fp32 accumulation)
    slots = ROW_LAYOUTS[layout](T)
    for t in range(T):
        if slots[t] < 0:
            continue
        for gi in range(groups):
            r = int(ranks[gi, slots[t]])
            want = x2[t].double() @ a[gi][slots[t], :r].double().T
            torch.testing.assert_close(v1[t, gi, :r].double(), want, rtol=1e-4, atol=1e-4)


def test_norm_refuses_bad_operands():
    e = ext()
    h, res, w = inputs(4, 64, torch.bfloat16, 1)
    x = torch.empty_like(h)
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(RuntimeError, match="must not overlap"):
        e.rms_norm(h, h, res, torch.empty_like(h), w, 1e-6, 0.0, None, None, True, stream)
    with pytest.raises(RuntimeError, match="must not overlap"):
        e.rms_norm(x, h, res, res, w, 1e-6, 0.0, None, None, True, stream)
    with pytest.raises(RuntimeError, match="res and res_out go together"):
        e.rms_norm(x, h, res, None, w, 1e-6, 0.0, None, None, True, stream)
    with pytest.raises(RuntimeError, match="w must be"):
        e.rms_norm(x, h, None, None, w[:32], 1e-6, 0.0, None, None, True, stream)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        e.rms_norm(x[:, :12], h[:, :12].contiguous(), None, None, w[:12], 1e-6, 0.0, None, None, True, stream)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        e.rms_norm(x.float(), h.float(), None, None, w.float(), 1e-6, 0.0, None, None, True, stream)


@pytest.fixture(scope="module", params=["llama3", "gemma3"])
def fam(request, tmp_path_factory):
    name = request.param
    return (name,) + teacher.family_with_two_adapters(name, tmp_path_factory.mktemp(f"gpu-norm-{name}"))


def test_engine_with_the_norm_kernel_matches_hf_fp32_teacher_forced(fam):
    eng = teacher.family_teacher_forced(fam, "norm kernel", NEW, kernels=KernelChoices(norm_shrink=True, bf16_sm90=False))
    assert eng.model.own_norm is not None


def test_decode_graph_with_the_fused_norm_shrink_matches_the_eager_step(fam, monkeypatch):
    """The decode graphs launch the norm + shrink (counted while they are captured); the eager step runs the norm
    and the shrink separately: the same logits up to kernel-choice noise."""
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    calls = teacher.count_calls(monkeypatch, CudaSGMV, "norm_shrink")
    name, model, _, reqs = fam
    eng = teacher.decode_graph_vs_eager(model, reqs[:4] * 2, f"{name} norm kernel",
                                        kernels=KernelChoices(norm_shrink=True, bf16_sm90=False))
    assert len(calls) >= 2 * eng.model.num_layers, len(calls)

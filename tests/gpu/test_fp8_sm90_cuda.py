"""The unit-scale FP8 product on Hopper's wgmma (csrc/fp8_gemm_sm90.cu, KernelChoices.fp8_sm90) against the sum of
the same e4m3 products in fp64 and against cuBLASLt's unit-scale call; each token's row the same whatever else is in
the step; a CUDA graph's replay the eager call's bits; refusals. The engine with it is checked against HF + PEFT in
tests/gpu/test_fp8_cuda.py (gemm "sm90")."""

from __future__ import annotations

import pytest
import torch

from lorafleet.runner.model.fp8 import E4M3, quantize_rows, quantize_tokens, sm90_gemm_available

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ext():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from lorafleet.runner.kernels import load

    ext = load()
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel is built for compute capability 9.0 only")
    assert sm90_gemm_available(ext, torch.device("cuda")), "CUTLASS's headers (flashinfer) were not found at build time"
    return ext


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _operands(M: int, K: int, N: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    x[0, :: max(1, K // 7)] = 30.0  # a few large activations, as real ones have
    w = quantize_rows(torch.randn(N, K, device="cuda", generator=g) * 0.05)
    xq, _ = quantize_tokens(x)
    return xq, w


def _sm90(ext, xq, w) -> torch.Tensor:
    out = torch.full((xq.shape[0], w.q.shape[0]), float("nan"), device="cuda")  # every element must be written
    ext.fp8_gemm_sm90(out, xq, w.q, _stream())
    return out


# K: one k-tile of 256 and a partial one (48, 272: TMA fills the rest with zeros), the 7B and 70B widths; N: a partial
# 64-row tile (36, 100), the 7B projections
SHAPES = [(48, 36), (272, 100), (4096, 4096), (4096, 12288), (11008, 4096), (8192, 1024)]


@pytest.mark.parametrize("M", [1, 7, 16, 17, 32, 33, 64])
def test_sm90_gemm_is_the_sum_of_the_e4m3_products(ext, M):
    """Against the fp64 sum of the same exact e4m3 products, within the accumulation's rounding (the tensor cores keep
    fewer bits than fp32 inside a k-tile: bounded by 1e-3 of the sum of the products' magnitudes), and against
    cuBLASLt's unit-scale call within twice that (where cuBLASLt takes the sizes)."""
    for K, N in SHAPES:
        xq, w = _operands(M, K, N, seed=M * 131 + K + N)
        got = _sm90(ext, xq, w)
        xd, wd = xq.double(), w.q.double()
        exact = xd @ wd.t()
        bound = 1e-3 * (xd.abs() @ wd.abs().t()) + 1e-6
        assert torch.isfinite(got).all(), (M, K, N)
        err = (got.double() - exact).abs()
        assert (err <= bound).all(), (M, K, N, (err / bound).max().item())
        assert (exact.abs() > 0).any()
        if N % 16 == 0:  # cuBLASLt takes FP8 operands with both sizes multiples of 16 only
            one = torch.ones((), device="cuda")
            lt = torch._scaled_mm(xq, w.q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            assert ((got.double() - lt.double()).abs() <= 2 * bound).all(), (M, K, N)


@pytest.mark.parametrize("M", [33, 64])
def test_a_tokens_row_does_not_depend_on_the_rest_of_the_step(ext, M):
    """Each row of an M-row call (64-token tiles) bit for bit the same row alone (16-token tiles) and in a 17-row and
    a 32-row call: the k-tile and the order over K are those of every tile shape."""
    for K, N in ((4096, 4096), (11008, 4096), (272, 100)):
        xq, w = _operands(M, K, N, seed=K + N)
        full = _sm90(ext, xq, w)
        for i in sorted({0, 5, M // 2, M - 1}):
            alone = _sm90(ext, xq[i:i + 1].contiguous(), w)
            assert torch.equal(alone[0], full[i]), (M, K, N, i)
        for rows in (17, 32):
            part = _sm90(ext, xq[:rows].contiguous(), w)
            assert torch.equal(part, full[:rows]), (M, K, N, rows)


@pytest.mark.parametrize("splits", [2, 4])
def test_split_k_parts_are_the_calls_on_the_k_slices(ext, splits):
    """With K in `splits` parts, part l's partial sums are bit for bit the unsplit call on columns l * K / splits ..
    (l + 1) * K / splits of x and w, and the parts add up to the product."""
    for M, K, N in ((32, 4096, 4096), (7, 11008, 4096), (64, 1024, 100)):
        xq, w = _operands(M, K, N, seed=splits * K + M)
        parts = torch.full((splits, M, N), float("nan"), device="cuda")
        ext.fp8_gemm_sm90(parts, xq, w.q, _stream(), splits)
        ks = K // splits
        for part in range(splits):
            cols = slice(part * ks, (part + 1) * ks)
            alone = torch.empty(M, N, device="cuda")
            ext.fp8_gemm_sm90(alone, xq[:, cols].contiguous(), w.q[:, cols].contiguous(), _stream())
            assert torch.equal(parts[part], alone), (M, K, N, part)
        xd, wd = xq.double(), w.q.double()
        bound = 1e-3 * (xd.abs() @ wd.abs().t()) + 1e-6
        assert ((parts.double().sum(0) - xd @ wd.t()).abs() <= bound).all(), (M, K, N)


@pytest.mark.parametrize("act", [0, 1])
def test_epilogue_adds_the_parts_in_order(ext, act):
    """The FP8 epilogue on a split product's [parts, M, N] partial sums gives the bits of the epilogue on their sum in
    part order (split_sum, the path without the epilogue), with and without the activation."""
    from lorafleet.runner.model.fp8 import split_sum

    M, K, N = 24, 11008, 4096
    xq, w = _operands(M, K, N, seed=9)
    sx = torch.rand(M, device="cuda") + 0.5
    parts = torch.empty(4, M, N, device="cuda")
    ext.fp8_gemm_sm90(parts, xq, w.q, _stream(), 4)
    cols = [N // 2, N // 2] if act else [N]
    outs = []
    for y in (parts, split_sum(parts)):
        out = torch.empty(M, N // 2 if act else N, device="cuda", dtype=torch.bfloat16)
        ext.fp8_epilogue(out, y, sx, w.scale, None, cols, None, [], None, None, True, _stream(), act)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_graph_replay_gives_the_eager_bits(ext):
    """The call captured in a CUDA graph (descriptors made at capture time) and replayed on new activations copied into
    the captured input: the eager call's bits."""
    K, N, M = 4096, 12288, 32
    xq, w = _operands(M, K, N, seed=3)
    static_x = xq.clone()
    out = torch.empty(M, N, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ext.fp8_gemm_sm90(out, static_x, w.q, _stream())  # warm up outside the capture
        with torch.cuda.graph(graph, stream=side):
            ext.fp8_gemm_sm90(out, static_x, w.q, _stream())
    torch.cuda.current_stream().wait_stream(side)
    for seed in (11, 12):
        new, _ = _operands(M, K, N, seed=seed)
        static_x.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _sm90(ext, new, w)), seed


def test_sm90_gemm_refuses_bad_operands(ext):
    xq, w = _operands(4, 256, 64, seed=1)
    out = torch.empty(4, 64, device="cuda")
    s = _stream()
    cases = [
        (dict(out=torch.empty(65, 64, device="cuda"), x=torch.zeros(65, 256, device="cuda").to(E4M3)), "1 to 64 rows"),
        (dict(out=out.bfloat16()), "out must be contiguous float32"),
        (dict(x=xq.float()), "x must be a contiguous 2-D float8_e4m3fn"),
        (dict(w=w.q[:, :128].contiguous()), r"w must be contiguous float8_e4m3fn \[N, K=256\]"),
        (dict(x=torch.zeros(4, 40, device="cuda").to(E4M3), w=torch.zeros(64, 40, device="cuda").to(E4M3)),
         "must be a multiple of 16"),
        (dict(w=torch.zeros(66, 256, device="cuda").to(E4M3), out=torch.empty(4, 66, device="cuda")), "N .* of 4"),
        (dict(x=torch.zeros(4, 272, device="cuda").to(E4M3)[:, 16:]), "x must be a contiguous"),
        (dict(splits=2), r"\[splits, 4, 64\]"),  # a 2-D out with splits
        (dict(splits=3, out=torch.empty(3, 4, 64, device="cuda")), r"multiple of 16 \* splits"),
        (dict(splits=0), r"splits must be in \[1, 16\]"),
    ]
    for change, match in cases:
        args = dict(out=out, x=xq, w=w.q, stream=s)
        with pytest.raises(RuntimeError, match=match):
            ext.fp8_gemm_sm90(**{**args, **change})

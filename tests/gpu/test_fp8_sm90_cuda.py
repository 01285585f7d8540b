"""The unit-scale FP8 product on Hopper's wgmma (csrc/fp8_gemm_sm90.cu, KernelChoices.fp8_sm90) against the sum of
the same e4m3 products in fp64 and against cuBLASLt's unit-scale call; each token's row the same whatever else is in
the step; a CUDA graph's replay the eager call's bits; refusals. The product with the FP8 epilogue inside it
(fp8_gemm_sm90_fused) against the product followed by that epilogue's own launch, bit for bit. The product started
early by the launch that writes its activations still reads the new ones. The same kernel on bf16 operands. The
engine with it is checked against HF + PEFT in tests/gpu/test_fp8_cuda.py (gemm "sm90")."""

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


@pytest.mark.parametrize("M", [1, 16, 17, 32, 33, 64])
def test_persistent_schedule_gives_the_bits_of_one_cta_per_tile(ext, M):
    """The kernel on CUTLASS's persistent ping-pong schedule (KernelChoices.fp8_sm90_persistent) against the one-CTA-
    per-tile kernel, bit for bit: the 7B and 70B widths (from fewer tiles than an H200's 132 SMs to 3.4 times as many),
    partial k-tiles and row tiles, K in parts (its graph replay: test_graph_replay_gives_the_eager_bits)."""
    for K, N in SHAPES + [(4096, 22016), (8192, 28672)]:
        xq, w = _operands(M, K, N, seed=M * 7 + K + N)
        for splits in (1, 2) if K % 32 == 0 else (1,):
            shape = (splits, M, N) if splits > 1 else (M, N)
            plain = torch.full(shape, float("nan"), device="cuda")
            ext.fp8_gemm_sm90(plain, xq, w.q, _stream(), splits)
            pers = torch.full(shape, float("nan"), device="cuda")
            ext.fp8_gemm_sm90(pers, xq, w.q, _stream(), splits, True, True)
            assert torch.equal(pers, plain), (M, K, N, splits, (pers - plain).abs().max().item())


@pytest.mark.parametrize("persistent", [False, True], ids=["per_tile", "persistent"])
def test_graph_replay_gives_the_eager_bits(ext, persistent):
    """The call captured in a CUDA graph (descriptors made at capture time) and replayed on new activations copied into
    the captured input: the eager call's bits (one CTA per tile), on either schedule."""
    K, N, M = 4096, 12288, 32
    xq, w = _operands(M, K, N, seed=3)
    static_x = xq.clone()
    out = torch.empty(M, N, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ext.fp8_gemm_sm90(out, static_x, w.q, _stream(), 1, True, persistent)  # warm up outside the capture
        with torch.cuda.graph(graph, stream=side):
            ext.fp8_gemm_sm90(out, static_x, w.q, _stream(), 1, True, persistent)
    torch.cuda.current_stream().wait_stream(side)
    for seed in (11, 12):
        new, _ = _operands(M, K, N, seed=seed)
        static_x.copy_(new)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, _sm90(ext, new, w)), seed


# (K 1,024: fewer k-tiles than the pipeline's stages; 28,672: a writer that takes longer, the norm on its strided path)
@pytest.mark.parametrize("K,N", [(4096, 12288), (1024, 4096), (28672, 2048)])
@pytest.mark.parametrize("writer", ["quantize", "norm"])
@pytest.mark.parametrize("persistent", [False, True])
def test_product_right_after_the_kernel_that_writes_its_activations_reads_the_new_ones(ext, writer, persistent, K, N):
    """The launch that writes the product's e4m3 activations (the quantization kernel, or the project's norm with
    them) lets the product start at once, and the product's producer asks for the weight's first k-tiles before it
    waits for that launch (WeightFirstMainloop). The product still reads the new activations, never what the buffer
    held before: eager, and replayed in a CUDA graph with new rows, bit for bit the product of the finished buffer."""
    from lorafleet.runner.model.norm import OwnNorm

    M = 32
    g = torch.Generator(device="cuda").manual_seed(7)
    w = quantize_rows(torch.randn(N, K, device="cuda", generator=g) * 0.05)
    norm_w = (1 + torch.randn(K, device="cuda", generator=g) * 0.2).bfloat16()
    h = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)  # the writer's input
    q = torch.empty(M, K, device="cuda", dtype=E4M3)
    scale = torch.empty(M, device="cuda")
    x_out = torch.empty_like(h)
    own = OwnNorm(ext, 1e-5, 0.0)
    out = torch.empty(M, N, device="cuda")

    def step():
        if writer == "quantize":
            ext.quantize_e4m3(q, scale, h, _stream())
        else:
            own.run(x_out, own.operands(h, None, norm_w), (q, scale))
        ext.fp8_gemm_sm90(out, q, w.q, _stream(), 1, True, persistent)

    def fresh(seed):
        h.copy_(torch.randn(M, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)) * 3)

    def check(seed, replayed):
        if replayed:
            want_q, want_s = (quantize_tokens(h) if writer == "quantize"
                              else quantize_tokens(x_out))  # (the norm's rows: checked against torch in test_norm_cuda)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_s.view(-1))
        assert torch.equal(out, _sm90(ext, q.clone(), w)), (writer, persistent, K, seed, replayed)
    _reads_the_rows_just_written(step, fresh, out, check, range(4), (21, 22, 23))


def _reads_the_rows_just_written(step, fresh, out, check, eager_seeds, graph_seeds):
    """A writer launch and the product right after it (`step`): eagerly, each time after a step on other rows (the
    buffer holds them first), then captured in a CUDA graph and replayed on new rows (`fresh(seed)` writes the
    writer's inputs); `check(seed, replayed)` after each, `out` filled with NaN before."""
    for seed in eager_seeds:
        fresh(100 + seed)
        step()
        fresh(seed)
        torch.cuda.synchronize()
        out.fill_(float("nan"))
        step()
        torch.cuda.synchronize()
        check(seed, False)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    for seed in graph_seeds:
        fresh(seed)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(seed, True)


@pytest.mark.parametrize("K,N", [(4096, 12288), (1024, 4096)])
def test_bf16_product_right_after_the_early_norm_reads_its_rows(ext, K, N):
    """The project's norm with `early` (KernelChoices.norm_early) lets the bf16 wgmma product that follows start at
    once; the product, with the rows' shrink and expand inside, still reads the norm's new rows, never the buffer's
    old ones: eager and replayed in a CUDA graph with new rows, bit for bit the same launch on the finished buffer."""
    from lorafleet.runner.model.norm import OwnNorm

    M, spans = 32, [N // 2, N // 4, N // 4]
    g = torch.Generator(device="cuda").manual_seed(11)
    _, w = _bf16_operands(M, K, N, seed=K + N)
    norm_w = (1 + torch.randn(K, device="cuda", generator=g) * 0.2).bfloat16()
    h = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
    res = torch.empty_like(h)
    res_out, x_out = torch.empty_like(h), torch.empty_like(h)
    _, _, e = _fused_args(spans, M, True, True, K, seed=K)
    ones_m, ones_n = torch.ones(M, device="cuda"), torch.ones(N, device="cuda")
    a = _shrink_pools(spans, K, seed=K + 1)
    sync = torch.zeros(3, dtype=torch.int32, device="cuda")
    own = OwnNorm(ext, 1e-5, 0.0)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def product(o, x):
        ext.fp8_gemm_sm90_fused(o, x, w, ones_m, ones_n, e["bias"], e["cols"], e["v"], e["b"], e["ranks"],
                                e["row_slot"], True, torch.cuda.current_stream().cuda_stream, a=a, sync=sync)

    def step():
        own.run(x_out, own.operands(h, res, norm_w, res_out), early=True)
        product(out, x_out)

    def fresh(seed):
        r = torch.Generator(device="cuda").manual_seed(seed)
        h.copy_(torch.randn(M, K, device="cuda", generator=r) * 3)
        res.copy_(torch.randn(M, K, device="cuda", generator=r))

    def check(seed, replayed):  # against the same launch on the finished rows
        want = torch.empty_like(out)
        product(want, x_out.clone())
        torch.cuda.synchronize()
        assert _same_bits(out, want) and not sync.any(), (K, seed, replayed)
    _reads_the_rows_just_written(step, fresh, out, check, range(3), (21, 22))


def test_sm90_gemm_refuses_bad_operands(ext):
    xq, w = _operands(4, 256, 64, seed=1)
    out = torch.empty(4, 64, device="cuda")
    s = _stream()
    cases = [
        (dict(out=torch.empty(65, 64, device="cuda"), x=torch.zeros(65, 256, device="cuda").to(E4M3)), "1 to 64 rows"),
        (dict(out=out.bfloat16()), "out must be contiguous float32"),
        (dict(x=xq.float()), "x must be a contiguous 2-D float8_e4m3fn"),
        (dict(w=w.q[:, :128].contiguous()), r"w must be float8_e4m3fn \[N, K=256\]"),
        (dict(w=torch.zeros(64, 264, device="cuda").to(E4M3)[:, :256]), r"16-byte aligned rows at least K apart"),
        # K = 40 with w's rows 48 bytes apart (aligned): the K rule itself refuses
        (dict(x=torch.zeros(4, 40, device="cuda").to(E4M3), w=torch.zeros(64, 48, device="cuda").to(E4M3)[:, :40]),
         r"K \(40\) must be a multiple of 16"),
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


# (spans, M, bias, LoRA, K): one projection and three (qkv-like), partial 64-row tiles (N = 32, 4,112), partial k-tiles,
# 1 to 64 rows (each of the three token tiles), the 7B and 70B widths
FUSED_CASES = [([4096], 32, False, False, 4096), ([4096, 1024, 1024], 32, True, True, 4096),
               ([1024, 256, 256], 37, True, True, 272), ([8, 16, 8], 5, True, True, 48),
               ([2056, 2056], 64, False, True, 256), ([4096], 1, True, True, 11008), ([8192], 17, False, True, 1024),
               ([4096], 16, True, False, 4096)]


def _fused_args(spans, M, bias, lora, K, seed):
    """e4m3 operands and the epilogue's operands (the weight's own row scales; random token scales, bias and a LoRA
    step with every kind of row slot, tests/gpu/test_fp8_cuda.py _epilogue_case)."""
    from test_fp8_cuda import _epilogue_case

    xq, w = _operands(M, K, sum(spans), seed=seed)
    c = _epilogue_case(torch.bfloat16, spans, M, bias, lora, seed=seed)
    return xq, w, dict(x_scale=c["x_scale"], w_scale=w.scale, bias=c["bias"], cols=list(spans), v=c.get("v"),
                       b=c.get("b", []), ranks=c.get("ranks"), row_slot=c.get("row_slot"))


def _two_launches(ext, xq, w, e) -> torch.Tensor:
    out = torch.empty(xq.shape[0], w.q.shape[0], device="cuda", dtype=torch.bfloat16)
    ext.fp8_epilogue(out, _sm90(ext, xq, w), e["x_scale"], e["w_scale"], e["bias"], e["cols"], e["v"], e["b"],
                     e["ranks"], e["row_slot"], True, _stream())
    return out


def _fused(ext, xq, w, e, out=None, pdl=True, persistent=False) -> torch.Tensor:
    if out is None:  # NaN everywhere: every element must be written
        out = torch.full((xq.shape[0], w.q.shape[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
    ext.fp8_gemm_sm90_fused(out, xq, w.q, e["x_scale"], e["w_scale"], e["bias"], e["cols"], e["v"], e["b"], e["ranks"],
                            e["row_slot"], pdl, _stream(), persistent=persistent)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("spans,M,bias,lora,K", FUSED_CASES)
def test_fused_epilogue_is_the_product_then_the_epilogue_bit_for_bit(ext, spans, M, bias, lora, K):
    """fp8_gemm_sm90_fused against fp8_gemm_sm90 into fp32 followed by fp8_epilogue (whose own test takes it against
    the separate ops and the fp64 sum: tests/gpu/test_fp8_cuda.py), with every kind of row slot, with and without
    programmatic dependent launch, and in the persistent ping-pong kernel: the same bits."""
    xq, w, e = _fused_args(spans, M, bias, lora, K, seed=M + K + len(spans))
    want = _two_launches(ext, xq, w, e)
    for pdl, persistent in ((True, False), (False, False), (True, True)):
        got = _fused(ext, xq, w, e, pdl=pdl, persistent=persistent)
        assert _same_bits(got, want), (pdl, persistent, (got.float() - want.float()).abs().max())


def test_fused_graph_replay_with_new_rows_and_slots(ext):
    """The fused call captured in a CUDA graph, replayed after new activations, token scales, v and row slots were
    copied into the captured inputs: the eager two launches' bits on the new inputs."""
    spans, M, K = [4096, 1024, 1024], 32, 4096
    static_xq, w, static = _fused_args(spans, M, True, True, K, seed=5)
    out = torch.empty(M, sum(spans), device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _fused(ext, static_xq, w, static, out)  # warm up outside the capture
        with torch.cuda.graph(graph, stream=side):
            _fused(ext, static_xq, w, static, out)
    torch.cuda.current_stream().wait_stream(side)
    for seed in (21, 22):
        nxq, _, new = _fused_args(spans, M, True, True, K, seed=seed)
        static_xq.copy_(nxq)
        static["x_scale"].copy_(new["x_scale"])
        static["v"].copy_(new["v"])
        static["row_slot"].copy_(new["row_slot"].flip(0))  # other rows on other adapters
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _same_bits(out, _two_launches(ext, static_xq, w, static)), seed


def _bf16_operands(M: int, K: int, N: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    x[0, :: max(1, K // 7)] = 30.0
    return x, (torch.randn(N, K, device="cuda", generator=g) * 0.05).bfloat16()


@pytest.mark.parametrize("M", [1, 16, 17, 32, 33, 64])
def test_bf16_operands_give_the_fp32_sum_and_rows_of_their_own(ext, M):
    """bf16 x and w (the same kernel on bf16 wgmma, bench/probe_bf16_sm90.py): the fp64 sum of the exact bf16 products
    within fp32 accumulation's rounding, the same bits from a weight whose rows lie K + 64 apart, each row bit for bit
    the row alone and in a 17-row call (every token tile shares the k-tile), K in parts as the unsplit calls on the K
    slices, and with the epilogue inside (unit scales) bit for bit the product into fp32 followed by the epilogue's
    launch."""
    for K, N in ((272, 100), (4096, 4096), (11008, 4096)):
        x, w = _bf16_operands(M, K, N, seed=M * 7 + K + N)
        got = torch.full((M, N), float("nan"), device="cuda")
        ext.fp8_gemm_sm90(got, x, w, _stream())
        xd, wd = x.double(), w.double()
        bound = 1e-5 * (xd.abs() @ wd.abs().t()) + 1e-6
        assert torch.isfinite(got).all() and ((got.double() - xd @ wd.t()).abs() <= bound).all(), (M, K, N)
        for i in sorted({0, M // 2, M - 1}):
            alone = torch.empty(1, N, device="cuda")
            ext.fp8_gemm_sm90(alone, x[i:i + 1].contiguous(), w, _stream())
            assert torch.equal(alone[0], got[i]), (M, K, N, i)
        wide = torch.zeros(N, K + 64, device="cuda", dtype=torch.bfloat16)  # spare columns (Decoder.widen_for_lora)
        wide[:, :K].copy_(w)
        spare = torch.empty(M, N, device="cuda")
        ext.fp8_gemm_sm90(spare, x, wide[:, :K], _stream())
        assert torch.equal(spare, got), (M, K, N)
        if M > 17:
            part = torch.empty(17, N, device="cuda")
            ext.fp8_gemm_sm90(part, x[:17].contiguous(), w, _stream())
            assert torch.equal(part, got[:17]), (M, K, N)
        if K % 32 == 0:
            parts = torch.empty(2, M, N, device="cuda")
            ext.fp8_gemm_sm90(parts, x, w, _stream(), 2)
            half = torch.empty(M, N, device="cuda")
            ext.fp8_gemm_sm90(half, x[:, K // 2:].contiguous(), w[:, K // 2:].contiguous(), _stream())
            assert torch.equal(parts[1], half), (M, K, N)
            spare_parts = torch.empty(2, M, N, device="cuda")  # the parts of a weight with spare columns
            ext.fp8_gemm_sm90(spare_parts, x, wide[:, :K], _stream(), 2)
            assert torch.equal(spare_parts, parts), (M, K, N)
    for spans, rows, bias, lora, K in FUSED_CASES:
        if {37: 32, 5: 1}.get(rows, rows) != M:  # each case once: at its own row count, 37 and 5 rows at 32 and 1
            continue
        x, w = _bf16_operands(rows, K, sum(spans), seed=rows + K)
        _, _, e = _fused_args(spans, rows, bias, lora, K, seed=rows + K + len(spans))
        e = {**e, "x_scale": torch.ones(rows, device="cuda"), "w_scale": torch.ones(sum(spans), device="cuda")}
        y = torch.empty(rows, sum(spans), device="cuda")
        ext.fp8_gemm_sm90(y, x, w, _stream())
        want = torch.empty(rows, sum(spans), device="cuda", dtype=torch.bfloat16)
        ext.fp8_epilogue(want, y, e["x_scale"], e["w_scale"], e["bias"], e["cols"], e["v"], e["b"], e["ranks"],
                         e["row_slot"], True, _stream())
        got = torch.full_like(want, float("nan"))
        ext.fp8_gemm_sm90_fused(got, x, w, e["x_scale"], e["w_scale"], e["bias"], e["cols"], e["v"], e["b"],
                                e["ranks"], e["row_slot"], True, _stream())
        assert _same_bits(got, want), (spans, rows, (got.float() - want.float()).abs().max())


def test_bf16_operands_refused_where_they_do_not_fit(ext):
    x, w = _bf16_operands(4, 256, 64, seed=3)
    out = torch.empty(4, 64, device="cuda")
    with pytest.raises(RuntimeError, match=r"w must be bfloat16 \[N, K=256\] .* \(x's dtype\)"):
        ext.fp8_gemm_sm90(out, x, w.to(E4M3), _stream())
    with pytest.raises(RuntimeError, match="persistent schedule is built for e4m3 operands only"):
        ext.fp8_gemm_sm90(out, x, w, _stream(), 1, True, True)
    ones, cols = torch.ones(64, device="cuda"), [64]
    with pytest.raises(RuntimeError, match="persistent schedule is built for e4m3 operands only"):
        ext.fp8_gemm_sm90_fused(torch.empty(4, 64, device="cuda", dtype=torch.bfloat16), x, w, ones[:4], ones, None,
                                cols, None, [], None, None, True, _stream(), persistent=True)


def test_fused_refuses_bad_operands(ext):
    xq, w, e = _fused_args([64, 32, 32], 4, True, True, 256, seed=1)
    base = dict(out=torch.empty(4, 128, device="cuda", dtype=torch.bfloat16), x=xq, w=w.q, **e, pdl=True,
                stream=_stream())
    w132 = torch.zeros(132, 256, device="cuda").to(E4M3)
    cases = [
        (dict(out=base["out"].half(), bias=None), "out must be bfloat16"),
        (dict(cols=[64, 32, 24]), "spans cover"),
        (dict(b=e["b"][:2]), "one B pool per span"),
        (dict(x=torch.zeros(65, 256, device="cuda").to(E4M3)), "1 to 64 rows"),
        (dict(x_scale=e["x_scale"][:3]), "x_scale"),
        (dict(w=w132, w_scale=torch.ones(132, device="cuda"), cols=[132], v=None, b=[], ranks=None, row_slot=None,
              bias=None, out=torch.empty(4, 132, device="cuda", dtype=torch.bfloat16)), "multiple of 8"),
    ]
    for change, match in cases:
        with pytest.raises(RuntimeError, match=match):
            ext.fp8_gemm_sm90_fused(**{**base, **change})


def _shrink_pools(spans, K: int, seed: int):
    """A pools [S = 7, R = 128, K] per span (bf16) beside _fused_args' B pools, ranks and row slots."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(7, 128, K, device="cuda", generator=g) * 0.05).bfloat16() for _ in spans]


def _shrink_fp64(x, a, e):
    """v's entries the shrink must write (a mask like v's) and their fp64 values and magnitudes: every row with a slot
    in range, rank rows below its rank clamped to the pools' 128."""
    shape = (x.shape[0], len(a), a[0].shape[1])
    mask = torch.zeros(shape, dtype=torch.bool, device="cuda")
    want, mag = torch.zeros(shape, dtype=torch.float64, device="cuda"), torch.zeros(shape, dtype=torch.float64,
                                                                                     device="cuda")
    S = e["ranks"].shape[1]
    for i, s in enumerate(e["row_slot"].tolist()):
        if not 0 <= s < S:
            continue
        for g, ag in enumerate(a):
            r = min(max(int(e["ranks"][g, s]), 0), ag.shape[1])
            terms = ag[s, :r].double() * x[i].double()
            mask[i, g, :r] = True
            want[i, g, :r], mag[i, g, :r] = terms.sum(1), terms.abs().sum(1)
    return mask, want, mag


def _shrink_checked(v, x, a, e, why):
    """v written exactly where the shrink must write it, each entry within fp32 accumulation's rounding of fp64."""
    mask, want, mag = _shrink_fp64(x, a, e)
    rows = x.shape[0]
    assert torch.equal(torch.isfinite(v[:rows]), mask) and not torch.isfinite(v[rows:]).any(), why
    assert ((v[:rows].double() - want).abs() <= 1e-5 * mag + 1e-6)[mask].all(), why


def _bf16_shrink_cases(M: int):
    """The bf16 shrink-inside cases of M rows (FUSED_CASES with LoRA; at 64 rows also 256 weight tiles): spans, rows,
    x, w, the epilogue's operands with unit scales, A pools and four zero counters."""
    cases = [c for c in FUSED_CASES if c[3] and {37: 32, 5: 1}.get(c[1], c[1]) == M]
    if M == 64:
        cases.append(([8192, 4096, 4096], 64, True, True, 4096))
    for spans, rows, bias, lora, K in cases:
        x, w = _bf16_operands(rows, K, sum(spans), seed=rows + K)
        _, _, e = _fused_args(spans, rows, bias, lora, K, seed=rows + K + len(spans))
        e = {**e, "x_scale": torch.ones(rows, device="cuda"), "w_scale": torch.ones(sum(spans), device="cuda")}
        yield (spans, rows, x, w, e, _shrink_pools(spans, K, seed=rows + K),
               torch.zeros(4, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("producer", [False, True], ids=["consumers", "producer"])
@pytest.mark.parametrize("M", [1, 17, 32, 64])
def test_the_shrink_inside_the_product(ext, M, producer):
    """bf16 operands with the A pools and counters (Fp8EpilogueLora::sync): the kernel's own warps write v, then its
    epilogues add the expand. v holds the fp64 sums of x's rows and A's rank rows within fp32 accumulation's rounding
    wherever a row has an adapter (every kind of slot and rank of _fused_args, ranks up to the pools' 128), and
    nothing else of v is written; the output is bit for bit the fused call handed that v; the counters are zero
    again after the launch; a second launch gives the same bits, and every row the bits of the row alone. At 64 rows
    also 256 weight tiles (more CTAs than the GPU has SMs: later waves, tickets past the first wave's). `producer`
    (shrink_producer): the producer warp group's warps 1-3 take the tickets beside the main loop, and the four
    counters are zero after; v and the output are then also the consumers' bits."""
    for spans, rows, x, w, e, a, sync in _bf16_shrink_cases(M):

        def launch(x, e, v, producer=producer):
            out = torch.full((x.shape[0], sum(spans)), float("nan"), device="cuda", dtype=torch.bfloat16)
            ext.fp8_gemm_sm90_fused(out, x, w, e["x_scale"], e["w_scale"], e["bias"], e["cols"], v, e["b"],
                                    e["ranks"], e["row_slot"], True, _stream(), a=a, sync=sync,
                                    shrink_producer=producer)
            torch.cuda.synchronize()
            assert not sync.any(), (spans, rows)  # left zero for the next launch
            return out

        v = torch.full_like(e["v"], float("nan"))
        got = launch(x, e, v)
        _shrink_checked(v, x, a, e, (spans, rows))
        if producer:  # the consumers' bits
            vc = torch.full_like(v, float("nan"))
            assert _same_bits(launch(x, e, vc, producer=False), got) and torch.equal(vc.nan_to_num(), v.nan_to_num())
        handed = torch.full_like(got, float("nan"))
        ext.fp8_gemm_sm90_fused(handed, x, w, e["x_scale"], e["w_scale"], e["bias"], e["cols"], v.nan_to_num(),
                                e["b"], e["ranks"], e["row_slot"], True, _stream())
        assert _same_bits(got, handed), (spans, rows)
        v2 = torch.full_like(v, float("nan"))
        assert _same_bits(launch(x, e, v2), got) and torch.equal(v2.nan_to_num(), v.nan_to_num()), (spans, rows)
        for i in sorted({0, rows // 2, rows - 1}):
            one = {**e, "x_scale": e["x_scale"][:1], "row_slot": e["row_slot"][i:i + 1].contiguous()}
            vi = torch.full_like(v, float("nan"))
            alone = launch(x[i:i + 1].contiguous(), one, vi)
            assert _same_bits(alone[0], got[i]) and torch.equal(vi[0].nan_to_num(), v[i].nan_to_num()), (spans, i)


@pytest.mark.parametrize("producer", [False, True], ids=["consumers", "producer"])
@pytest.mark.parametrize("M", [1, 17, 32, 64])
def test_the_bf16_shrink_first_then_the_epilogues_launch(ext, M, producer):
    """bf16_sm90_shrink_first (KernelChoices.sm90_shrink_first): the bf16 product into fp32 with the rows' shrink
    first (fp8_gemm_sm90 with lora_x = x), then the FP8 epilogue's launch with unit scales, is bit for bit the one
    launch with the shrink and the expand inside (fp8_gemm_sm90_fused with A pools), v too; the counters are zero after
    each pair and a second pair on them gives the same bits. At 64 rows also 256 weight tiles (later waves)."""
    from lorafleet.runner.model.fp8 import bf16_sm90_shrink_first

    for spans, rows, x, w, e, a, sync in _bf16_shrink_cases(M):
        unit = torch.ones(max(rows, sum(spans)), device="cuda")
        one = torch.full((rows, sum(spans)), float("nan"), device="cuda", dtype=torch.bfloat16)
        v1 = torch.full_like(e["v"], float("nan"))
        ext.fp8_gemm_sm90_fused(one, x, w, unit[:rows], unit[:sum(spans)], e["bias"], e["cols"], v1, e["b"],
                                e["ranks"], e["row_slot"], True, _stream(), a=a, sync=sync, shrink_producer=producer)
        torch.cuda.synchronize()
        assert not sync.any()
        for again in range(2):
            v2 = torch.full_like(e["v"], float("nan"))
            two = bf16_sm90_shrink_first(ext, x, w, e["bias"], e["cols"], (v2, e["b"], e["ranks"], e["row_slot"], a),
                                         unit, sync, shrink_producer=producer)
            torch.cuda.synchronize()
            assert not sync.any(), (spans, rows, again)  # left zero for the next launch
            assert _same_bits(two, one), (spans, rows, again)
            assert torch.equal(v2.nan_to_num(), v1.nan_to_num()), (spans, rows, again)


@pytest.mark.parametrize("act", [1, 2], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("M", [1, 32])
def test_the_bf16_two_launches_apply_the_activation(ext, M, act):
    """bf16_sm90_shrink_first with `act` (gate_up's two equal spans): the FP8 epilogue's launch returns act(gate) * up,
    bit for bit flashinfer's act_and_mul of the one launch's output (the launch it replaces), with the shrink first
    and with v already written (no A pools: a plain product into fp32)."""
    import flashinfer

    from lorafleet.runner.model.fp8 import bf16_sm90_shrink_first

    spans, K = [2048, 2048], 4096
    x, w = _bf16_operands(M, K, sum(spans), seed=M + act)
    _, _, e = _fused_args(spans, M, True, True, K, seed=M + act + 1)
    unit = torch.ones(sum(spans), device="cuda")
    a = _shrink_pools(spans, K, seed=M + act + 2)
    sync = torch.zeros(4, dtype=torch.int32, device="cuda")
    one = torch.full((M, sum(spans)), float("nan"), device="cuda", dtype=torch.bfloat16)
    v = torch.full_like(e["v"], float("nan"))
    ext.fp8_gemm_sm90_fused(one, x, w, unit[:M], unit, e["bias"], spans, v, e["b"], e["ranks"], e["row_slot"], True,
                            _stream(), a=a, sync=sync)
    want = (flashinfer.silu_and_mul if act == 1 else flashinfer.gelu_tanh_and_mul)(one)
    v2 = torch.full_like(v, float("nan"))
    got = bf16_sm90_shrink_first(ext, x, w, e["bias"], spans, (v2, e["b"], e["ranks"], e["row_slot"], a), unit, sync,
                                 act=act)
    handed = bf16_sm90_shrink_first(ext, x, w, e["bias"], spans, (v, e["b"], e["ranks"], e["row_slot"], None), unit,
                                    None, act=act)
    torch.cuda.synchronize()
    assert got.shape == (M, spans[0]) and not sync.any()
    assert _same_bits(got, want) and _same_bits(handed, want)
    assert torch.equal(v2.nan_to_num(), v.nan_to_num())


@pytest.mark.parametrize("producer", [False, True], ids=["consumers", "producer"])
def test_the_shrink_inside_back_to_back_products(ext, producer):
    """Two launches one after the other on one stream (programmatic dependent launch), 256 weight tiles each, sharing
    one v buffer with counters of their own, the second on other rows and slots: each the bits of its launch alone,
    the second's v its own rows' shrink, every counter zero after (`producer`: the tickets on the producer warp
    group's warps, four counters)."""
    spans, M, K = [8192, 4096, 4096], 64, 4096
    x1, w = _bf16_operands(M, K, sum(spans), seed=41)
    x2, _ = _bf16_operands(M, K, sum(spans), seed=42)
    _, _, e = _fused_args(spans, M, True, True, K, seed=43)
    e = {**e, "x_scale": torch.ones(M, device="cuda"), "w_scale": torch.ones(sum(spans), device="cuda")}
    e2 = {**e, "row_slot": e["row_slot"].roll(5).contiguous()}
    a = _shrink_pools(spans, K, seed=44)
    syncs = [torch.zeros(4 if producer else 3, dtype=torch.int32, device="cuda") for _ in range(2)]

    def launch(x, e, v, sync, out=None):
        out = torch.full((M, sum(spans)), float("nan"), device="cuda", dtype=torch.bfloat16) if out is None else out
        ext.fp8_gemm_sm90_fused(out, x, w, e["x_scale"], e["w_scale"], e["bias"], e["cols"], v, e["b"], e["ranks"],
                                e["row_slot"], True, _stream(), a=a, sync=sync, shrink_producer=producer)
        return out

    v = torch.full_like(e["v"], float("nan"))
    first, second = launch(x1, e, v, syncs[0]), launch(x2, e2, v, syncs[1])
    torch.cuda.synchronize()
    assert not syncs[0].any() and not syncs[1].any()
    v_alone = torch.full_like(v, float("nan"))
    assert _same_bits(second, launch(x2, e2, v_alone, syncs[1]))
    torch.cuda.synchronize()
    mine, _, _ = _shrink_fp64(x2, a, e2)  # (the first launch's entries stay where the second writes none)
    assert torch.equal(v[mine], v_alone[mine])
    v1 = torch.full_like(v, float("nan"))
    assert _same_bits(first, launch(x1, e, v1, syncs[0]))
    _shrink_checked(v_alone, x2, a, e2, "second")


@pytest.mark.parametrize("producer", [False, True], ids=["consumers", "producer"])
def test_the_shrink_inside_the_product_in_a_graph(ext, producer):
    """Captured once, replayed on new rows and new row slots: the eager launch's bits, and the counters zero after
    every replay (`producer`: the tickets on the producer warp group's warps)."""
    spans, M, K = [4096, 1024, 1024], 32, 4096
    x, w = _bf16_operands(M, K, sum(spans), seed=8)
    _, _, e = _fused_args(spans, M, True, True, K, seed=9)
    e = {**e, "x_scale": torch.ones(M, device="cuda"), "w_scale": torch.ones(sum(spans), device="cuda")}
    a = _shrink_pools(spans, K, seed=10)
    sync = torch.zeros(4 if producer else 3, dtype=torch.int32, device="cuda")
    out = torch.empty(M, sum(spans), device="cuda", dtype=torch.bfloat16)

    def launch(o, v):
        ext.fp8_gemm_sm90_fused(o, x, w, e["x_scale"], e["w_scale"], e["bias"], e["cols"], v, e["b"], e["ranks"],
                                e["row_slot"], True, torch.cuda.current_stream().cuda_stream, a=a, sync=sync,
                                shrink_producer=producer)

    _replays_are_eager(launch, out, e, sync, lambda seed: x.copy_(_bf16_operands(M, K, sum(spans), seed=seed)[0]),
                       (31, 32, 33))


@pytest.mark.parametrize("act", [0, 1], ids=["qkv", "gate_up_silu"])
def test_the_bf16_two_launches_in_a_graph(ext, act):
    """bf16_sm90_shrink_first (the default for bf16 products with adapters) captured once, replayed on new rows and
    new row slots: the eager launches' bits, and the counter zero after every replay (qkv's three spans; gate_up's two
    with the activation in the epilogue's launch)."""
    from lorafleet.runner.model.fp8 import bf16_sm90_shrink_first

    spans, M, K = ([4096, 1024, 1024] if not act else [2048, 2048]), 32, 4096
    x, w = _bf16_operands(M, K, sum(spans), seed=12 + act)
    _, _, e = _fused_args(spans, M, True, True, K, seed=13 + act)
    a = _shrink_pools(spans, K, seed=14 + act)
    sync = torch.zeros(4, dtype=torch.int32, device="cuda")
    unit = torch.ones(max(M, sum(spans)), device="cuda")
    out = torch.empty(M, spans[0] if act else sum(spans), device="cuda", dtype=torch.bfloat16)

    def launch(o, v):
        o.copy_(bf16_sm90_shrink_first(ext, x, w, e["bias"], spans, (v, e["b"], e["ranks"], e["row_slot"], a), unit,
                                       sync, act=act))

    _replays_are_eager(launch, out, e, sync, lambda seed: x.copy_(_bf16_operands(M, K, sum(spans), seed=seed)[0]),
                       (41, 42, 43))


def _replays_are_eager(launch, out, e, sync, refresh, seeds) -> None:
    """`launch(out, v)` captured once in a CUDA graph (warmed up outside the capture), then for each seed new rows
    (refresh(seed)) and the row slots rolled by it: the replay gives the eager launch's bits, and the shrink's
    counters are zero after it."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch(out, e["v"])  # warm up outside the capture
        with torch.cuda.graph(graph, stream=side):
            launch(out, e["v"])
    torch.cuda.current_stream().wait_stream(side)
    for seed in seeds:
        refresh(seed)
        e["row_slot"].copy_(e["row_slot"].roll(seed))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not sync.any(), seed
        eager = torch.empty_like(out)
        launch(eager, torch.empty_like(e["v"]))
        torch.cuda.synchronize()
        assert _same_bits(out, eager), seed


def test_the_shrink_inside_the_product_refuses_what_it_cannot_do(ext):
    x, w = _bf16_operands(4, 256, 128, seed=3)
    _, _, e = _fused_args([64, 32, 32], 4, False, True, 256, seed=1)
    a = _shrink_pools([64, 32, 32], 256, seed=2)
    sync = torch.zeros(3, dtype=torch.int32, device="cuda")
    base = dict(out=torch.empty(4, 128, device="cuda", dtype=torch.bfloat16), x=x, w=w, x_scale=torch.ones(4,
                device="cuda"), w_scale=torch.ones(128, device="cuda"), bias=None, cols=e["cols"], v=e["v"],
                b=e["b"], ranks=e["ranks"], row_slot=e["row_slot"], pdl=True, stream=_stream(), a=a, sync=sync)
    xq, wq, _ = _fused_args([64, 32, 32], 4, False, True, 256, seed=1)
    cases = [
        (dict(sync=None), "needs both a and sync"),
        (dict(a=[]), "needs both a and sync"),
        (dict(a=a[:2]), "one A pool per span"),
        (dict(v=None, b=[], ranks=None, row_slot=None), "takes bf16 x, LoRA"),
        (dict(x=xq, w=wq.q), "the shrink inside takes bf16 operands"),  # e4m3 operands take the shrink first
        (dict(sync=torch.zeros(2, dtype=torch.int32, device="cuda")), "at least 3 entries"),
        (dict(shrink_producer=True), "at least 4 entries"),  # (the producer warps' exits counted in a fourth)
        (dict(sync=torch.zeros(3, device="cuda")), "sync must be contiguous int32"),
        (dict(a=[t[:, :, :128].contiguous() for t in a]), "features"),
        (dict(a=[t[:, :64].contiguous() for t in a]), r"rank dimension 64, below b\[0\]'s 128"),
    ]
    for change, match in cases:
        with pytest.raises(RuntimeError, match=match):
            ext.fp8_gemm_sm90_fused(**{**base, **change})
    assert not sync.any()


def _e4m3_rows(M: int, K: int, N: int, seed: int):
    """_operands' e4m3 rows with the bf16 rows they were quantized from: (x, xq, w)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    x[0, :: max(1, K // 7)] = 30.0
    w = quantize_rows(torch.randn(N, K, device="cuda", generator=g) * 0.05)
    return x, quantize_tokens(x)[0], w


def _shrink_first(ext, x, xq, w, e, a, v, sync, out=None, producer=False) -> torch.Tensor:
    """fp8_gemm_sm90 with the rows' shrink first (lora_x ... sync) into fp32 `out` (NaN: every element must be
    written); `producer`: its tickets on the producer warp group's warps (shrink_producer)."""
    if out is None:
        out = torch.full((xq.shape[0], w.q.shape[0]), float("nan"), device="cuda")
    ext.fp8_gemm_sm90(out, xq, w.q, torch.cuda.current_stream().cuda_stream, lora_x=x, cols=e["cols"], v=v, b=e["b"],
                      ranks=e["ranks"], row_slot=e["row_slot"], a=a, sync=sync, shrink_producer=producer)
    return out


@pytest.mark.parametrize("producer", [False, True], ids=["consumers", "producer"])
@pytest.mark.parametrize("M", [1, 17, 32, 64])
def test_the_shrink_first_in_the_fp8_product(ext, M, producer):
    """e4m3 operands with x's bf16 rows, the A pools and a counter (fp8_gemm_sm90's lora_x ... sync): the product's own
    warps write v before their main loop, for the FP8 epilogue's launch after it. v holds the fp64 sums of x's rows and
    A's rank rows within fp32 accumulation's rounding wherever a row has an adapter (every kind of slot and rank of
    _fused_args), and nothing else of v is written; the product is bit for bit the call without the shrink; the
    counter is zero again after the launch; a second launch gives the same bits, and each row's v is the row alone's.
    At 64 rows also 256 weight tiles (more CTAs than the GPU has SMs: warps of later waves find no ticket left).
    `producer`: the producer warp group's warps 1-3 take the tickets (in load_init, beside the main loop); v then
    also the consumers' bits."""
    cases = [c for c in FUSED_CASES if c[3] and {37: 32, 5: 1}.get(c[1], c[1]) == M]
    if M == 64:
        cases.append(([8192, 4096, 4096], 64, True, True, 4096))
    assert cases
    for spans, rows, bias, lora, K in cases:
        x, xq, w = _e4m3_rows(rows, K, sum(spans), seed=rows + K)
        _, _, e = _fused_args(spans, rows, bias, lora, K, seed=rows + K + len(spans))
        a = _shrink_pools(spans, K, seed=rows + K)
        sync = torch.zeros(2, dtype=torch.int32, device="cuda")
        v = torch.full_like(e["v"], float("nan"))
        got = _shrink_first(ext, x, xq, w, e, a, v, sync, producer=producer)
        torch.cuda.synchronize()
        assert not sync.any(), (spans, rows)  # left zero for the next launch
        _shrink_checked(v, x, a, e, (spans, rows))
        assert torch.equal(got, _sm90(ext, xq, w)), (spans, rows)
        if producer:  # the consumers' bits
            vc = torch.full_like(v, float("nan"))
            _shrink_first(ext, x, xq, w, e, a, vc, sync)
            torch.cuda.synchronize()
            assert torch.equal(vc.nan_to_num(), v.nan_to_num()) and not sync.any(), (spans, rows)
        v2 = torch.full_like(v, float("nan"))
        again = _shrink_first(ext, x, xq, w, e, a, v2, sync, producer=producer)
        torch.cuda.synchronize()
        assert torch.equal(again, got) and torch.equal(v2.nan_to_num(), v.nan_to_num()), (spans, rows)
        assert not sync.any(), (spans, rows)
        for i in sorted({0, rows // 2, rows - 1}):
            one = {**e, "row_slot": e["row_slot"][i:i + 1].contiguous()}
            vi = torch.full_like(v, float("nan"))
            _shrink_first(ext, x[i:i + 1].contiguous(), xq[i:i + 1].contiguous(), w, one, a, vi, sync,
                          producer=producer)
            torch.cuda.synchronize()
            assert torch.equal(vi[0].nan_to_num(), v[i].nan_to_num()), (spans, i)


@pytest.mark.parametrize("producer", [False, True], ids=["consumers", "producer"])
def test_the_shrink_first_with_k_in_parts(ext, producer):
    """The shrink first in a product whose K is cut into parts (a batch of CTAs per part, every one drawing from the
    counter): v the rows' whole shrink, the parts the call without the shrink's, the counter zero after."""
    spans, M, K = [1024, 256, 256], 32, 4096
    x, xq, w = _e4m3_rows(M, K, sum(spans), seed=71)
    _, _, e = _fused_args(spans, M, True, True, K, seed=72)
    a = _shrink_pools(spans, K, seed=73)
    sync = torch.zeros(1, dtype=torch.int32, device="cuda")
    for parts in (2, 4):
        v = torch.full_like(e["v"], float("nan"))
        got = torch.full((parts, M, sum(spans)), float("nan"), device="cuda")
        ext.fp8_gemm_sm90(got, xq, w.q, _stream(), parts, lora_x=x, cols=e["cols"], v=v, b=e["b"], ranks=e["ranks"],
                          row_slot=e["row_slot"], a=a, sync=sync, shrink_producer=producer)
        want = torch.empty_like(got)
        ext.fp8_gemm_sm90(want, xq, w.q, _stream(), parts)
        torch.cuda.synchronize()
        assert not sync.any() and torch.equal(got, want), parts
        _shrink_checked(v, x, a, e, parts)


@pytest.mark.parametrize("producer", [False, True], ids=["consumers", "producer"])
def test_the_shrink_first_back_to_back_and_in_a_graph(ext, producer):
    """Two launches one after the other on one stream (programmatic dependent launch), 256 weight tiles each, sharing
    one v buffer with counters of their own, the second on other rows and slots: its v its own rows' shrink, both
    counters zero after. Then the shrink first and the FP8 epilogue's launch captured in a CUDA graph, replayed on
    new rows and new row slots: the eager launches' bits, and the counter zero after every replay."""
    spans, M, K = [8192, 4096, 4096], 64, 4096
    x1, xq1, w = _e4m3_rows(M, K, sum(spans), seed=51)
    x2, xq2, _ = _e4m3_rows(M, K, sum(spans), seed=52)
    _, _, e = _fused_args(spans, M, True, True, K, seed=53)
    e2 = {**e, "row_slot": e["row_slot"].roll(5).contiguous()}
    a = _shrink_pools(spans, K, seed=54)
    syncs = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(2)]
    v = torch.full_like(e["v"], float("nan"))
    _shrink_first(ext, x1, xq1, w, e, a, v, syncs[0], producer=producer)
    _shrink_first(ext, x2, xq2, w, e2, a, v, syncs[1], producer=producer)
    torch.cuda.synchronize()
    assert not syncs[0].any() and not syncs[1].any()
    mine, _, _ = _shrink_fp64(x2, a, e2)  # (the first launch's entries stay where the second writes none)
    v_alone = torch.full_like(v, float("nan"))
    _shrink_first(ext, x2, xq2, w, e2, a, v_alone, syncs[1], producer=producer)
    torch.cuda.synchronize()
    assert torch.equal(v[mine], v_alone[mine])
    _shrink_checked(v_alone, x2, a, e2, "second")

    x, xq, w, e, a, out, refresh = _e4m3_graph_case(8)
    sync = syncs[0]

    def launch(o, v):  # the product with the shrink first, then the FP8 epilogue's launch with the expand
        y = _shrink_first(ext, x, xq, w, e, a, v, sync, out=torch.empty(out.shape, device="cuda"), producer=producer)
        ext.fp8_epilogue(o, y, e["x_scale"], e["w_scale"], e["bias"], e["cols"], v, e["b"], e["ranks"],
                         e["row_slot"], True, torch.cuda.current_stream().cuda_stream)

    _replays_are_eager(launch, out, e, sync, refresh, (61, 62, 63))


def _e4m3_graph_case(seed: int):
    """32 e4m3 rows (K 4,096) over qkv-like spans with LoRA and A pools for the graph tests: x, xq, w, the epilogue's
    operands, the A pools, a bf16 output and `refresh(seed)`, which writes new rows into x and xq in place."""
    spans, M, K = [4096, 1024, 1024], 32, 4096
    x, xq, w = _e4m3_rows(M, K, sum(spans), seed=seed)
    _, _, e = _fused_args(spans, M, True, True, K, seed=seed + 1)
    a = _shrink_pools(spans, K, seed=seed + 2)

    def refresh(s):
        nx, nxq, _ = _e4m3_rows(M, K, sum(spans), seed=s)
        x.copy_(nx)
        xq.copy_(nxq)

    return x, xq, w, e, a, torch.empty(M, sum(spans), device="cuda", dtype=torch.bfloat16), refresh


def _refusal_case(counters: int):
    """4 rows, K 256, three spans: x, its e4m3 rows, the weight, the epilogue's operands, A pools, `counters` zero
    counters, and bf16 operands of the same sizes."""
    x, xq, w = _e4m3_rows(4, 256, 128, seed=3)
    _, _, e = _fused_args([64, 32, 32], 4, False, True, 256, seed=1)
    a = _shrink_pools([64, 32, 32], 256, seed=2)
    xb, wb = _bf16_operands(4, 256, 128, seed=3)
    return x, xq, w, e, a, torch.zeros(counters, dtype=torch.int32, device="cuda"), xb, wb


def test_the_shrink_first_refuses_what_it_cannot_do(ext):
    x, xq, w, e, a, sync, xb, wb = _refusal_case(1)
    base = dict(out=torch.empty(4, 128, device="cuda"), x=xq, w=w.q, stream=_stream(), lora_x=x, cols=e["cols"],
                v=e["v"], b=e["b"], ranks=e["ranks"], row_slot=e["row_slot"], a=a, sync=sync)
    cases = [
        (dict(sync=None), "needs both lora_x and sync"),
        (dict(lora_x=None), "needs both lora_x and sync"),
        (dict(lora_x=None, sync=None), "are the shrink first's"),  # LoRA's operands would be ignored
        (dict(persistent=True), "one CTA a tile, not persistent"),
        (dict(x=xb, w=wb), "with bf16 operands the shrink first's lora_x is x itself"),
        (dict(x=xb, w=wb, lora_x=xb.clone()), "with bf16 operands the shrink first's lora_x is x itself"),
        (dict(lora_x=x[:, :128].contiguous()), r"lora_x must be contiguous, 16-byte aligned bfloat16 \[4, 256\]"),
        (dict(lora_x=x.half()), r"lora_x must be contiguous, 16-byte aligned bfloat16 \[4, 256\]"),
        (dict(v=None, b=[], ranks=None, row_slot=None), "needs LoRA"),
        (dict(a=a[:2]), "one A pool per span"),
        (dict(cols=[64, 64]), "one B pool per span"),  # two spans against three B pools
        (dict(sync=torch.zeros(1, device="cuda")), "sync must be contiguous int32"),
        (dict(a=[t[:, :64].contiguous() for t in a]), r"rank dimension 64, below b\[0\]'s 128"),
    ]
    for change, match in cases:
        with pytest.raises(RuntimeError, match=match):
            ext.fp8_gemm_sm90(**{**base, **change})
    assert not sync.any()


def test_the_fp8_product_refuses_the_shrink_inside(ext):
    """fp8_gemm_sm90_fused takes the rows' shrink inside only on bf16 operands: e4m3 operands with A pools and counters
    are refused (they take the shrink first, fp8_gemm_sm90, and the FP8 epilogue's launch), counters untouched."""
    x, xq, w, e, a, sync, _, _ = _refusal_case(4)
    base = dict(out=torch.empty(4, 128, device="cuda", dtype=torch.bfloat16), x=xq, w=w.q, x_scale=e["x_scale"],
                w_scale=e["w_scale"], bias=None, cols=e["cols"], v=e["v"], b=e["b"], ranks=e["ranks"],
                row_slot=e["row_slot"], pdl=True, stream=_stream(), a=a, sync=sync)
    for change in ({}, {"shrink_producer": True}, {"persistent": True}):
        with pytest.raises(RuntimeError, match="the shrink inside takes bf16 operands"):
            ext.fp8_gemm_sm90_fused(**{**base, **change})
    with pytest.raises(TypeError):  # (x's bf16 rows for it are no argument of the fused launch)
        ext.fp8_gemm_sm90_fused(**base, lora_x=x)
    assert not sync.any()

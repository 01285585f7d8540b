"""FP8 on the GPU's FP8 tensor cores (`--quantization fp8`, and with `--kv-cache-dtype fp8`) against an
independent reference: HF transformers + PEFT in fp32 on the checkpoint whose projection weights were rounded
through e4m3 per output row, with the inputs of those projections rounded per token and (FP8 pages) K and V
rounded through e4m3 (fp8_reference.py), teacher-forced, with the same HF model run in bf16 on the GPU as the
tolerance (teacher.py); and decode graph replay against the eager step.

Two layouts of projections: separate q/k/v and gate/up (llama3, GQA) and fused qkv / gate_up (phi3)."""

from __future__ import annotations

import functools
import os

import pytest
import torch

import teacher
from fp8_reference import emulate_fp8, rounded_copy
from lorafleet.runner.config import EngineConfig, KernelChoices
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.model.fp8 import E4M3, Fp8Weight, fp8_tensor_cores
from reference import HFReference

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
NEW = 8
needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or not fp8_tensor_cores(torch.device("cuda")),
                               reason="no FP8 tensor cores (compute capability below 8.9)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_kernel_gives_the_torch_quantization_bits(dtype):
    """csrc/quant.cu (one launch) against quantize_tokens' torch ops, bit for bit: widths with and without
    16-byte rows, a strided view, a zero row, a row with a NaN, a row with an infinity (its scale infinite, its
    infinities NaN, everything else 0), values far past e4m3's range and tiny ones."""
    from lorafleet.runner.kernels import load
    from lorafleet.runner.model.fp8 import quantize_tokens

    ext = load()
    g = torch.Generator(device="cuda").manual_seed(3)
    # (300 rows of 8,200: the wide rows' 256-thread blocks of a prefill-sized launch; fewer rows take 1,024 threads)
    for rows, cols in ((1, 8), (32, 4096), (7, 28672), (5, 1000), (3, 13), (2, 16384), (3, 16392), (300, 8200)):
        x = (torch.randn(rows, cols, device="cuda", generator=g) * 3).to(dtype)
        x[0, : min(cols, 4)] = torch.tensor([6e4, -6e4, 1e-7, -3e-5], dtype=dtype)[: min(cols, 4)]
        if rows > 2:
            x[1] = 0
            x[2, cols // 2] = float("nan")
            x[-1, cols // 3] = float("-inf")
        for view in (x, torch.cat([x, x], dim=1)[:, :cols]):  # contiguous, then rows with a stride of 2 * cols
            want_q, want_s = quantize_tokens(view)
            got_q, got_s = quantize_tokens(view, ext)
            assert torch.equal(got_s.isnan(), want_s.isnan()), (rows, cols)
            ok = ~want_s.isnan().view(-1)
            assert torch.equal(got_s[ok], want_s[ok]), (rows, cols)
            assert torch.equal(got_q.view(torch.uint8)[ok], want_q.view(torch.uint8)[ok]), (rows, cols)
            bad_q, bad_want = got_q.view(torch.uint8)[~ok].float(), want_q.view(torch.uint8)[~ok].float()
            assert (bad_q.remainder(128) == 127).all() and (bad_want.remainder(128) == 127).all()  # NaN rows: NaN


@needs_fp8
@pytest.mark.parametrize("variant", [
    # (w @ x.T).T on the tensor cores (KernelChoices.fp8_swap_rows); M = 1 is not swapped
    pytest.param((dict(swap_rows=64), ((1, 256, 512), (16, 256, 512), (32, 4096, 1536), (64, 1024, 4096))),
                 id="swapped"),
    # unit scales into fp32, the token and row scales after (KernelChoices.fp8_unit_scale_elems)
    pytest.param((dict(unit_scale_elems=1), ((1, 256, 512), (32, 4096, 1536), (64, 1024, 4096))),
                 id="unit_scales"),
])
def test_other_fp8_calls_give_the_same_product(variant):
    """fp8_linear's alternative calls of the FP8 tensor cores against the x @ w.T call with per-token and per-row
    scales and against the fp32 product of the dequantized operands."""
    from lorafleet.runner.model.fp8 import fp8_linear, quantize_rows, quantize_tokens

    kwargs, shapes = variant
    g = torch.Generator(device="cuda").manual_seed(5)
    for M, K, N in shapes:
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w = quantize_rows(torch.randn(N, K, device="cuda", generator=g) * 0.05)
        plain = fp8_linear(x, w, None, True)
        other = fp8_linear(x, w, None, True, **kwargs)
        xq, sx = quantize_tokens(x)
        exact = (xq.float() * sx) @ w.dequant(torch.float32).t()
        assert other.shape == (M, N) and other.is_contiguous() and other.dtype == torch.bfloat16
        torch.testing.assert_close(other.float(), exact, rtol=8e-3, atol=1e-3 * exact.abs().max().item())
        torch.testing.assert_close(other, plain, rtol=8e-3, atol=1e-3 * exact.abs().max().item())


@needs_fp8
@pytest.mark.parametrize("M", [1, 7, 16, 32, 33, 64])
def test_own_fp8_kernel_gives_the_scaled_product(M):
    """csrc/fp8_gemm.cu against the fp32 product of the dequantized operands and against torch._scaled_mm, K of
    64 to 11,008 in one range or split over blocks (an uneven last range at 11,008), N of one warp's 16 rows to
    24,576, a last block with one live warp (4,112); and each token's row as in a step of that token alone."""
    from lorafleet.runner.kernels import load
    from lorafleet.runner.model.fp8 import fp8_linear, quantize_rows, quantize_tokens

    ext = load()
    g = torch.Generator(device="cuda").manual_seed(M)
    for K, N in ((64, 16), (4096, 4096), (1024, 8192), (11008, 4096), (256, 24576), (512, 4112)):
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w = quantize_rows(torch.randn(N, K, device="cuda", generator=g) * 0.05)
        xq, sx = quantize_tokens(x, ext)
        exact = (xq.float() * sx) @ w.dequant(torch.float32).t()
        got = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)  # every element must be written
        ext.fp8_gemm(got, xq, sx.view(-1), w.q, w.scale, torch.cuda.current_stream().cuda_stream)
        via = fp8_linear(x, w, None, True, ext, own_rows=64)  # the engine's call takes the kernel
        assert torch.equal(via, got)
        ref = fp8_linear(x, w, None, True, ext)
        tol = dict(rtol=8e-3, atol=2e-3 * exact.abs().max().item())
        torch.testing.assert_close(got.float(), exact, **tol, msg=lambda m: f"M={M} K={K} N={N}: {m}")
        torch.testing.assert_close(got, ref, **tol)
        for i in sorted({0, M // 2, M - 1}):  # batch-independent bits: the K split never depends on M
            alone = torch.empty((1, N), device="cuda", dtype=torch.bfloat16)
            ext.fp8_gemm(alone, xq[i:i + 1].contiguous(), sx.view(-1)[i:i + 1].contiguous(), w.q, w.scale,
                         torch.cuda.current_stream().cuda_stream)
            assert torch.equal(alone[0], got[i]), (M, K, N, i)
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        ext.fp8_gemm(torch.empty(65, 16, device="cuda", dtype=torch.bfloat16),
                     torch.zeros(65, 64, device="cuda").to(E4M3), torch.ones(65, device="cuda"),
                     torch.zeros(16, 64, device="cuda").to(E4M3), torch.ones(16, device="cuda"),
                     torch.cuda.current_stream().cuda_stream)


@needs_fp8
@pytest.mark.parametrize("M", [1, 9, 32, 64])
def test_own_fp8_kernel_on_bf16_rows_gives_the_weight_only_product(M):
    """csrc/fp8_gemm.cu with unquantized bf16 activations (fp8_gemm_bf16): the fp32 product of the bf16 rows and
    the dequantized e4m3 weight (every e4m3 value, subnormals and +-448 included, converted exactly), K in one
    range and split, a last block with one live warp; each token's row as in a step of that token alone."""
    from lorafleet.runner.kernels import load
    from lorafleet.runner.model.fp8 import quantize_rows

    ext = load()
    g = torch.Generator(device="cuda").manual_seed(100 + M)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    every = torch.where((codes & 0x7F) == 0x7F, 0, codes).to(torch.uint8).view(E4M3).cuda()  # all codes, NaNs -> 0
    for K, N in ((256, 16), (4096, 4096), (11008, 4096), (512, 4112)):
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w = quantize_rows(torch.randn(N, K, device="cuda", generator=g) * 0.05)
        w.q[:1, :256] = every  # the first row holds every code
        exact = x.float() @ w.dequant(torch.float32).t()
        got = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        ext.fp8_gemm_bf16(got, x, w.q, w.scale, torch.cuda.current_stream().cuda_stream)
        tol = dict(rtol=8e-3, atol=2e-3 * exact.abs().max().item())
        torch.testing.assert_close(got.float(), exact, **tol, msg=lambda m: f"M={M} K={K} N={N}: {m}")
        for i in sorted({0, M // 2, M - 1}):
            alone = torch.empty((1, N), device="cuda", dtype=torch.bfloat16)
            ext.fp8_gemm_bf16(alone, x[i:i + 1].contiguous(), w.q, w.scale, torch.cuda.current_stream().cuda_stream)
            assert torch.equal(alone[0], got[i]), (M, K, N, i)
    # one code at a time against its float value: the conversion itself, exactly
    K, N = 256, 16
    w_q = every.view(1, 256).expand(N, 256).contiguous()
    for o in range(4):
        x = torch.zeros(64, K, device="cuda", dtype=torch.bfloat16)
        x[torch.arange(64), torch.arange(64) * 4 + o] = 1.0  # token i picks code 4 i + o of every row
        got = torch.empty(64, N, device="cuda", dtype=torch.bfloat16)
        ext.fp8_gemm_bf16(got, x, w_q, torch.ones(N, device="cuda"), torch.cuda.current_stream().cuda_stream)
        want = every.float()[torch.arange(64, device="cuda") * 4 + o].view(64, 1).expand(64, N)
        assert torch.equal(got.float(), want), o
    with pytest.raises(RuntimeError, match="bfloat16"):
        ext.fp8_gemm_bf16(torch.empty(4, 16, device="cuda", dtype=torch.bfloat16),
                          torch.zeros(4, 64, device="cuda"), torch.zeros(16, 64, device="cuda").to(E4M3),
                          torch.ones(16, device="cuda"), torch.cuda.current_stream().cuda_stream)


def _epilogue_case(dtype, spans, M, bias: bool, lora: bool, seed: int):
    """Random operands of the FP8 epilogue: the fp32 unit-scale product, scales, bias, and a LoRA step whose rows
    hold every kind of slot (-1, out of range, adapters with rank 0, 1, 5, 16 and the pool's 128, a rank past
    the pool's, a negative one)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    N = sum(spans)
    case = {"y": torch.randn(M, N, device=dev, generator=g) * 40,
            "x_scale": torch.rand(M, device=dev, generator=g) * 0.05 + 1e-3,
            "w_scale": torch.rand(N, device=dev, generator=g) * 0.02 + 1e-4,
            "bias": (torch.randn(N, device=dev, generator=g) * 0.5).to(dtype) if bias else None}
    if lora:
        S, R = 7, 128
        case["b"] = [(torch.randn(S, R, n, device=dev, generator=g) * 0.1).to(dtype) for n in spans]
        case["v"] = torch.randn(M, len(spans), R, device=dev, generator=g)
        ranks = torch.tensor([1, 5, 16, 0, 128, 400, -3], dtype=torch.int32)
        case["ranks"] = torch.stack([ranks.roll(k) for k in range(len(spans))]).to(dev).contiguous()
        row = torch.randint(-1, S + 1, (M,), generator=torch.Generator().manual_seed(seed))  # S: out of range
        row[: min(M, 3)] = torch.tensor([-1, S, 2])[: min(M, 3)]
        case["row_slot"] = row.to(torch.int32).to(dev)
    return case


def _epilogue_separate(ext, dtype, spans, c):
    """What the epilogue replaces: the unit-scale product's three torch ops, the bias add, then the SGMV expand
    (CUDA-core path) over the segments of equal row slots."""
    from lorafleet.runner.lora.segments import merge_runs

    out = c["y"].clone().mul_(c["x_scale"].view(-1, 1)).mul_(c["w_scale"].view(1, -1)).to(dtype)
    if c["bias"] is not None:
        out = out + c["bias"]
    if "v" in c:
        indptr, slots = merge_runs(c["row_slot"].tolist())
        ys = list(out.split(spans, dim=1))
        ext.expand(ys, c["v"], c["b"], c["ranks"], torch.tensor(indptr, dtype=torch.int32, device="cuda"),
                   torch.tensor(slots, dtype=torch.int32, device="cuda"), 1 << 30, True,
                   torch.cuda.current_stream().cuda_stream)
    return out


def _epilogue_fp64(spans, c):
    """The same sum in fp64 with no intermediate rounding (the independent reference), and the sum of its terms'
    magnitudes (what the roundings of the running value are relative to)."""
    out = c["y"].double() * c["x_scale"].double().view(-1, 1) * c["w_scale"].double().view(1, -1)
    mag = out.abs()
    if c["bias"] is not None:
        out += c["bias"].double()
        mag += c["bias"].double().abs()
    if "v" in c:
        lo = 0
        S = c["ranks"].shape[1]
        for g, n in enumerate(spans):
            for i, s in enumerate(c["row_slot"].tolist()):
                if 0 <= s < S:
                    r = min(max(int(c["ranks"][g, s]), 0), c["b"][g].shape[1])
                    add = c["v"][i, g, :r].double() @ c["b"][g][s, :r].double()
                    out[i, lo: lo + n] += add
                    mag[i, lo: lo + n] += add.abs()
            lo += n
    return out, mag


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spans,M,bias,lora", [([4096], 32, False, False), ([4096], 1, True, False),
                                                ([1024, 256, 256], 37, True, True), ([2056, 2056], 64, False, True),
                                                ([4096], 32, False, True), ([8, 16, 8], 5, True, True)])
def test_fp8_epilogue_is_the_separate_ops_bit_for_bit(dtype, spans, M, bias, lora):
    """csrc/quant.cu fp8_epilogue (scales, bias and the rows' LoRA expand in one launch) against the launches it
    replaces, bit for bit, and against the fp64 sum within the roundings of the separate ops."""
    from lorafleet.runner.kernels import load

    ext = load()
    c = _epilogue_case(dtype, spans, M, bias, lora, seed=M + len(spans))
    want = _epilogue_separate(ext, dtype, spans, c)
    got = torch.empty(M, sum(spans), dtype=dtype, device="cuda")
    ext.fp8_epilogue(got, c["y"], c["x_scale"], c["w_scale"], c["bias"], spans, c.get("v"), c.get("b", []),
                     c.get("ranks"), c.get("row_slot"), True, torch.cuda.current_stream().cuda_stream)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    exact, mag = _epilogue_fp64(spans, c)
    eps = torch.finfo(dtype).eps  # three roundings of the running value, each at most half an ulp of it
    assert ((got.double() - exact).abs() <= 2 * eps * mag + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", [1, 2], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("inter,M,bias,lora", [(1376, 32, False, True), (11008, 1, True, False), (8, 37, True, True),
                                               (2048, 64, False, False)])
def test_fp8_epilogue_with_the_activation_is_flashinfer_act_and_mul_bit_for_bit(dtype, act, inter, M, bias, lora):
    """fp8_epilogue(act=1 | 2) over the gate | up spans: bit for bit the epilogue followed by flashinfer's
    silu_and_mul / gelu_tanh_and_mul (the launch it replaces), and within a few roundings of the fp64 activation
    of the fp64 epilogue."""
    import flashinfer

    from lorafleet.runner.kernels import load

    ext = load()
    st = torch.cuda.current_stream().cuda_stream
    spans = [inter, inter]
    c = _epilogue_case(dtype, spans, M, bias, lora, seed=M + inter + act)
    c["y"] *= 100  # outputs of order one (40 * 100 * ~0.025 * ~0.01), where the activations bend
    args = (c["y"], c["x_scale"], c["w_scale"], c["bias"], spans, c.get("v"), c.get("b", []), c.get("ranks"),
            c.get("row_slot"), True, st)
    full = torch.empty(M, 2 * inter, dtype=dtype, device="cuda")
    ext.fp8_epilogue(full, *args)
    want = (flashinfer.silu_and_mul if act == 1 else flashinfer.gelu_tanh_and_mul)(full)
    got = torch.empty(M, inter, dtype=dtype, device="cuda")
    ext.fp8_epilogue(got, *args, act)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (got.float() - want.float()).abs().max()
    exact, mag = _epilogue_fp64(spans, c)
    gate, up = exact[:, :inter], exact[:, inter:]
    ref = (torch.nn.functional.silu(gate) if act == 1 else torch.nn.functional.gelu(gate, approximate="tanh")) * up
    err = (got.double() - ref).abs()
    # the epilogue's roundings are relative to the magnitudes of its terms (mag); |act(g)| <= |g|, |act'| < 1.2
    scale = (mag[:, :inter] + gate.abs()) * (mag[:, inter:] + up.abs())
    assert (err <= 8 * torch.finfo(dtype).eps * scale + 1e-5).all(), err.max()
    with pytest.raises(RuntimeError, match="two spans of equal width"):
        ext.fp8_epilogue(got, *args[:4], [inter - 8, inter + 8], *args[5:], act)
    with pytest.raises(RuntimeError, match="out must be"):
        ext.fp8_epilogue(full, *args, act)
    with pytest.raises(RuntimeError, match="act must be"):
        ext.fp8_epilogue(got, *args, 3)


def test_fp8_epilogue_refuses_bad_operands():
    from lorafleet.runner.kernels import load

    ext = load()
    st = torch.cuda.current_stream().cuda_stream
    c = _epilogue_case(torch.bfloat16, [64, 32, 32], 4, True, True, seed=1)
    out = torch.empty(4, 128, dtype=torch.bfloat16, device="cuda")
    args = dict(out=out, y=c["y"], x_scale=c["x_scale"], w_scale=c["w_scale"], bias=c["bias"], cols=[64, 32, 32],
                v=c["v"], b=c["b"], ranks=c["ranks"], row_slot=c["row_slot"], pdl=True, stream=st)
    for change, match in ((dict(cols=[64, 32, 24]), "spans cover"), (dict(cols=[64, 36, 28]), "multiple of 8"),
                          (dict(bias=c["bias"].float()), "bias"), (dict(b=c["b"][:2]), "one B pool per span"),
                          (dict(row_slot=None), "row_slot"), (dict(y=c["y"].double()), "float32"),
                          (dict(x_scale=c["x_scale"][:3]), "x_scale"),
                          (dict(b=[c["b"][0], c["b"][1][:, :, :16].contiguous(), c["b"][2]]), "features")):
        with pytest.raises(RuntimeError, match=match):
            ext.fp8_epilogue(**{**args, **change})


class _CountingExt:
    """The CUDA extension with its fp8_epilogue, fp8_gemm_sm90 and quantize_e4m3 calls counted; a call of
    fp8_gemm_sm90_fused (the product with the epilogue inside it) counts as one of each, and in `fused`; fp8_gemm_sm90
    calls on the persistent schedule (its 7th argument) in `persistent`, those with the rows' shrink first (a `sync`)
    in `shrink_first`."""

    def __init__(self, ext):
        self.ext, self.epilogues, self.with_act, self.sm90, self.fused, self.persistent = ext, 0, 0, 0, 0, 0
        self.quantized = 0  # the activation kernel's launches (quantize_e4m3)
        self.shrink_first = 0
        self.producer = 0  # ... of which on the producer warp group's warps (shrink_producer)

    def __getattr__(self, name):
        return getattr(self.ext, name)

    def fp8_gemm_sm90(self, *args, **kwargs):
        self.sm90 += 1
        self.persistent += len(args) > 6 and bool(args[6])
        self.shrink_first += kwargs.get("sync") is not None
        self.producer += bool(kwargs.get("shrink_producer"))
        return self.ext.fp8_gemm_sm90(*args, **kwargs)

    def fp8_gemm_sm90_fused(self, *args, **kwargs):
        self.sm90 += 1
        self.epilogues += 1
        self.fused += 1
        self.producer += bool(kwargs.get("shrink_producer"))
        return self.ext.fp8_gemm_sm90_fused(*args, **kwargs)

    def fp8_epilogue(self, *args):
        self.epilogues += 1
        self.with_act += len(args) > 12 and args[12] in (1, 2)
        return self.ext.fp8_epilogue(*args)

    def quantize_e4m3(self, *args):
        self.quantized += 1
        return self.ext.quantize_e4m3(*args)


@pytest.fixture(scope="module", params=["llama3", "phi3"])
def fam(request, tmp_path_factory):
    if not fp8_tensor_cores(torch.device("cuda")):
        pytest.skip("this GPU has no FP8 tensor cores (compute capability below 8.9)")
    name = request.param
    d = tmp_path_factory.mktemp(f"gpu-fp8-{name}")
    model, ads, reqs = teacher.family_with_two_adapters(name, d)
    return name, model, rounded_copy(model, d / "rounded"), ads, reqs


def reference_continuations(rounded, ads, reqs, kv: bool, activations: bool = True):
    """The fp32 greedy continuation of each request under the FP8 semantics (HF + PEFT on the CPU)."""
    ref = HFReference(rounded, ads)
    with emulate_fp8(ref.peft, activations=activations, kv=kv):
        return [ref.greedy(ids, n, NEW) for ids, n, _ in reqs]


# Each way of calling the FP8 tensor cores with flashinfer's norms (norm_quant=False: each product path as it was
# checked before the norm that quantizes became the default), and the defaults themselves.
_FI = {"norm_quant": False}
GEMM_CHOICES = {  # gemm -> the engine's kernel choices and step size for that FP8 call
    "cublaslt": {"kernels": KernelChoices(fp8_unit_scale_elems=0, **_FI)},  # the per-row call (the default: "unit")
    # every step on csrc/fp8_gemm.cu: steps of at most 64 rows, prompts in chunks
    "own": {"kernels": KernelChoices(fp8_gemm_rows=64, **_FI), "max_step_tokens": 64},
    # every projection of every step of at most 64 rows on cuBLASLt's unit-scale call (every weight is large enough)
    "unit": {"kernels": KernelChoices(fp8_unit_scale_elems=1, fp8_sm90=False, **_FI), "max_step_tokens": 64},
    # the default FP8 call with flashinfer's decode attention on tensor cores whatever the heads' grouping
    "unit_tc": {"kernels": KernelChoices(decode_tc="1", **_FI)},
    # the default FP8 call with the norms on the project's kernel, which quantizes the rows (and in decode
    # graphs with adapters does the LoRA shrink too)
    "unit_norm": {"kernels": KernelChoices(norm_shrink=True)},
    # the defaults: the wgmma product (below), the norms before qkv and gate_up on the project's kernel, which
    # quantizes the rows (KernelChoices.norm_quant: no shrink inside the norm's launch), and the rows' LoRA shrink
    # inside every product but the step's first, on its producer warp group's idle warps (fp8_sm90_shrink,
    # fp8_sm90_shrink_producer)
    "default": {"kernels": KernelChoices()},
    # every step on csrc/fp8_gemm.cu with the bf16 activations unquantized (weight-only FP8)
    "own_bf16": {"kernels": KernelChoices(fp8_gemm_rows=64, fp8_gemm_bf16=True, **_FI), "max_step_tokens": 64},
    # the unit-scale product of steps of at most 64 rows on the project's wgmma kernel (csrc/fp8_gemm_sm90.cu; the
    # default, also under unit_tc and unit_norm)
    "sm90": {"kernels": KernelChoices(fp8_sm90=True, **_FI), "max_step_tokens": 64},
    # ... with K in parts for weights of few rows (the test models' small weights: up to 16 parts)
    "sm90_split": {"kernels": KernelChoices(fp8_sm90=True, fp8_sm90_split=True, **_FI), "max_step_tokens": 64},
    # the defaults with the rows' LoRA shrink of qkv and gate_up on the wgmma product's consumer warps, before their
    # main loop (KernelChoices.fp8_sm90_shrink without fp8_sm90_shrink_producer)
    "sm90_shrink": {"kernels": KernelChoices(fp8_sm90_shrink=True, fp8_sm90_shrink_producer=False)},
}
WEIGHT_ONLY = {"own_bf16"}  # choices whose activations are not rounded through e4m3


@pytest.mark.parametrize("kv,gemm", [("auto", "cublaslt"), ("fp8", "cublaslt"), ("auto", "own"), ("auto", "unit"),
                                     ("fp8", "unit_tc"), pytest.param("auto", "unit_norm", marks=pytest.mark.xfail(
                                         strict=False, reason=(
                                             "H200, 2026-12-03: 1 of 48 flips at margin 0.061 against the bound "
                                             "0.056 (1.5x HF bf16's worst, 0.037); the path is off by default "
                                             "(docs/benchmarks.md 13.3)"))), ("fp8", "unit_norm"),
                                     pytest.param("auto", "own_bf16", marks=pytest.mark.xfail(strict=False, reason=(
                                         "H200, 2026-12-03: 12 / 14 flips of 48 (worst 0.051 / 0.042) against the "
                                         "weight-only reference, beyond its bound of 0.02 set by HF's bf16 run "
                                         "(2 / 4 flips); not yet explained, the path is off by default"))),
                                     ("auto", "sm90"), ("fp8", "sm90"), ("auto", "sm90_split"), ("auto", "default"),
                                     ("fp8", "default"), ("auto", "sm90_shrink"), ("fp8", "sm90_shrink")])
def test_fp8_engine_matches_the_fp32_fp8_reference_teacher_forced(fam, kv, gemm, request):
    """Each way of calling the FP8 tensor cores (GEMM_CHOICES) against the fp32 FP8 reference (its activations
    rounded through e4m3 per token, except for the weight-only choices)."""
    if gemm.startswith("sm90") and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel is built for compute capability 9.0 only")
    name, model, rounded, ads, reqs = fam
    if (name, kv, gemm) in (("llama3", "auto", "default"), ("llama3", "auto", "sm90_shrink")):
        # (phi3's case passes: H100, 2026-12-06)
        request.applymarker(pytest.mark.xfail(strict=False, reason=(
            "H100, 2026-12-06: llama3 13 of 48 flips (sm90, flashinfer's norms: 16), the worst at margin 0.061 "
            "against the bound 0.056 (1.5x HF bf16's worst, 0.037): the same flip as unit_norm's, whose norm this is")))
    fp8kv, acts = kv == "fp8", gemm not in WEIGHT_ONLY
    toks = reference_continuations(rounded, ads, reqs, fp8kv, acts)
    emulate = functools.partial(emulate_fp8, activations=acts, kv=fp8kv)
    eng = teacher.teacher_forced_check(model, ads, reqs, toks, "bfloat16", f"{name} fp8 kv={kv} gemm={gemm}",
                                       ref_model=rounded, emulate=emulate, quantization="fp8", kv_cache_dtype=kv,
                                       **GEMM_CHOICES[gemm])
    layer = eng.model.layers[0]
    assert isinstance(layer.qkv, Fp8Weight) and layer.qkv.q.dtype == E4M3 and layer.qkv.q.is_cuda
    assert (eng.kv.k.dtype == E4M3) == fp8kv
    assert eng.sgmv.name == "cuda"
    if gemm.startswith("sm90") or gemm == "unit":  # the choice was taken (needs sm_90a and CUTLASS in the build)
        assert eng.model.fp8_sm90 == (gemm != "unit")
    if gemm in ("default", "sm90_shrink"):  # the norms on the project's kernel
        assert eng.model.own_norm is not None
    if gemm == "sm90_shrink":  # the choice was taken: the counters of the shrink first
        assert eng.model.sm90_sync is not None


def test_fp8_pages_decode_on_the_lorafleet_kernel(fam):
    """FP8 weights and FP8 K/V pages with the project's decode attention kernel (csrc/decode_attn.cu): a decode step
    against flashinfer's decode kernel on the same pages, and its graph replay against its eager step."""
    name, model, _, _, reqs = fam
    eng = teacher.decode_kernel_vs_flashinfer(model, reqs[:4] * 2, f"{name} FP8 pages", quantization="fp8",
                                              kv_cache_dtype="fp8", kernels=KernelChoices(decode_kernel="lorafleet"))
    assert eng.kv.k.dtype == E4M3


def test_fp8_reference_is_not_the_bf16_model(fam):
    """The check above could not pass with the FP8 path switched off: the unrounded bf16 engine misses the
    FP8 reference at positions where its margin is large."""
    name, model, rounded, ads, reqs = fam
    toks = reference_continuations(rounded, ads, reqs, False)
    plain = HFReference(model, ads)
    base = [plain.greedy(ids, n, NEW) for ids, n, _ in reqs]
    assert base != toks, name


@pytest.mark.parametrize("kv,gemm", [("auto", "cublaslt"), ("fp8", "cublaslt"), ("auto", "own"), ("auto", "unit"),
                                     ("fp8", "unit"), ("fp8", "unit_tc"), ("auto", "unit_norm"), ("fp8", "unit_norm"),
                                     ("auto", "own_bf16"), ("auto", "sm90"), ("fp8", "sm90"), ("auto", "sm90_split"),
                                     ("auto", "default"), ("auto", "sm90_shrink"), ("fp8", "default")])
def test_fp8_decode_graph_replay_matches_the_eager_step(fam, kv, gemm):
    """(gemm "own": the project's FP8 kernel, its K-split workspace and counter memset captured in the graph;
    "unit": the unit scale made before the capture)"""
    name, model, _, _, reqs = fam
    kernels = {k: v for k, v in GEMM_CHOICES[gemm].items() if k == "kernels"}
    eng = teacher.decode_graph_vs_eager(model, reqs[:4] * 2, f"{name} fp8 kv={kv} gemm={gemm}", quantization="fp8",
                                        kv_cache_dtype=kv, **kernels)
    assert isinstance(eng.model.layers[0].qkv, Fp8Weight)


def test_fp8_weights_take_half_the_bytes(fam):
    """The projections held as e4m3 (one byte per weight plus one fp32 scale per row), embeddings and lm_head in
    bf16 as before."""
    name, model, _, _, _ = fam
    bf16 = Engine(str(model), EngineConfig(max_lora_rank=16, num_pages=64, cuda_graphs=False))
    fp8 = Engine(str(model), EngineConfig(max_lora_rank=16, num_pages=64, cuda_graphs=False, quantization="fp8"))
    try:
        lb, lf = bf16.model.layers[0], fp8.model.layers[0]
        for attr in ("qkv", "o", "gate_up", "down"):
            wb, wf = getattr(lb, attr), getattr(lf, attr)
            assert wf.q.numel() * wf.q.element_size() * 2 == wb.numel() * wb.element_size(), (name, attr)
            torch.testing.assert_close(wf.dequant(torch.float32), wb.float(), rtol=0.07, atol=1e-6)
        assert fp8.model.embed.dtype == torch.bfloat16 and fp8.model.lm_head.dtype == torch.bfloat16
    finally:
        bf16.close()
        fp8.close()


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_fp8_epilogue_step_gives_the_bits_of_the_separate_launches(fam, kv):
    """A decode step of 24 rows (no adapter, a rank-16 adapter on every projection, a rank-4 one on the MLP only)
    with the epilogue kernel finishing every projection (counted) and with the separate launches: the same logits,
    bit for bit. (Every shrink a launch of its own, as the separate launches have it: the shrink first sums K in
    another order, test_fp8_shrink_first_takes_the_shrink_launches_of_qkv_and_gate_up.)"""
    name, model, _, _, reqs = fam
    eng, batch = teacher.decode_step(model, reqs[:4] * 2, quantization="fp8", kv_cache_dtype=kv,
                                     kernels=KernelChoices(fp8_sm90_shrink=False))
    dev = batch.to_device(eng.device)
    m = eng.model
    assert m.fp8_epilogue and m.fp8_ext is not None
    ext, m.fp8_ext = m.fp8_ext, _CountingExt(m.fp8_ext)
    try:
        fused = eng.runner.forward(batch, dev).clone()
        assert m.fp8_ext.epilogues == 4 * m.num_layers, name
        m.fp8_quant_in_shrink = False  # the activations quantized by their own launch
        own_quant = eng.runner.forward(batch, dev).clone()
        assert m.fp8_ext.epilogues == 8 * m.num_layers
        m.fp8_epilogue = False
        separate = eng.runner.forward(batch, dev).clone()
        assert m.fp8_ext.epilogues == 8 * m.num_layers
    finally:
        m.fp8_ext, m.fp8_epilogue, m.fp8_quant_in_shrink = ext, True, True
        eng.close()
    assert torch.equal(fused, own_quant), (fused - own_quant).abs().max().item()
    assert torch.equal(fused, separate), (fused - separate).abs().max().item()


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_fp8_step_takes_the_wgmma_product_on_every_projection(fam, kv):
    """With the default kernel choices on a compute capability 9.0 GPU, every FP8 projection of a decode step (with
    adapters) runs its product on the wgmma kernel (counted: none falls back to cuBLASLt on its operands' sizes or
    alignment), and the step's logits are those of the same step on cuBLASLt's product up to the two products'
    accumulation roundings, amplified by the layers' e4m3 re-quantization."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel is built for compute capability 9.0 only")
    name, model, _, _, reqs = fam
    eng, batch = teacher.decode_step(model, reqs[:4] * 2, quantization="fp8", kv_cache_dtype=kv)
    dev = batch.to_device(eng.device)
    m = eng.model
    assert m.fp8_sm90, "the default build should hold the wgmma kernel (CUTLASS's headers from flashinfer)"
    ext, m.fp8_ext = m.fp8_ext, _CountingExt(m.fp8_ext)
    try:
        wgmma = eng.runner.forward(batch, dev).float().clone()
        assert m.fp8_ext.sm90 == 4 * m.num_layers, (name, m.fp8_ext.sm90)
        m.fp8_sm90 = False
        cublaslt = eng.runner.forward(batch, dev).float().clone()
        assert m.fp8_ext.sm90 == 4 * m.num_layers
    finally:
        m.fp8_ext, m.fp8_sm90 = ext, True
        eng.close()
    # A sanity bound, not the accuracy check (the teacher-forced tests above take the wgmma product against HF + PEFT
    # fp32): the two products' fp32 sums differ in their last bits, and each layer re-quantizes its activations to
    # e4m3, where a rounding that flips moves a value by up to 1/16; through the model's layers that leaves the
    # random-weight steps' logits up to ~6 % of their range apart (max 0.54 of 9.3 measured on the H200).
    rel = ((wgmma - cublaslt).norm() / cublaslt.norm()).item()
    assert rel <= 0.15, (name, rel)
    assert torch.corrcoef(torch.stack([wgmma.flatten(), cublaslt.flatten()]))[0, 1].item() >= 0.98, name


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_fp8_gate_up_epilogue_with_the_activation_gives_the_same_step(fam, kv):
    """The decode step of the test above with the gate_up epilogue applying the activation too
    (KernelChoices.fp8_epilogue_act: no act_and_mul launch) and without: the same logits, bit for bit; every
    projection still finished by an epilogue launch (counted)."""
    name, model, _, _, reqs = fam
    eng, batch = teacher.decode_step(model, reqs[:4] * 2, quantization="fp8", kv_cache_dtype=kv)
    dev = batch.to_device(eng.device)
    m = eng.model
    assert m.fp8_epilogue_act and m.ops.name == "flashinfer"  # on by default
    ext, m.fp8_ext = m.fp8_ext, _CountingExt(m.fp8_ext)
    try:
        m.fp8_epilogue_act = False
        plain = eng.runner.forward(batch, dev).clone()
        assert m.fp8_ext.with_act == 0
        m.fp8_epilogue_act = True
        fused = eng.runner.forward(batch, dev).clone()
        assert m.fp8_ext.epilogues == 8 * m.num_layers, name
        assert m.fp8_ext.with_act == m.num_layers  # every gate_up epilogue took the activation (SiLU here)
    finally:
        m.fp8_ext, m.fp8_epilogue_act = ext, True
        eng.close()
    assert torch.equal(fused, plain), (fused - plain).abs().max().item()


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_fp8_epilogue_inside_the_wgmma_product_gives_the_same_step(fam, kv):
    """The decode step (with adapters) at the defaults (fp8_sm90_fused: the epilogue inside the wgmma product only
    without a LoRA expand, so none here) and with the two launches everywhere (fp8_sm90_fused off): the same logits,
    bit for bit (every shrink a launch of its own: fp8_sm90_shrink off); then a step without adapters, whose qkv, o
    and down take the product with the epilogue inside by default (counted, 3 per layer; gate_up keeps its own
    epilogue for the activation), against the two launches."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel is built for compute capability 9.0 only")
    if {"LORAFLEET_FP8_SM90", "LORAFLEET_FP8_SM90_FUSED"} & set(os.environ):
        pytest.skip("this test starts from the default kernel choices")
    name, model, _, _, reqs = fam
    eng, batch = teacher.decode_step(model, reqs[:4] * 2, quantization="fp8", kv_cache_dtype=kv,
                                     kernels=KernelChoices(fp8_sm90_shrink=False))
    dev = batch.to_device(eng.device)
    m = eng.model
    assert m.fp8_sm90 and m.fp8_sm90_fused  # the defaults
    ext, m.fp8_ext = m.fp8_ext, _CountingExt(m.fp8_ext)
    try:
        default = eng.runner.forward(batch, dev).clone()
        assert m.fp8_ext.fused == 0 and m.fp8_ext.epilogues == 4 * m.num_layers, name
        m.fp8_sm90_fused = False
        plain = eng.runner.forward(batch, dev).clone()
        assert m.fp8_ext.fused == 0 and m.fp8_ext.epilogues == 8 * m.num_layers
    finally:
        m.fp8_ext, m.fp8_sm90_fused = ext, True
        eng.close()
    assert torch.equal(default, plain), (default - plain).abs().max().item()
    # a step without adapters: the default takes the product with the epilogue inside on qkv, o and down
    eng, batch = teacher.decode_step(model, [(ids, None, None) for ids, _, _ in reqs[:4]] * 2, quantization="fp8",
                                     kv_cache_dtype=kv)
    dev = batch.to_device(eng.device)
    m = eng.model
    ext, m.fp8_ext = m.fp8_ext, _CountingExt(m.fp8_ext)
    try:
        default = eng.runner.forward(batch, dev).clone()
        assert m.fp8_ext.fused == 3 * m.num_layers, (name, m.fp8_ext.fused)
        m.fp8_sm90_fused = False
        plain = eng.runner.forward(batch, dev).clone()
        assert m.fp8_ext.fused == 3 * m.num_layers
    finally:
        m.fp8_ext, m.fp8_sm90_fused = ext, True
        eng.close()
    assert torch.equal(default, plain), (default - plain).abs().max().item()


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_fp8_shrink_first_takes_the_shrink_launches_of_qkv_and_gate_up(fam, kv):
    """KernelChoices.fp8_sm90_shrink: in a decode step with adapters, the products of qkv and gate_up, whose rows the
    norm quantizes, compute the rows' shrink on their own warps (counted: two a layer but the step's first, whose row
    slots are made right before it), with the expand in the FP8 epilogue's launch as before; the logits within the
    shrink's fp32 reordering of the default step's (the shrink's launch sums K in another order), and a second step
    the same bits as the first (the counters left zero). With KernelChoices.fp8_sm90_shrink_producer (the producer warp
    group's warps take the tickets, beside the main loop) o and down take it too (their rows quantized by the
    activation kernel's launch): every group's product but the step's first, the logits within the same reordering of
    the launched shrinks' (qkv and gate_up's shrinks the same bits either way)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel is built for compute capability 9.0 only")
    if {"LORAFLEET_FP8_SM90", "LORAFLEET_FP8_SM90_SHRINK", "LORAFLEET_FP8_SM90_SHRINK_PRODUCER",
            "LORAFLEET_FP8_SM90_PERSISTENT", "LORAFLEET_NORM_QUANT"} & set(os.environ):
        pytest.skip("this test starts from the default kernel choices")
    name, model, _, _, reqs = fam
    eng, batch = teacher.decode_step(model, reqs[:4] * 2, quantization="fp8", kv_cache_dtype=kv,
                                     kernels=KernelChoices(fp8_sm90_shrink=True, fp8_sm90_shrink_producer=False))
    dev = batch.to_device(eng.device)
    m = eng.model
    assert m.sm90_sync is not None and m.own_norm is not None
    sync, ext, m.fp8_ext = m.sm90_sync, m.fp8_ext, _CountingExt(m.fp8_ext)
    try:
        first = eng.runner.forward(batch, dev).clone()
        assert m.fp8_ext.shrink_first == 2 * m.num_layers - 1, (name, m.fp8_ext.shrink_first)
        assert not sync.any()
        assert torch.equal(eng.runner.forward(batch, dev), first), name
        m.fp8_sm90_shrink_producer = True
        producer = eng.runner.forward(batch, dev).clone()
        assert m.fp8_ext.shrink_first == 2 * (2 * m.num_layers - 1) + 4 * m.num_layers - 1, name
        assert m.fp8_ext.producer == 4 * m.num_layers - 1 and not sync.any(), (name, m.fp8_ext.producer)
        assert torch.equal(eng.runner.forward(batch, dev), producer), name
        m.fp8_sm90_shrink_producer = False
        m.sm90_sync = None  # every shrink a launch of its own (the default), the same engine and step
        launched = eng.runner.forward(batch, dev).clone()
        assert m.fp8_ext.shrink_first == 2 * (2 * m.num_layers - 1) + 2 * (4 * m.num_layers - 1), name
    finally:
        m.fp8_ext, m.sm90_sync, m.fp8_sm90_shrink_producer = ext, sync, False
        eng.close()
    for got in (first, producer):
        diff = (got.float() - launched.float()).abs().max().item()
        assert diff <= 0.05 * launched.float().abs().max().item(), (name, diff)


def test_fp8_persistent_wgmma_schedule_gives_the_same_step(fam):
    """The decode step with adapters (every projection's product on the wgmma kernel, its epilogue a launch of its
    own) and without them (gate_up's product; qkv, o and down with the epilogue inside, which keeps one CTA per
    tile) with KernelChoices.fp8_sm90_persistent on and off: the same logits, bit for bit (every shrink a launch of
    its own: the shrink first takes one CTA a tile, so the persistent schedule launches it)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma kernel is built for compute capability 9.0 only")
    if {"LORAFLEET_FP8_SM90", "LORAFLEET_FP8_SM90_PERSISTENT", "LORAFLEET_FP8_SM90_FUSED",
            "LORAFLEET_FP8_SM90_SPLIT", "LORAFLEET_FP8_EPILOGUE",
            "LORAFLEET_FP8_EPILOGUE_ACT"} & set(os.environ):
        pytest.skip("this test starts from the default kernel choices")
    name, model, _, _, reqs = fam
    for rows in (reqs[:4] * 2, [(ids, None, None) for ids, _, _ in reqs[:4]] * 2):
        eng, batch = teacher.decode_step(model, rows, quantization="fp8", kernels=KernelChoices(fp8_sm90_shrink=False))
        dev = batch.to_device(eng.device)
        m = eng.model
        # the defaults the counts below rest on: qkv, o and down with the epilogue inside when no LoRA expand rides,
        # gate_up's epilogue a launch of its own (the activation, flashinfer's ops)
        assert m.fp8_sm90 and not m.fp8_sm90_persistent and m.fp8_sm90_fused
        assert not m.fp8_sm90_split and m.fp8_epilogue and m.fp8_epilogue_act and m.ops.name == "flashinfer"
        adapted = any(r[1] is not None for r in rows)
        ext, m.fp8_ext = m.fp8_ext, _CountingExt(m.fp8_ext)
        try:
            plain = eng.runner.forward(batch, dev).clone()
            assert m.fp8_ext.persistent == 0
            m.fp8_sm90_persistent = True
            pers = eng.runner.forward(batch, dev).clone()
            # with adapters all four projections' products, without them gate_up's alone
            assert m.fp8_ext.persistent == (4 if adapted else 1) * m.num_layers, (name, m.fp8_ext.persistent)
        finally:
            m.fp8_ext, m.fp8_sm90_persistent = ext, False
            eng.close()
        assert torch.equal(pers, plain), (name, (pers - plain).abs().max().item())


def test_fp8_norm_that_quantizes_takes_the_activation_launches_of_qkv_and_gate_up(fam, monkeypatch):
    """KernelChoices.norm_quant (the default): the norms before qkv and gate_up on the project's kernel, which writes the rows' e4m3
    copy, against the same norms leaving the quantization to the product's own launch (the activation kernel without
    adapters, the shrink with them): the decode step's logits bit for bit, eager; without adapters the activation
    kernel then runs for o's and down's inputs only (2 launches per layer against 4), with adapters never, and the
    shrinks quantize o's and down's inputs only (2 per layer against 4). The choice
    is taken only with FP8 weights. (Against the default flashinfer norm the logits differ by more than bf16 noise:
    its roundings are not Hugging Face's, and e4m3 steps magnify a rounding; the teacher-forced test above checks the
    path against the fp32 reference instead.) Every shrink a launch of its own (fp8_sm90_shrink off), whose
    quantization is counted."""
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    shrink_quant = []  # per shrink launch: whether it quantized its input too
    real = CudaSGMV.shrink

    def shrink(self, *args, **kw):
        shrink_quant.append(kw.get("quant") is not None)
        return real(self, *args, **kw)

    monkeypatch.setattr(CudaSGMV, "shrink", shrink)
    name, model, _, _, reqs = fam
    for rows in (reqs[:4] * 2, [(ids, None, None) for ids, _, _ in reqs[:4]] * 2):
        eng, batch = teacher.decode_step(model, rows, quantization="fp8", kernels=KernelChoices(fp8_sm90_shrink=False))
        dev = batch.to_device(eng.device)
        m = eng.model
        assert m.own_norm is not None and m.fp8_epilogue and m.own_norm_quant  # the defaults
        adapted = any(r[1] is not None for r in rows)
        ext, m.fp8_ext = m.fp8_ext, _CountingExt(m.fp8_ext)
        try:
            m.own_norm_quant = False
            shrink_quant.clear()
            apart = eng.runner.forward(batch, dev).clone()
            apart_q, apart_s, m.fp8_ext.quantized = m.fp8_ext.quantized, sum(shrink_quant), 0
            m.own_norm_quant = True
            shrink_quant.clear()
            inside = eng.runner.forward(batch, dev).clone()
        finally:
            inside_q, m.fp8_ext, m.own_norm_quant = m.fp8_ext.quantized, ext, True
            eng.close()
        inside_s, L = sum(shrink_quant), m.num_layers
        assert (apart_q, inside_q) == ((0, 0) if adapted else (4 * L, 2 * L)), (name, adapted)
        assert (apart_s, inside_s) == ((4 * L, 2 * L) if adapted else (0, 0)), (name, adapted)
        assert torch.equal(inside, apart), (name, adapted, (inside - apart).abs().max().item())
    off = Engine(str(model), EngineConfig(max_lora_rank=16, num_pages=64, cuda_graphs=False, quantization="fp8",
                                          kernels=KernelChoices(norm_quant=False)))
    try:
        assert off.model.own_norm is None  # the choice off: flashinfer's norms
    finally:
        off.close()
    # bf16 weights, nothing to quantize: norm_quant alone makes no norm of the project's (the early norm, on by
    # default for bf16's wgmma products, would)
    bf16 = Engine(str(model), EngineConfig(max_lora_rank=16, num_pages=64, cuda_graphs=False,
                                           kernels=KernelChoices(norm_early=False)))
    try:
        assert bf16.model.own_norm is None
    finally:
        bf16.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,K", [(1, 4096), (24, 4096), (37, 11008), (64, 512), (3, 8200), (5, 28672)])
def test_shrink_quantizes_its_input_as_the_activation_kernel_does(dtype, T, K):
    """The LoRA shrink asked to quantize x (runner/lora/sgmv_cuda.py, `quant`): v unchanged, the e4m3 rows and
    scales bit for bit those of quantize_tokens, for every row (adapted or not), whatever the grid."""
    from lorafleet.runner.kernels import load
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV
    from lorafleet.runner.model.fp8 import quantize_tokens

    g = torch.Generator(device="cuda").manual_seed(T)
    x = (torch.randn(T, K, device="cuda", generator=g) * 2).to(dtype)
    if T > 2:
        x[1] = 0
    S, R = 4, 16
    a = [(torch.randn(S, R, K, device="cuda", generator=g) * 0.05).to(dtype) for _ in range(3)]
    ranks = torch.tensor([[16, 4, 0, 1]] * 3, dtype=torch.int32, device="cuda")
    seg = build_segments([(i % 5) - 1 for i in range(T)], "cuda", capacity=64)  # slot -1 rows too
    sgmv = CudaSGMV()
    v_plain = torch.zeros(T, 3, R, device="cuda")
    sgmv.shrink(v_plain, x, a, ranks, None, seg, mma_min_rows=1 << 30)
    want_q, want_s = quantize_tokens(x, load())
    for max_blocks in (0, 1, 3):  # the launcher's grid, then blocks that quantize several rows each
        v = torch.zeros(T, 3, R, device="cuda")
        q = torch.empty(T, K, dtype=E4M3, device="cuda")
        sc = torch.empty(T, device="cuda")
        sgmv.shrink(v, x, a, ranks, None, seg, mma_min_rows=1 << 30, quant=(q, sc), max_blocks=max_blocks)
        torch.cuda.synchronize()
        assert torch.equal(v, v_plain), max_blocks
        assert torch.equal(sc, want_s.view(-1)), max_blocks
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)), max_blocks


def test_fp8_pages_written_by_rope_kv_give_the_torch_writers_step(fam):
    """FP8 K/V pages written by the rope_kv kernel (KernelChoices.rope_kv_fp8) against the torch K/V writer (RoPE,
    the e4m3 cast, index copies): a decode step of 24 rows gives the same logits, bit for bit."""
    from lorafleet.runner.model.rope_kv import FusedKvWriter, TorchKvWriter, make_kv_writer

    name, model, _, _, reqs = fam
    eng, batch = teacher.decode_step(model, reqs[:4] * 2, quantization="fp8", kv_cache_dtype="fp8")
    dev = batch.to_device(eng.device)
    m = eng.model
    try:
        default = m.kv_write  # the fused writer where it applies (KernelChoices.rope_kv_fp8 on by default)
        m.attach_kv(TorchKvWriter(m, eng.kv.flat))
        plain = eng.runner.forward(batch, dev).clone()
        fused = make_kv_writer(m, eng.kv.flat, True, True, eng.config.kernels.rope_kv_pdl)  # (as the engine's)
        assert type(default) is type(fused), name
        if not isinstance(fused, FusedKvWriter):
            pytest.skip(f"{name}: the fused K/V writer does not apply to this model")
        m.attach_kv(fused)
        got = eng.runner.forward(batch, dev).clone()
    finally:
        eng.close()
    assert torch.equal(got, plain), (got - plain).abs().max().item()

"""The project's decode attention kernel (csrc/decode_attn.cu) against an fp64 reference, on a CUDA GPU.

Pages are random bf16 / fp16 or e4m3 rows behind shuffled page tables; the reference gathers each request's keys in
fp64 and applies the same window and soft-cap. Bits must not depend on the launch's shape (workers per request, the
other requests of the launch, how far ahead the K/V rows are copied: stages) and a CUDA graph's replay gives the eager
launch's bits.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
E4M3 = torch.float8_e4m3fn
CHUNK, MAX_CHUNKS = 256, 16
# lengths around the chunk edges, several chunks, and past MAX_CHUNKS chunks of CHUNK (longer chunks then)
LENS = [1, 15, 16, 17, 255, 256, 257, 700, 4097, 5000]


def ext():
    from lorafleet.runner.kernels import load

    return load()


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


class Case:
    """Random pages [pages, page_size, Hkv, D] and one query row per request; page tables of shuffled pages."""

    def __init__(self, lens, hkv, group, D, dtype, kv_dtype, page_size=16, seed=0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.lens, self.hkv, self.h, self.D, self.ps = list(lens), hkv, hkv * group, D, page_size
        used = [-(-n // page_size) for n in self.lens]
        self.num_pages = sum(used) + 3
        perm = torch.randperm(self.num_pages, generator=g, device=DEV).tolist()
        self.tables, at = [], 0
        for u in used:
            self.tables.append(perm[at: at + u])
            at += u
        shape = (self.num_pages, page_size, hkv, D)
        self.k = torch.randn(shape, generator=g, device=DEV).to(dtype).to(kv_dtype)
        self.v = torch.randn(shape, generator=g, device=DEV).to(dtype).to(kv_dtype)
        self.q = torch.randn(len(self.lens), self.h, D, generator=g, device=DEV).to(dtype)

    def arrays(self, tables=None, lens=None):
        from lorafleet.runner.executor.attention.flashinfer_backend import page_table_arrays

        arrays = page_table_arrays(self.tables if tables is None else tables, self.lens if lens is None else lens,
                                   self.ps)
        return [a.to(DEV) for a in arrays]

    def run(self, q=None, tables=None, lens=None, workers=1, sm_scale=None, cap=0.0, window_left=-1, ws_rows=None,
            chunk=CHUNK, max_chunks=MAX_CHUNKS, stages=0, pdl=False, int_convert=False, mma=False):
        q = self.q if q is None else q
        B = q.shape[0]
        indptr, indices, last = self.arrays(tables, lens)
        rows = ws_rows or B
        self.partial_o = torch.full((rows * self.h * max_chunks * self.D,), float("nan"), device=DEV)
        self.partial_ml = torch.full((rows * self.h * max_chunks * 2,), float("nan"), device=DEV)
        self.counters = torch.zeros(rows * self.hkv, dtype=torch.int32, device=DEV)
        out = torch.full_like(q, float("nan"))
        scale = 1 / math.sqrt(self.D) if sm_scale is None else sm_scale
        ext().decode_attention(out, q, self.k, self.v, indptr, indices, last, self.partial_o, self.partial_ml,
                               self.counters, scale, cap, window_left, chunk, max_chunks, workers, stream(), stages,
                               pdl, int_convert, mma)
        torch.cuda.synchronize()
        return out

    def rows(self, pages: torch.Tensor, b: int) -> torch.Tensor:
        """Request b's K or V rows in fp64 [L, Hkv, D]."""
        n, ps = self.lens[b], self.ps
        t = torch.arange(n, device=DEV)
        slots = torch.tensor(self.tables[b], device=DEV, dtype=torch.int64)[t // ps] * ps + t % ps
        flat = pages.view(-1, self.hkv, self.D)
        if pages.dtype == E4M3:
            return flat.view(torch.uint8)[slots].view(E4M3).double()
        return flat[slots].double()

    def reference(self, sm_scale=None, cap=0.0, window_left=-1) -> torch.Tensor:
        scale = 1 / math.sqrt(self.D) if sm_scale is None else sm_scale
        grp = self.h // self.hkv
        out = torch.zeros(len(self.lens), self.h, self.D, dtype=torch.float64, device=DEV)
        for b, n in enumerate(self.lens):
            if n == 0:
                continue
            start = max(0, n - 1 - window_left) if window_left >= 0 else 0
            k, v = self.rows(self.k, b)[start:], self.rows(self.v, b)[start:]
            q = self.q[b].double().view(self.hkv, grp, self.D)
            s = torch.einsum("hgd,lhd->hgl", q, k) * scale
            if cap > 0:
                s = torch.tanh(s / cap) * cap
            out[b] = torch.einsum("hgl,lhd->hgd", s.softmax(-1), v).reshape(self.h, self.D)
        return out


def assert_close(got: torch.Tensor, want: torch.Tensor, vmax: float, label: str, atol: float = 1e-4):
    """Within one rounding step of the output type (twice its round-to-nearest error) of the fp64 value, plus fp32
    accumulation noise (`atol` of the largest |v|)."""
    rtol = 2.0 ** -8 if got.dtype == torch.bfloat16 else 2.0 ** -10
    err = (got.double() - want).abs()
    bound = rtol * want.abs() + atol * vmax
    worst = (err - bound).max().item()
    assert torch.isfinite(got).all(), label
    assert worst <= 0, f"{label}: max |err| {err.max().item():.3g} exceeds the bound by {worst:.3g}"


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 7, 8])
@pytest.mark.parametrize("kv", ["same", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_attention_matches_fp64(D, group, kv, dtype):
    c = Case(LENS, 2, group, D, dtype, E4M3 if kv == "e4m3" else dtype, seed=D + group)
    got = c.run(workers=3)
    assert_close(got, c.reference(), c.v.float().abs().max().item(), f"D={D} group={group} kv={kv} {dtype}")
    assert int(c.counters.abs().sum()) == 0  # every launch leaves its counters zero


@pytest.mark.parametrize("window_left", [-1, 0, 40, 300, 3000])
@pytest.mark.parametrize("cap", [0.0, 5.0])
@pytest.mark.parametrize("kv", ["same", "e4m3"])
def test_window_and_soft_cap(window_left, cap, kv):
    c = Case(LENS, 2, 4, 128, torch.bfloat16, E4M3 if kv == "e4m3" else torch.bfloat16, seed=3)
    got = c.run(workers=2, sm_scale=0.3, cap=cap, window_left=window_left)
    want = c.reference(sm_scale=0.3, cap=cap, window_left=window_left)
    assert_close(got, want, c.v.float().abs().max().item(), f"window_left={window_left} cap={cap} kv={kv}")


@pytest.mark.parametrize("page_size", [1, 5, 16, 64])
def test_page_sizes(page_size):
    c = Case([1, 7, 64, 300, 1025], 4, 2, 128, torch.bfloat16, E4M3, page_size=page_size, seed=page_size)
    assert_close(c.run(workers=4), c.reference(), c.v.float().abs().max().item(), f"page_size={page_size}")


def test_bits_depend_on_nothing_but_the_request():
    """The same request alone, among others, at another position, and with 1 to 16 workers: the same bits."""
    c = Case(LENS, 2, 4, 128, torch.bfloat16, E4M3, seed=11)
    base = c.run(workers=1)
    for w in (2, 5, 16, 40):
        assert torch.equal(c.run(workers=w), base), f"workers={w}"
    for b in (0, 4, 7, 9):  # alone, in a launch of one row, and with a larger workspace than needed
        alone = c.run(q=c.q[b: b + 1].contiguous(), tables=[c.tables[b]], lens=[c.lens[b]], workers=3, ws_rows=7)
        assert torch.equal(alone[0], base[b]), f"request {b}"
    order = [9, 3, 0, 8, 5, 1, 7, 2, 6, 4]  # the launch's rows permuted
    perm = c.run(q=c.q[order].contiguous(), tables=[c.tables[i] for i in order], lens=[c.lens[i] for i in order],
                 workers=2)
    assert torch.equal(perm, base[order])


@pytest.mark.parametrize("stages", [3, 5])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("kv", ["same", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_staged_copies_give_the_register_versions_bits(stages, D, kv, dtype):
    """K/V rows copied `stages` - 1 passes ahead through shared memory: the bits of the rows loaded one pass ahead into
    registers, with 1 to 16 workers, and within the fp64 bound; with grouped heads (the register version runs) too."""
    for group in (1, 2):
        c = Case(LENS, 3, group, D, dtype, E4M3 if kv == "e4m3" else dtype, seed=D + 7 * group)
        want = c.run(workers=1)
        assert_close(want, c.reference(), c.v.float().abs().max().item(), f"D={D} group={group} kv={kv}")
        for w in (1, 2, 16):
            assert torch.equal(c.run(workers=w, stages=stages), want), f"group={group} workers={w}"
            assert int(c.counters.abs().sum()) == 0
            if kv == "e4m3" and stages == 3 and group == 1:  # the bytes to fp32 by integer ops: the same values
                assert torch.equal(c.run(workers=w, stages=3, pdl=w == 2, int_convert=True), want), f"ic workers={w}"


def test_integer_conversion_reads_every_e4m3_code_as_the_cvt_does():
    """Pages holding each of the 254 non-NaN e4m3 codes (subnormals, +-0, +-448) in K and V: the staged launch that
    converts bytes by integer ops gives the register version's bits; refused where it does not apply."""
    c = Case([300, 17, 64], 2, 1, 128, torch.bfloat16, E4M3, seed=11)
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(3)
    for pages in (c.k, c.v):
        flat = pages.view(torch.uint8).view(-1)
        flat.copy_(codes[torch.randint(0, codes.numel(), (flat.numel(),), generator=g, device=DEV)])
    c.k.view(torch.uint8).view(-1)[: codes.numel()] = codes  # every code at least once
    c.v.view(torch.uint8).view(-1)[: codes.numel()] = codes
    want = c.run(workers=1)  # (the register version; its fp64 bounds are the other tests')
    assert torch.isfinite(want).all()
    assert torch.equal(c.run(workers=2, stages=3, pdl=True, int_convert=True), want)
    with pytest.raises(RuntimeError, match="integer conversion takes e4m3 pages, stages 3"):
        c.run(stages=5, int_convert=True)
    b = Case([40], 2, 1, 64, torch.bfloat16, torch.bfloat16, seed=1)
    with pytest.raises(RuntimeError, match="integer conversion takes e4m3 pages, stages 3"):
        b.run(stages=3, int_convert=True)


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_staged_copies_with_windows_caps_and_page_sizes(page_size):
    c = Case([1, 7, 64, 300, 1025, 4100], 2, 1, 128, torch.bfloat16, E4M3, page_size=page_size, seed=40 + page_size)
    for window_left, cap in ((-1, 0.0), (40, 5.0), (3000, 0.0)):
        want = c.run(workers=2, sm_scale=0.3, cap=cap, window_left=window_left)
        for stages in (3, 5):
            got = c.run(workers=2, sm_scale=0.3, cap=cap, window_left=window_left, stages=stages)
            assert torch.equal(got, want), f"page_size={page_size} window_left={window_left} stages={stages}"
        ref = c.reference(sm_scale=0.3, cap=cap, window_left=window_left)
        assert_close(want, ref, c.v.float().abs().max().item(), f"page_size={page_size} window_left={window_left}")


@pytest.mark.parametrize("stages", [3, 5])
def test_programmatic_launches_back_to_back_give_the_plain_launchs_bits(stages):
    """Launches with pdl=True one right after another on one workspace (each may start while the one before still
    merges its chunks, and must wait before it touches q, the pages, the partials or the counters): every output is
    the plain launch's, the counters end zero; a request without keys among them gets zeros."""
    c = Case([0, 1, 700, 4097, 5000, 256, 17], 2, 1, 128, torch.bfloat16, E4M3, seed=23)
    want = c.run(workers=3)
    B = len(c.lens)
    indptr, indices, last = c.arrays()
    po = torch.empty(B * c.h * MAX_CHUNKS * c.D, device=DEV)
    pml = torch.empty(B * c.h * MAX_CHUNKS * 2, device=DEV)
    counters = torch.zeros(B * c.hkv, dtype=torch.int32, device=DEV)
    outs = [torch.full_like(c.q, float("nan")) for _ in range(6)]
    for i, out in enumerate(outs):
        ext().decode_attention(out, c.q, c.k, c.v, indptr, indices, last, po, pml, counters, 1 / math.sqrt(c.D), 0.0,
                               -1, CHUNK, MAX_CHUNKS, 1 + i % 3, stream(), stages, True)
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert torch.equal(out, want), f"launch {i}"
    assert torch.equal(want[0], torch.zeros_like(want[0]))
    assert int(counters.abs().sum()) == 0


def assert_graph_replay_gives_the_eager_bits(c: Case, stages: int, mma: bool = False):
    """A captured launch over fixed table buffers, refilled with another step's tables before each replay (with
    stages, a programmatic launch, as the engine makes it), against the eager launch of the CUDA-core register version
    (or, with `mma`, of the tensor-core kernel)."""
    B, max_pages = len(c.lens), c.num_pages
    indptr = torch.zeros(B + 1, dtype=torch.int32, device=DEV)
    indices = torch.zeros(max_pages, dtype=torch.int32, device=DEV)
    last = torch.ones(B, dtype=torch.int32, device=DEV)
    po = torch.empty(B * c.h * MAX_CHUNKS * c.D, device=DEV)
    pml = torch.empty(B * c.h * MAX_CHUNKS * 2, device=DEV)
    counters = torch.zeros(B * c.hkv, dtype=torch.int32, device=DEV)
    q = c.q.clone()
    out = torch.empty_like(q)

    def launch():
        ext().decode_attention(out, q, c.k, c.v, indptr, indices, last, po, pml, counters, 0.1, 0.0, -1, CHUNK,
                               MAX_CHUNKS, 16, torch.cuda.current_stream().cuda_stream, stages, stages > 0, False, mma)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        launch()  # load the kernel outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for step, lens in enumerate(([1] * B, LENS, [300, 17, 1, 4097, 16, 256, 5000, 2, 700, 255])):
        lens = [min(n, len(t) * c.ps) for n, t in zip(lens, c.tables)]
        ip, ix, la = c.arrays(lens=lens)
        indptr.copy_(ip)
        indices[: ix.numel()].copy_(ix)
        last.copy_(la)
        graph.replay()
        torch.cuda.synchronize()
        want = c.run(lens=lens, sm_scale=0.1, workers=1, **({"stages": 3, "mma": True} if mma else {}))
        assert torch.equal(out, want), f"replay {step}"
        assert int(counters.abs().sum()) == 0


@pytest.mark.parametrize("stages", [0, 5])
def test_graph_replay_gives_the_eager_bits(stages):
    """The CUDA-core kernel's replay (grouped heads without stages; one query head per K/V head with 5)."""
    assert_graph_replay_gives_the_eager_bits(Case(LENS, 2, 8 if stages == 0 else 1, 128, torch.bfloat16, E4M3,
                                                  seed=5), stages)


# The tensor-core kernel (tensor_cores=True: e4m3 pages, stages 3) rounds the probabilities to f16 before p v and sums
# the rounded values, so its output is a convex combination of the V rows with each weight within ~2^-10 of its own:
# the output moves by the weights' errors times |v - out|, at worst (every rounding one way) 2^-9 of the largest |v|,
# typically far less (the roundings average out over the rows). The bound's absolute part is 2^-10 of the largest |v|;
# its mean error is held tighter, and q = 0 (every weight exactly 1) pins it to the rows' mean to the output's rounding.
MMA_ATOL = 2.0 ** -10 + 1e-4


def assert_mma_close(got, want, vmax, label):
    assert_close(got, want, vmax, label, atol=MMA_ATOL)
    mean = (got.double() - want).abs().mean().item()
    assert mean <= 2.0 ** -12 * vmax + 2.0 ** -9 * want.abs().mean().item(), f"{label}: mean |err| {mean:.3g}"


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 7, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_kernel_matches_fp64(D, group, dtype):
    """q . k and p v on the tensor cores over e4m3 pages, 1 to 8 query heads per K/V head, the chunk edges, several
    chunks and longer ones, 3 workers: within the bound above of the fp64 reference, counters left zero."""
    c = Case(LENS, 2, group, D, dtype, E4M3, seed=D + group)
    got = c.run(workers=3, stages=3, mma=True, pdl=group % 2 == 0)
    assert_mma_close(got, c.reference(), c.v.float().abs().max().item(), f"D={D} group={group} {dtype}")
    assert int(c.counters.abs().sum()) == 0


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_kernel_with_zero_queries_gives_the_rows_mean(D, dtype):
    """q = 0: every probability is exactly 1 and the e4m3 rows' sums are exact in fp32, so each output is the mean of
    its request's V rows (over its window) to the output's rounding: a token dropped, read twice or from the wrong page
    or dims would show. Windows 0 / 40 and every length of LENS, 2 and 7 workers."""
    c = Case(LENS, 2, 4, D, dtype, E4M3, seed=70 + D)
    c.q = torch.zeros_like(c.q)
    half_ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for window_left, workers in ((-1, 2), (40, 7), (0, 2)):
        got = c.run(workers=workers, stages=3, mma=True, window_left=window_left)
        want = c.reference(window_left=window_left)
        err = (got.double() - want).abs()
        bound = half_ulp * (1 + 2.0 ** -10) * want.abs() + 1e-7
        assert (err <= bound).all(), f"window_left={window_left}: max |err| {err.max().item():.3g}"


def test_tensor_core_kernel_scales_each_head_on_its_own():
    """A group whose heads' queries are 2^30, 1, 2^-20 and 1 times apart (bf16), and fp16 queries beyond 2^15: each
    head scaled by its own power of two before its f16 operands, every head within the bound of fp64."""
    c = Case([1, 33, 700, 4097], 2, 4, 128, torch.bfloat16, E4M3, seed=16)
    mags = torch.tensor([2.0 ** 30, 1.0, 2.0 ** -20, 1.0], device=DEV).repeat(c.hkv)
    c.q = (c.q.float() * mags[None, :, None]).to(torch.bfloat16)
    got = c.run(workers=2, stages=3, mma=True)
    assert_mma_close(got, c.reference(), c.v.float().abs().max().item(), "heads 2^30 / 1 / 2^-20 apart")
    h = Case([1, 33, 700], 2, 2, 128, torch.float16, E4M3, seed=17)
    h.q = (h.q.float() * 16384).clamp(-65000, 65000).half()
    assert h.q.float().abs().max().item() >= 2.0 ** 15
    scale = 1 / (16384 * math.sqrt(h.D))
    assert_mma_close(h.run(workers=1, stages=3, mma=True, sm_scale=scale), h.reference(sm_scale=scale),
                     h.v.float().abs().max().item(), "fp16 queries beyond 2^15")


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_tensor_core_kernel_with_windows_caps_and_page_sizes(page_size):
    c = Case([1, 7, 64, 300, 1025, 4100], 2, 4, 128, torch.bfloat16, E4M3, page_size=page_size, seed=60 + page_size)
    for window_left, cap in ((-1, 0.0), (40, 5.0), (3000, 0.0), (0, 0.0)):
        got = c.run(workers=2, sm_scale=0.3, cap=cap, window_left=window_left, stages=3, mma=True, pdl=True)
        want = c.reference(sm_scale=0.3, cap=cap, window_left=window_left)
        assert_mma_close(got, want, c.v.float().abs().max().item(), f"page_size={page_size} window={window_left}")


def test_tensor_core_kernel_bits_depend_on_nothing_but_the_request():
    """1 to 40 workers, a request alone or among others, the launch's rows permuted: the same bits."""
    c = Case(LENS, 2, 4, 128, torch.bfloat16, E4M3, seed=12)
    base = c.run(workers=1, stages=3, mma=True)
    for w in (2, 5, 16, 40):
        assert torch.equal(c.run(workers=w, stages=3, mma=True, pdl=w == 5), base), f"workers={w}"
    for b in (0, 4, 7, 9):
        alone = c.run(q=c.q[b: b + 1].contiguous(), tables=[c.tables[b]], lens=[c.lens[b]], workers=3, ws_rows=7,
                      stages=3, mma=True)
        assert torch.equal(alone[0], base[b]), f"request {b}"
    order = [9, 3, 0, 8, 5, 1, 7, 2, 6, 4]
    perm = c.run(q=c.q[order].contiguous(), tables=[c.tables[i] for i in order], lens=[c.lens[i] for i in order],
                 workers=2, stages=3, mma=True)
    assert torch.equal(perm, base[order])


def test_tensor_core_kernel_reads_every_e4m3_code_and_large_queries():
    """Pages of every non-NaN e4m3 code (subnormals, +-0, +-448) in K and V; then queries whose entries reach 2^20
    (beyond f16's range: scaled by a power of two before the f16 operands) with the softmax scale brought down to
    match: both within the bound of the fp64 reference."""
    c = Case([300, 17, 64, 1000], 2, 2, 128, torch.bfloat16, E4M3, seed=13)
    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(4)
    for pages in (c.k, c.v):
        flat = pages.view(torch.uint8).view(-1)
        flat.copy_(codes[torch.randint(0, codes.numel(), (flat.numel(),), generator=g, device=DEV)])
        flat[: codes.numel()] = codes
    vmax = 448.0
    got = c.run(workers=2, sm_scale=1e-4, stages=3, mma=True)
    assert_mma_close(got, c.reference(sm_scale=1e-4), vmax, "every code")
    big = Case([1, 33, 700], 2, 4, 128, torch.bfloat16, E4M3, seed=14)
    big.q = (big.q.float() * 2.0 ** 20).to(torch.bfloat16)
    scale = 2.0 ** -20 / math.sqrt(big.D)
    got = big.run(workers=1, sm_scale=scale, stages=3, mma=True)
    assert_mma_close(got, big.reference(sm_scale=scale), big.v.float().abs().max().item(), "queries at 2^20")


def test_tensor_core_kernel_graph_replay_and_refusals():
    """A captured programmatic launch with grouped heads, its tables refilled before each replay: the eager launch's
    bits; refused for bf16 pages, for other stages and with the integer conversion."""
    c = Case(LENS, 2, 8, 128, torch.bfloat16, E4M3, seed=15)
    assert_graph_replay_gives_the_eager_bits(c, 3, mma=True)
    with pytest.raises(RuntimeError, match="tensor-core kernel takes e4m3 pages and stages 3"):
        c.run(stages=5, mma=True)
    with pytest.raises(RuntimeError, match="tensor-core kernel takes e4m3 pages and stages 3"):
        c.run(stages=3, mma=True, int_convert=True)
    b = Case([40], 2, 1, 64, torch.bfloat16, torch.bfloat16, seed=1)
    with pytest.raises(RuntimeError, match="tensor-core kernel takes e4m3 pages and stages 3"):
        b.run(stages=3, mma=True)


def test_requests_without_keys_and_bad_page_ids():
    """A request without pages gets zeros; page ids outside the pool are clamped (wrong numbers, never a fault)."""
    c = Case([40, 40], 2, 2, 64, torch.bfloat16, E4M3, seed=2)
    indptr = torch.tensor([0, 0, 3], dtype=torch.int32, device=DEV)
    indices = torch.tensor([-7, 10 ** 6, 1], dtype=torch.int32, device=DEV)
    last = torch.tensor([16, 8], dtype=torch.int32, device=DEV)
    out = torch.full_like(c.q, float("nan"))
    po = torch.empty(2 * c.h * MAX_CHUNKS * c.D, device=DEV)
    pml = torch.empty(2 * c.h * MAX_CHUNKS * 2, device=DEV)
    counters = torch.zeros(2 * c.hkv, dtype=torch.int32, device=DEV)
    ext().decode_attention(out, c.q, c.k, c.v, indptr, indices, last, po, pml, counters, 0.125, 0.0, -1, CHUNK,
                           MAX_CHUNKS, 1, stream())
    torch.cuda.synchronize()
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(out[1]).all()


def test_refusals():
    c = Case([5], 2, 2, 64, torch.bfloat16, torch.bfloat16)
    ip, ix, la = c.arrays()
    po, pml = torch.empty(4096, device=DEV), torch.empty(4096, device=DEV)
    cnt = torch.zeros(8, dtype=torch.int32, device=DEV)
    x = ext()

    def call(out=None, q=None, k=None, v=None, chunk=CHUNK, counters=cnt, stages=0, pdl=False):
        q = c.q if q is None else q
        x.decode_attention(torch.empty_like(q) if out is None else out, q, c.k if k is None else k,
                           c.v if v is None else v, ip, ix, la, po, pml, counters, 1.0, 0.0, -1, chunk, MAX_CHUNKS, 1,
                           stream(), stages, pdl)

    q96 = torch.zeros(1, 4, 96, dtype=torch.bfloat16, device=DEV)
    k96 = torch.zeros(2, 16, 2, 96, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(RuntimeError, match="head_dim 96 .* not supported"):
        call(q=q96, k=k96, v=k96)
    q16 = torch.zeros(1, 32, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(RuntimeError, match="16 query heads per K/V head is not supported"):
        call(q=q16)
    with pytest.raises(RuntimeError, match="neither q's"):
        call(k=c.k.half(), v=c.v.half())
    with pytest.raises(RuntimeError, match="differ in shape or dtype"):
        call(v=c.v.to(E4M3))
    with pytest.raises(RuntimeError, match="out must be contiguous, of q's dtype"):
        call(out=torch.empty_like(c.q, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        call(chunk=24)
    with pytest.raises(RuntimeError, match="counters must be contiguous int32 with at least 2"):
        call(counters=cnt[:1])
    for stages in (-1, 1, 4, 9):
        with pytest.raises(RuntimeError, match="stages must be 0, 3 or 5"):
            call(stages=stages)
    # a programmatic launch: only the staged copies, one query head per K/V head (the register version has no wait)
    with pytest.raises(RuntimeError, match="programmatic launch needs stages 3 or 5 and one query head"):
        call(q=torch.zeros(1, 2, 64, dtype=torch.bfloat16, device=DEV), pdl=True)  # one query head per K/V head
    with pytest.raises(RuntimeError, match="programmatic launch needs stages 3 or 5 and one query head"):
        call(stages=3, pdl=True)  # (c: two query heads per K/V head)
    assert x.decode_attention_supports(128, 8) and not x.decode_attention_supports(128, 9)
    assert not x.decode_attention_supports(96, 1)

"""CudaSGMV (the csrc/ kernels) against fp64 / fp32-loop references, on a CUDA GPU.

Every run poisons its outputs first: v with NaN (entries that must stay unwritten stay NaN), the
outputs are random and sit as column views inside a wider fused buffer whose other columns must
not change, and pool rows beyond each slot's rank are NaN (they must never be read).
"""

from __future__ import annotations

import itertools

import math
from dataclasses import dataclass

import pytest
import torch

from lorafleet.runner.lora.segments import SegmentTable, build_segments
from lorafleet.runner.lora.sgmv import fp32_loop_reference
from lorafleet.runner.lora.sgmv_cuda import CudaSGMV
from lorafleet.common.workloads import WORKLOADS, assign

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"
DTYPES = (torch.float16, torch.bfloat16)
# ||out - ref|| / ||ref|| of the add-on; bf16 keeps 8 mantissa bits, fp16 11.
TOL = {torch.float16: 3e-3, torch.bfloat16: 1.2e-2}
PAD = 8  # extra columns on each side of the fused output

ALL_CC = dict(shrink_mma_min_rows=10**9, expand_mma_min_rows=10**9)   # CUDA-core path only
ALL_MMA = dict(shrink_mma_min_rows=1, expand_mma_min_rows=1)          # tensor-core path only


@dataclass
class Pool:
    a: list[torch.Tensor]  # [S, R, in] per projection
    b: list[torch.Tensor]  # [S, R, out_g]
    ranks: torch.Tensor  # int32 [G, S] on the device
    host_ranks: list[list[int]]
    rank_dim: int


def make_pool(in_dim: int, out_dims: list[int], host_ranks: list[list[int]], dtype, seed: int, rank_dim=None) -> Pool:
    """Random A ~ N(0, 1/in) and B ~ N(0, 1/r) (so v and the add-on are O(1)); rows >= rank are NaN."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    S = len(host_ranks[0])
    R = rank_dim or max(1, max(max(r) for r in host_ranks))
    a, b = [], []
    for g, od in enumerate(out_dims):
        r_s = torch.tensor(host_ranks[g], device=DEV)
        unused = torch.arange(R, device=DEV)[None, :] >= r_s[:, None]  # [S, R]
        a_g = torch.randn(S, R, in_dim, generator=gen, device=DEV) / math.sqrt(in_dim)
        b_g = torch.randn(S, R, od, generator=gen, device=DEV) / r_s.clamp(min=1).float().sqrt()[:, None, None]
        a_g[unused] = float("nan")
        b_g[unused] = float("nan")
        a.append(a_g.to(dtype))
        b.append(b_g.to(dtype))
    ranks = torch.tensor(host_ranks, dtype=torch.int32, device=DEV)
    return Pool(a, b, ranks, host_ranks, R)


def reference(x: torch.Tensor, pool: Pool, row_slots: list[int]):
    """fp64 add-on per projection [T, out_g] and fp64 v per projection [T, R] (NaN where unwritten)."""
    T = x.shape[0]
    slots = torch.tensor(row_slots, device=DEV)
    outs, vs = [], []
    for g in range(len(pool.a)):
        out = torch.zeros(T, pool.b[g].shape[2], dtype=torch.float64, device=DEV)
        v = torch.full((T, pool.rank_dim), float("nan"), dtype=torch.float64, device=DEV)
        for s in sorted(set(row_slots)):
            r = pool.host_ranks[g][s] if s >= 0 else 0
            if r == 0:
                continue
            rows = (slots == s).nonzero().squeeze(1)
            vr = x[rows].double() @ pool.a[g][s, :r].double().T
            v[rows, :r] = vr
            out[rows] = vr @ pool.b[g][s, :r].double()
        outs.append(out)
        vs.append(v)
    return outs, vs


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    denom = want.norm().item()
    return (got - want).norm().item() / max(denom, 1e-30)


def fused_outputs(T: int, out_dims: list[int], dtype, seed: int):
    """ys as column views of one fused buffer with PAD extra columns on both sides."""
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    buf = torch.randn(T, PAD + sum(out_dims) + PAD, generator=gen, device=DEV).to(dtype)
    ys = list(buf[:, PAD : PAD + sum(out_dims)].split(out_dims, dim=1))
    return buf, ys


def check_result(x, pool, row_slots, buf, before, ys, v, dtype, out_dims, label=""):
    """Compare outputs and v with the fp64 reference; check that nothing else was written."""
    torch.cuda.synchronize()
    assert torch.equal(buf[:, :PAD], before[:, :PAD]) and torch.equal(buf[:, -PAD:], before[:, -PAD:]), (
        f"{label}: columns outside the output views were written")
    want, want_v = reference(x, pool, row_slots)
    off = PAD
    for g, od in enumerate(out_dims):
        y0 = before[:, off : off + od]
        off += od
        assert not torch.isnan(ys[g]).any(), f"{label}: NaN in output {g} (a poisoned pool row or v entry was read)"
        untouched = [i for i, s in enumerate(row_slots) if s < 0 or pool.host_ranks[g][s] == 0]
        if untouched:
            idx = torch.tensor(untouched, device=DEV)
            assert torch.equal(ys[g][idx], y0[idx]), f"{label}: projection {g} changed rows without an adapter"
        if want[g].abs().sum() > 0:
            err = rel_err(ys[g].double() - y0.double(), want[g])
            assert err < TOL[dtype], f"{label}: projection {g} relative error {err:.2e} >= {TOL[dtype]:.0e}"
        # v: written exactly where the reference has values, untouched (NaN) elsewhere
        vg = v[:, g, : pool.rank_dim].double()
        written = ~torch.isnan(want_v[g])
        assert torch.isnan(vg[~written]).all(), f"{label}: v[:, {g}] written outside [rows with adapter, :rank]"
        if written.any():
            err_v = rel_err(vg[written], want_v[g][written])
            assert err_v < 1e-4, f"{label}: v[:, {g}] relative error {err_v:.2e}"


def run(sg: CudaSGMV, x, pool, row_slots, out_dims, dtype, capacity=None, seed=0, label="", fused=False,
        mma_rows=None, decode=False):
    """One call: shrink then expand, or (`fused`) `add` with every segment on the CUDA-core path in the
    one-launch kernel, or (`decode`) as decode steps call it (CUDA-core path, two launches), or
    (`mma_rows`) `add` with these thresholds."""
    T = x.shape[0]
    seg = build_segments(row_slots, device=DEV, capacity=capacity)
    buf, ys = fused_outputs(T, out_dims, dtype, seed)
    before = buf.clone()
    v = torch.full((T, len(out_dims), pool.rank_dim), float("nan"), device=DEV)
    if fused:
        sg.add(ys, v, x, pool.a, pool.b, pool.ranks, pool.host_ranks, seg, mma=False)
    elif decode:
        sg.add(ys, v, x, pool.a, pool.b, pool.ranks, pool.host_ranks, seg, mma=False, fused=False)
    elif mma_rows is not None:
        sg.add(ys, v, x, pool.a, pool.b, pool.ranks, pool.host_ranks, seg, mma_rows=mma_rows)
    else:
        sg.shrink(v, x, pool.a, pool.ranks, pool.host_ranks, seg)
        sg.expand(ys, v, pool.b, pool.ranks, pool.host_ranks, seg)
    check_result(x, pool, row_slots, buf, before, ys, v, dtype, out_dims, label)
    return buf, v


def batch_rows(workload: str, n_requests: int, num_adapters: int, seed: int, lengths=None, no_adapter_every=0):
    """Row -> slot for n requests (rows of one request are contiguous), grouped by adapter as the
    batch builder does; every `no_adapter_every`-th request runs the base model (slot -1)."""
    adapters = assign(workload, n_requests, num_adapters, seed=seed)
    if no_adapter_every:
        adapters = [-1 if (i + 1) % no_adapter_every == 0 else s for i, s in enumerate(adapters)]
    lengths = lengths or [1] * n_requests
    order = sorted(range(n_requests), key=lambda i: adapters[i])
    return [adapters[i] for i in order for _ in range(lengths[i])]


# (in, [outs]) of the projection groups the engine launches.
SHAPES = {
    "smollm_qkv": (576, [576, 192, 192]),
    "smollm_gate_up": (576, [1536, 1536]),
    "smollm_down": (1536, [576]),
    "llama_o": (4096, [4096]),
    "llama_qkv_gqa": (4096, [4096, 1024, 1024]),
    "llama_up": (4096, [11008]),
    "llama_down": (11008, [4096]),
}
RANKS = (8, 16, 32, 64, 128)
TOKENS = (1, 3, 16, 64, 256)
# output widths that end in a partial 64-column tile of the tensor-core expand (and a partial 512-column
# item of the CUDA-core one)
ODD_SHAPES = {"odd_widths": (200, [200, 72, 4104])}


def _workload_cases():
    cases, i = [], 0
    for dtype in DTYPES:
        for workload in WORKLOADS:
            for n in TOKENS:
                shape = list(SHAPES)[i % len(SHAPES)]
                rank = RANKS[(i // 2) % len(RANKS)]
                cases.append(pytest.param(dtype, workload, n, shape, rank,
                                          id=f"{str(dtype)[6:]}-{workload}-{n}-{shape}-r{rank}"))
                i += 1
    return cases


@pytest.mark.parametrize("fused", [False, True], ids=["2launch", "fused"])
@pytest.mark.parametrize("dtype,workload,n,shape,rank", _workload_cases())
def test_workloads(dtype, workload, n, shape, rank, fused):
    """Decode-like batches (one row per request) of the four workloads; every 5th request has no adapter."""
    in_dim, out_dims = SHAPES[shape]
    S = max(n, 8)
    host_ranks = [[rank] * S for _ in out_dims]
    pool = make_pool(in_dim, out_dims, host_ranks, dtype, seed=n + rank)
    row_slots = batch_rows(workload, n, S, seed=n, no_adapter_every=5)
    x = torch.randn(len(row_slots), in_dim, device=DEV).to(dtype)
    run(CudaSGMV(), x, pool, row_slots, out_dims, dtype, capacity=len(row_slots), label=f"{workload} n={n}",
        fused=fused)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["default", "cuda_cores", "tensor_cores", "fused"])
@pytest.mark.parametrize("shape", ["llama_qkv_gqa", "smollm_qkv", "llama_down", "odd_widths"])
def test_prefill_mix(dtype, path, shape):
    """Prefill-like segments of 100+ rows mixed with decode rows and base-model rows, mixed ranks,
    on each path: all must be exact for any segment length and output width."""
    opts = {"default": {}, "cuda_cores": ALL_CC, "tensor_cores": ALL_MMA, "fused": {}}[path]
    in_dim, out_dims = {**SHAPES, **ODD_SHAPES}[shape]
    S = 12
    rank_list = [16, 8, 64, 128, 1, 33, 16, 5, 100, 16, 48, 24]
    host_ranks = [[rank_list[(s + 3 * g) % S] if (s + g) % 7 else 0 for s in range(S)] for g in range(len(out_dims))]
    pool = make_pool(in_dim, out_dims, host_ranks, dtype, seed=7, rank_dim=128)
    lengths = [150, 1, 1, 64, 200, 5, 1, 130, 1, 600, 2, 1]
    row_slots = batch_rows("uniform", len(lengths), S, seed=3, lengths=lengths, no_adapter_every=4)
    x = torch.randn(len(row_slots), in_dim, device=DEV).to(dtype)
    run(CudaSGMV(**opts), x, pool, row_slots, out_dims, dtype, capacity=32, label=f"{path} {shape}",
        fused=path == "fused")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opts", [{}, ALL_CC, ALL_MMA, {"fused": True}],
                         ids=["default", "cuda_cores", "tensor_cores", "fused"])
def test_mixed_ranks_one_launch(dtype, opts):
    """Ranks 1..128 (and unadapted projections) of many slots in one G=3 launch, pool R = 128."""
    in_dim, out_dims = SHAPES["llama_qkv_gqa"]
    rank_list = [1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128]
    S = len(rank_list)
    host_ranks = [[0 if (s * 3 + g) % 11 == 0 else rank_list[(s + 5 * g) % S] for s in range(S)] for g in range(3)]
    pool = make_pool(in_dim, out_dims, host_ranks, dtype, seed=11, rank_dim=128)
    lengths = [1] * 20 + [3, 7, 40, 2]
    row_slots = batch_rows("skewed", len(lengths), S, seed=5, lengths=lengths, no_adapter_every=6)
    x = torch.randn(len(row_slots), in_dim, device=DEV).to(dtype)
    opts = dict(opts)
    fused = opts.pop("fused", False)
    run(CudaSGMV(**opts), x, pool, row_slots, out_dims, dtype, capacity=64, label="mixed ranks", fused=fused)


@pytest.mark.parametrize("dtype", DTYPES)
def test_against_per_row_loop(dtype):
    """One small case against the independent per-row fp32 loop of runner/lora/sgmv.py."""
    in_dim, out_dims = SHAPES["smollm_qkv"]
    host_ranks = [[4, 8, 0, 16, 3, 12], [8, 0, 2, 16, 7, 9], [1, 8, 5, 0, 16, 6]]
    pool = make_pool(in_dim, out_dims, host_ranks, dtype, seed=2, rank_dim=16)
    row_slots = [0, 0, 1, 1, 1, -1, 2, 3, 3, -1, 4, 5, 5, 5, 0]
    x = torch.randn(len(row_slots), in_dim, device=DEV).to(dtype)
    seg = build_segments(row_slots, device=DEV, capacity=16)
    buf, ys = fused_outputs(len(row_slots), out_dims, dtype, seed=2)
    before = buf.clone()
    v = torch.full((len(row_slots), 3, 16), float("nan"), device=DEV)
    sg = CudaSGMV()
    sg.shrink(v, x, pool.a, pool.ranks, pool.host_ranks, seg)
    sg.expand(ys, v, pool.b, pool.ranks, pool.host_ranks, seg)
    torch.cuda.synchronize()
    want = fp32_loop_reference(x, pool.a, pool.b, host_ranks, row_slots)  # slices [:r]: never sees the NaN rows
    off = PAD
    for g, od in enumerate(out_dims):
        got = ys[g].float().cpu() - before[:, off : off + od].float().cpu()
        off += od
        err = rel_err(got.double(), want[g].double())
        assert err < TOL[dtype], f"projection {g}: {err:.2e}"


def _static_graph_case(T: int, capacity: int, dtype, sg: CudaSGMV, fused: bool = False):
    """Static buffers and a captured shrink+expand graph for (T, capacity); `fused`: the one-launch
    fused call, captured twice in a row (its counters must be zero again after each launch)."""
    in_dim, out_dims = SHAPES["llama_qkv_gqa"]
    S = max(T, 16)
    rank_list = [16, 8, 32, 64, 4, 128, 16, 24]
    host_ranks = [[rank_list[(s + g) % len(rank_list)] for s in range(S)] for g in range(3)]
    pool = make_pool(in_dim, out_dims, host_ranks, dtype, seed=T, rank_dim=128)
    x = torch.randn(T, in_dim, device=DEV).to(dtype)
    seg0 = build_segments([s % S for s in range(T)], device=DEV, capacity=capacity)
    static = SegmentTable(seg0.indptr.clone(), seg0.slots.clone(), (), (), T)
    buf, ys = fused_outputs(T, out_dims, dtype, seed=T)
    base = buf.clone()
    v = torch.full((T, 3, 128), float("nan"), device=DEV)

    scratch = [torch.empty_like(y) for y in ys]

    def step():
        if fused:
            sg.add(scratch, v, x, pool.a, pool.b, pool.ranks, pool.host_ranks, static, mma=False)
            sg.add(ys, v, x, pool.a, pool.b, pool.ranks, pool.host_ranks, static, mma=False)
        else:
            sg.shrink(v, x, pool.a, pool.ranks, pool.host_ranks, static)
            sg.expand(ys, v, pool.b, pool.ranks, pool.host_ranks, static)

    step()  # load the extension and its launch caches outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay(row_slots):
        new = build_segments(row_slots, device=DEV, capacity=capacity)
        static.indptr.copy_(new.indptr)
        static.slots.copy_(new.slots)
        buf.copy_(base)
        v.fill_(float("nan"))
        graph.replay()
        check_result(x, pool, row_slots, buf, base, ys, v, dtype, out_dims, label=f"graph T={T}")

    return pool, replay


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("fused", [False, True], ids=["2launch", "fused"])
def test_cuda_graph_replay_with_new_tables(dtype, pdl, fused):
    """Capture once per (T, capacity) bucket, replay with other segment tables, slots and ranks."""
    sg = CudaSGMV(pdl=pdl)
    # T = 48: the CUDA-core-only kernels; T = 192: kernels that also carry the tensor-core path.
    for T, capacity in ((48, 48), (192, 192)):
        pool, replay = _static_graph_case(T, capacity, dtype, sg, fused)
        S = pool.ranks.shape[1]
        replay([(s * 7) % S for s in range(T)])                      # distinct adapters
        replay([3] * T)                                               # one shared adapter
        replay(sorted((i * 5) % 7 for i in range(T)))                 # uniform over 7
        replay([-1] * T)                                              # nobody adapted
        replay([2] * (T // 2) + [-1] * 3 + [9] * (T - T // 2 - 3))    # few segments, base rows
        # ranks change between replays too: slot 3 drops projection 0 and grows projection 1 to 128
        old = pool.host_ranks[1][3]
        pool.a[1][3, old:] = (torch.randn(128 - old, pool.a[1].shape[2], device=DEV) / 64).to(dtype)
        pool.b[1][3, old:] = (torch.randn(128 - old, pool.b[1].shape[2], device=DEV) / 11).to(dtype)
        pool.ranks[0, 3] = 0
        pool.ranks[1, 3] = 128
        pool.host_ranks[0][3] = 0
        pool.host_ranks[1][3] = 128
        replay([3] * T)
        replay([(s * 7) % S for s in range(T)])


def test_deterministic_and_pdl_invariant():
    """Same bits for repeated runs and with or without programmatic dependent launch."""
    dtype = torch.bfloat16
    in_dim, out_dims = SHAPES["llama_qkv_gqa"]
    S = 40
    host_ranks = [[16] * S, [8] * S, [32] * S]
    pool = make_pool(in_dim, out_dims, host_ranks, dtype, seed=4)
    row_slots = batch_rows("skewed", 300, S, seed=1, lengths=[1] * 299 + [200])
    x = torch.randn(len(row_slots), in_dim, device=DEV).to(dtype)
    outs = []
    for sg in (CudaSGMV(), CudaSGMV(), CudaSGMV(pdl=False)):
        buf, v = run(sg, x, pool, row_slots, out_dims, dtype, capacity=320, seed=9)
        outs.append((buf, v))
    for buf, v in outs[1:]:
        assert torch.equal(buf, outs[0][0])
        assert torch.equal(v.nan_to_num(nan=-7.0), outs[0][1].nan_to_num(nan=-7.0))


@pytest.mark.parametrize("pdl", [True, False])
def test_fused_is_bitwise_the_two_launch_cuda_core_path(pdl):
    """One launch or two (also `add(mma=False, fused=False)`, the decode steps' call), the same bits (every
    output element has one owner and one reduction order),
    over distinct, shared and long segments, base rows and unadapted projections; repeated calls
    leave the same bits (the counters restart from zero)."""
    dtype = torch.bfloat16
    in_dim, out_dims = SHAPES["llama_qkv_gqa"]
    S = 40
    host_ranks = [[16] * S, [0 if s % 5 == 0 else 8 for s in range(S)], [32] * S]
    pool = make_pool(in_dim, out_dims, host_ranks, dtype, seed=6, rank_dim=32)
    row_slots = batch_rows("skewed", 120, S, seed=2, lengths=[1] * 110 + [3, 7, 2, 1, 1, 150, 1, 1, 97, 1],
                           no_adapter_every=9)
    x = torch.randn(len(row_slots), in_dim, device=DEV).to(dtype)
    two, _ = run(CudaSGMV(pdl=pdl, **ALL_CC), x, pool, row_slots, out_dims, dtype, capacity=128, seed=3)
    # decode steps' call: two launches, every segment (also the 150- and 97-row ones) on CUDA cores
    split, _ = run(CudaSGMV(pdl=pdl), x, pool, row_slots, out_dims, dtype, capacity=128, seed=3, decode=True)
    assert torch.equal(split, two)
    sg = CudaSGMV(pdl=pdl)
    for _ in range(3):
        one, _ = run(sg, x, pool, row_slots, out_dims, dtype, capacity=128, seed=3, fused=True)
        assert torch.equal(one, two)
    assert int(sg._counters_for(x.device).abs().sum()) == 0


@pytest.mark.parametrize("cap", [1, 3, 40])
def test_shrink_grid_cap_keeps_the_bits(cap):
    """`shrink(max_blocks=N)` (a grid of at most N blocks, e.g. beside another kernel) gives the same v,
    bit for bit, on both paths (a 96-row segment takes tensor cores at the default threshold)."""
    dtype = torch.bfloat16
    in_dim, out_dims = SHAPES["llama_qkv_gqa"]
    S = 16
    pool = make_pool(in_dim, out_dims, [[16] * S, [8] * S, [0 if s % 3 == 0 else 16 for s in range(S)]], dtype,
                     seed=11, rank_dim=16)
    row_slots = batch_rows("skewed", 30, S, seed=5, lengths=[1] * 29 + [96])
    x = torch.randn(len(row_slots), in_dim, device=DEV).to(dtype)
    seg = build_segments(row_slots, device=DEV, capacity=32)
    vs = []
    for max_blocks in (0, cap):
        v = torch.zeros(len(row_slots), 3, 16, device=DEV)
        CudaSGMV().shrink(v, x, pool.a, pool.ranks, pool.host_ranks, seg, max_blocks=max_blocks)
        vs.append(v)
    torch.cuda.synchronize()
    assert vs[0].abs().sum() > 0
    assert torch.equal(vs[0], vs[1])
    with pytest.raises(RuntimeError, match="max_blocks"):
        CudaSGMV().shrink(vs[0], x, pool.a, pool.ranks, pool.host_ranks, seg, max_blocks=-1)


def one_row_segments(row_slots: list[int], capacity: int) -> SegmentTable:
    """Every row its own segment, also where neighbours share a slot (build_segments would merge them)."""
    T = len(row_slots)
    indptr = list(range(T + 1)) + [T] * (capacity - T)
    slots = list(row_slots) + [-1] * (capacity - T)
    return SegmentTable(torch.tensor(indptr, dtype=torch.int32, device=DEV),
                        torch.tensor(slots, dtype=torch.int32, device=DEV),
                        tuple(range(T + 1)), tuple(row_slots), T)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and the sign of zero included)."""
    ints = {4: torch.int32, 2: torch.int16}
    return a.dtype == b.dtype and torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))


DECODE_T = 32
DECODE_TABLES = {
    # name: (row -> slot, one_row): one_row builds one segment per row even where slots repeat
    "distinct": (list(range(DECODE_T)), False),
    "same_slot_rows": ([0] * DECODE_T, True),
    "same_slot_merged": ([0] * DECODE_T, False),  # one 32-row segment: decode_ranks has nothing to do
    "distinct_base_rows": ([-1 if i % 5 == 4 else (7 * i) % DECODE_T for i in range(DECODE_T)], False),
    # runs of 5, 7, 1 and 17 rows of four adapters around two rows without one: short segments of odd lengths
    "short_runs": ([0] * 5 + [3] * 7 + [-1] * 2 + [9] + [0] * 17, False),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["llama_qkv_gqa", "llama_down", "llama70_down"])
@pytest.mark.parametrize("table", list(DECODE_TABLES))
def test_launch_shape_knobs_keep_the_bits(dtype, shape, table):
    """Decode-shaped tables (T = 32): `shrink(blocks_per_sm=1..4, decode_ranks=1|2|4, row_items=False|True)` gives v
    bit for bit as the default call, and `expand(blocks_per_sm=1|2|4)` ys bit for bit as the default expand; the
    default call matches the fp64 reference. Ranks 0..16 per (projection, slot), many neither even nor
    multiples of 4 (partial last items), pool rows beyond a rank NaN; K = 4096 (G = 3), 11008 and 28672 (G = 1: lanes
    with 6 and 5, and 14 vectors, several steps of four for decode items of one rank row)."""
    in_dim, out_dims = {**SHAPES, "llama70_down": (28672, [8192])}[shape]
    G, S, R = len(out_dims), DECODE_T, 16
    rank_list = [3, 5, 16, 1, 7, 2, 13, 16, 6, 9, 11, 4, 15]
    host_ranks = [[0 if (s + 2 * g) % 9 == 8 else rank_list[(s + 5 * g) % len(rank_list)] for s in range(S)]
                  for g in range(G)]
    host_ranks[0][0] = 3  # the shared slot of the same-slot tables: odd ranks
    if G > 1:
        host_ranks[1][0], host_ranks[2][0] = 5, 16
    pool = make_pool(in_dim, out_dims, host_ranks, dtype, seed=21 + G, rank_dim=R)
    row_slots, one_row = DECODE_TABLES[table]
    capacity = DECODE_T + 8  # trailing empty segments too
    seg = one_row_segments(row_slots, capacity) if one_row else build_segments(row_slots, device=DEV, capacity=capacity)
    x = torch.randn(DECODE_T, in_dim, device=DEV).to(dtype)
    sg = CudaSGMV()

    def shrink(**kw):
        v = torch.full((DECODE_T, G, R), float("nan"), device=DEV)
        sg.shrink(v, x, pool.a, pool.ranks, pool.host_ranks, seg, **kw)
        return v

    buf, ys = fused_outputs(DECODE_T, out_dims, dtype, seed=G)
    before = buf.clone()
    v0 = shrink()
    sg.expand(ys, v0, pool.b, pool.ranks, pool.host_ranks, seg)
    check_result(x, pool, row_slots, buf, before, ys, v0, dtype, out_dims, label=f"default {table}")
    assert not torch.isnan(v0).all()

    for bps in (1, 2, 3, 4):
        for rb in (1, 2, 4):
            for row_items in (False, True):  # short segments' rows as one-row items of rb rank rows too
                v = shrink(blocks_per_sm=bps, decode_ranks=rb, row_items=row_items)
                torch.cuda.synchronize()
                assert same_bits(v, v0), (f"{table}: shrink(blocks_per_sm={bps}, decode_ranks={rb}, "
                                          f"row_items={row_items}) changed v")
    # The tensor-core capable kernel (mma_min_rows=2) keeps one-row segments on CUDA-core items, with
    # its own default rank rows per item: the same bits when every adapted segment has one row.
    runs = [len(list(grp)) for slot, grp in itertools.groupby(row_slots) if slot >= 0]
    if one_row or max(runs, default=1) == 1:
        for rb in (0, 1, 2, 4):
            v = shrink(mma_min_rows=2, decode_ranks=rb)
            torch.cuda.synchronize()
            assert same_bits(v, v0), f"{table}: tensor-core capable shrink (decode_ranks={rb}) changed v"
    # ... and with row_items, the segments below its threshold (here 16 rows: short_runs' 17-row run takes tensor cores
    # beside its 5-, 7- and 1-row runs) as one-row items, the others on tensor cores (the same bits for the former;
    # the latter checked against the reference by the tensor-core tests)
    v = shrink(mma_min_rows=16, decode_ranks=1, row_items=True)
    v_cc = shrink(mma_min_rows=16, decode_ranks=2)
    torch.cuda.synchronize()
    ip = seg.host_indptr
    short = [i for k in range(len(ip) - 1) if ip[k + 1] - ip[k] < 16 for i in range(ip[k], ip[k + 1])]
    if short:
        idx = torch.tensor(short, device=DEV)
        assert same_bits(v.index_select(0, idx), v0.index_select(0, idx)), f"{table}: row_items beside tensor cores"
        assert same_bits(v_cc.index_select(0, idx), v0.index_select(0, idx))
    for bps in (1, 2, 4):
        buf2 = before.clone()
        ys2 = list(buf2[:, PAD : PAD + sum(out_dims)].split(out_dims, dim=1))
        sg.expand(ys2, v0, pool.b, pool.ranks, pool.host_ranks, seg, blocks_per_sm=bps)
        torch.cuda.synchronize()
        assert same_bits(buf2, buf), f"{table}: expand(blocks_per_sm={bps}) changed ys"


def _two_row_case():
    """A tiny well-formed call (2 rows, 64 -> 32, rank 4, bf16) to break one operand of at a time."""
    dtype = torch.bfloat16
    pool = make_pool(64, [32], [[4] * 3], dtype, seed=0)
    seg = build_segments([0, 1], device=DEV, capacity=2)
    x = torch.randn(2, 64, device=DEV).to(dtype)
    v = torch.zeros(2, 1, 4, device=DEV)
    y = torch.zeros(2, 32, device=DEV, dtype=dtype)
    return dtype, pool, seg, x, v, y, CudaSGMV()


def test_launch_shape_knobs_are_checked():
    dtype, pool, seg, x, v, y, sg = _two_row_case()
    for rb in (3, -1, 8):
        with pytest.raises(RuntimeError, match="decode_ranks"):
            sg.shrink(v, x, pool.a, pool.ranks, pool.host_ranks, seg, decode_ranks=rb)
    with pytest.raises(RuntimeError, match="blocks_per_sm"):
        sg.shrink(v, x, pool.a, pool.ranks, pool.host_ranks, seg, blocks_per_sm=-1)
    with pytest.raises(RuntimeError, match="blocks_per_sm"):
        sg.expand([y], v, pool.b, pool.ranks, pool.host_ranks, seg, blocks_per_sm=-1)
    sg.shrink(v, x, pool.a, pool.ranks, pool.host_ranks, seg, blocks_per_sm=1000, decode_ranks=1)  # valid
    sg.expand([y], v, pool.b, pool.ranks, pool.host_ranks, seg, blocks_per_sm=1000)
    torch.cuda.synchronize()


@pytest.mark.parametrize("rows", [(64, 128), (512, 512), (16, 16)])
def test_add_with_per_call_thresholds(rows):
    """`add(mma_rows=...)` (each group of a step with prompt rows has its own): exact, and the same bits as
    shrink + expand of an instance built with those thresholds, over segments on both sides of them (a
    64-row prompt chunk, a 200-row one, decode rows); one launch or two does not change the bits."""
    dtype = torch.bfloat16
    in_dim, out_dims = SHAPES["llama_qkv_gqa"]
    S = 24
    host_ranks = [[16] * S, [0 if s % 5 == 0 else 8 for s in range(S)], [32] * S]
    pool = make_pool(in_dim, out_dims, host_ranks, dtype, seed=8, rank_dim=32)
    for lengths in ([1] * 31 + [64, 1, 200, 1, 1, 90, 1, 1, 1], [1] * 20 + [30]):
        row_slots = batch_rows("uniform", len(lengths), S, seed=4, lengths=lengths, no_adapter_every=7)
        x = torch.randn(len(row_slots), in_dim, device=DEV).to(dtype)
        want, _ = run(CudaSGMV(shrink_mma_min_rows=rows[0], expand_mma_min_rows=rows[1]), x, pool, row_slots,
                      out_dims, dtype, capacity=64, seed=5)
        got, _ = run(CudaSGMV(), x, pool, row_slots, out_dims, dtype, capacity=64, seed=5,
                     label=f"add with {rows}", mma_rows=rows)
        assert torch.equal(got, want)


def test_no_adapter_rows_and_empty_batch():
    dtype = torch.bfloat16
    in_dim, out_dims = SHAPES["smollm_qkv"]
    pool = make_pool(in_dim, out_dims, [[8] * 4] * 3, dtype, seed=1)
    x = torch.randn(10, in_dim, device=DEV).to(dtype)
    run(CudaSGMV(), x, pool, [-1] * 10, out_dims, dtype, capacity=4, label="all base rows")
    # T = 0: nothing to do, no error
    seg = build_segments([], device=DEV, capacity=4)
    v = torch.empty(0, 3, 8, device=DEV)
    x0 = torch.empty(0, in_dim, device=DEV, dtype=dtype)
    ys = [torch.empty(0, od, device=DEV, dtype=dtype) for od in out_dims]
    CudaSGMV().shrink(v, x0, pool.a, pool.ranks, pool.host_ranks, seg)
    CudaSGMV().expand(ys, v, pool.b, pool.ranks, pool.host_ranks, seg)
    torch.cuda.synchronize()


def test_rejects_bad_inputs():
    dtype, pool, seg, x, v, y, sg = _two_row_case()
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        sg.shrink(v, x.float(), [a.float() for a in pool.a], pool.ranks, pool.host_ranks, seg)
    with pytest.raises(RuntimeError, match="int32"):
        sg.shrink(v, x, pool.a, pool.ranks.long(), pool.host_ranks, seg)
    with pytest.raises(RuntimeError, match="float32"):
        sg.shrink(v.half(), x, pool.a, pool.ranks, pool.host_ranks, seg)
    with pytest.raises(RuntimeError, match="unit column stride"):
        sg.expand([torch.zeros(32, 2, device=DEV, dtype=dtype).T], v, pool.b, pool.ranks, pool.host_ranks, seg)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        sg.expand([torch.zeros(2, 40, device=DEV, dtype=dtype)[:, 4:36]], v, pool.b, pool.ranks, pool.host_ranks, seg)
    big = SegmentTable(torch.zeros(1026, dtype=torch.int32, device=DEV), torch.full((1025,), -1, dtype=torch.int32,
                                                                                     device=DEV), (), (), 2)
    with pytest.raises(RuntimeError, match="capacity"):
        sg.shrink(v, x, pool.a, pool.ranks, pool.host_ranks, big)
    with pytest.raises(ValueError, match="CUDA"):
        sg.shrink(v.cpu(), x.cpu(), [a.cpu() for a in pool.a], pool.ranks.cpu(), pool.host_ranks, seg)
    sg.expand([y], v, pool.b, pool.ranks, pool.host_ranks, seg)  # the valid call still works
    torch.cuda.synchronize()

"""The rope_kv kernel (csrc/rope_kv.cu) against an fp64 reference, on a CUDA GPU.

The qkv rows sit inside a wider buffer (a strided view, as the fused projection's output may be),
the cache is poisoned with NaN so that every slot the kernel must not touch is checked, and the
reference rotates in fp64 with the same fp32 cos/sin cache the kernel reads.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEV = "cuda"


def cos_sin_cache(positions: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    f = torch.arange(positions, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], -1).to(DEV)


def reference(x: torch.Tensor, cs: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any dtype) rotated in fp64 (rotate-half pairing)."""
    D = x.shape[-1]
    c = cs[pos, : D // 2].double()[:, None, :]
    s = cs[pos, D // 2:].double()[:, None, :]
    x1, x2 = x[..., : D // 2].double(), x[..., D // 2:].double()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def ext():
    from lorafleet.runner.kernels import load

    return load()


def run_case(T, H, Hkv, D, dtype, seed=0, skip_some=False, pad_cols=16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    width = (H + 2 * Hkv) * D
    buf = torch.randn(T, width + 2 * pad_cols, generator=g, device=DEV).to(dtype)
    qkv = buf[:, pad_cols: pad_cols + width]  # strided rows
    P = 4096
    cs = cos_sin_cache(P, D)
    pos = torch.randint(0, P, (T,), generator=g, device=DEV)
    nslots = 3 * T + 5
    slots = torch.randperm(nslots, generator=g, device=DEV)[:T]
    if skip_some:
        slots[::3] = -1
    k_cache = torch.full((nslots, Hkv, D), float("nan"), dtype=dtype, device=DEV)
    v_cache = torch.full_like(k_cache, float("nan"))
    q_out = torch.full((T, H, D), float("nan"), dtype=dtype, device=DEV)
    ext().rope_kv(q_out, k_cache, v_cache, qkv, pos, slots, cs, H, Hkv, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], -1)
    want_q = reference(q.reshape(T, H, D), cs, pos)
    want_k = reference(k.reshape(T, Hkv, D), cs, pos)
    return q_out, k_cache, v_cache, want_q, want_k, v.reshape(T, Hkv, D), slots


def ulp_ok(got: torch.Tensor, want64: torch.Tensor, dtype) -> None:
    """Within one rounding of the storage type of the exact value (plus fp32 arithmetic slack)."""
    eps = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    err = (got.double() - want64).abs()
    bound = want64.abs() * eps + 1e-6 + want64.abs().max() * 1e-6
    assert torch.isfinite(got).all()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 32, 32, 128), (32, 32, 32, 128), (300, 32, 8, 128), (7, 8, 2, 64),
                                       (5, 4, 4, 68)])
def test_rope_kv_matches_fp64(T, H, Hkv, D, dtype):
    q_out, k_cache, v_cache, want_q, want_k, v, slots = run_case(T, H, Hkv, D, dtype)
    ulp_ok(q_out, want_q, dtype)
    ulp_ok(k_cache[slots], want_k, dtype)
    assert torch.equal(v_cache[slots], v)  # copied bit for bit
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert torch.isnan(k_cache[untouched]).all() and torch.isnan(v_cache[untouched]).all()


def test_negative_slots_write_no_cache_but_q():
    q_out, k_cache, v_cache, want_q, want_k, v, slots = run_case(40, 8, 4, 128, torch.bfloat16, skip_some=True)
    ulp_ok(q_out, want_q, torch.bfloat16)
    keep = slots >= 0
    ulp_ok(k_cache[slots[keep]], want_k[keep], torch.bfloat16)
    written = torch.zeros(k_cache.shape[0], dtype=torch.bool, device=DEV)
    written[slots[keep]] = True
    assert torch.isnan(k_cache[~written]).all() and torch.isnan(v_cache[~written]).all()


def test_matches_flashinfer_rope_and_index_copy():
    """The path it replaces (flashinfer RoPE on contiguous q/k, then index copies) gives the same bits."""
    flashinfer = pytest.importorskip("flashinfer")
    T, H, Hkv, D, dtype = 64, 32, 8, 128, torch.bfloat16
    q_out, k_cache, v_cache, *_, slots = run_case(T, H, Hkv, D, dtype, seed=3)
    g = torch.Generator(device=DEV).manual_seed(3)
    width = (H + 2 * Hkv) * D
    buf = torch.randn(T, width + 32, generator=g, device=DEV).to(dtype)
    qkv = buf[:, 16: 16 + width]
    pos = torch.randint(0, 4096, (T,), generator=g, device=DEV)
    q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], -1)
    q, k = q.contiguous(), k.contiguous()
    flashinfer.apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, cos_sin_cache(4096, D), is_neox=True)
    # the same fp32 arithmetic (one fused multiply-add per element), so decode graphs with the kernel
    # replay exactly what eager steps with flashinfer's RoPE compute
    assert torch.equal(q_out, q.view(T, H, D))
    assert torch.equal(k_cache[slots], k.view(T, Hkv, D))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 32, 32, 128), (33, 32, 8, 128), (7, 8, 2, 64), (5, 4, 4, 68)])
def test_e4m3_pages_get_the_torch_writers_bits(T, H, Hkv, D, dtype):
    """FP8 K/V pages (float8_e4m3fn, unit scale): the kernel's cache bytes equal TorchKvWriter's to_e4m3 of the
    kernel's own bf16 / fp16 result for rotated k and of the qkv rows for v (values past +-448 included), q_out
    equals the plain call's, and slots it must not touch keep their bytes."""
    from lorafleet.runner.model.fp8 import E4M3, to_e4m3

    g = torch.Generator(device=DEV).manual_seed(11)
    width = (H + 2 * Hkv) * D
    buf = torch.randn(T, width + 32, generator=g, device=DEV).to(dtype)
    buf[:, 16 + width - Hkv * D: 16 + width] *= 300  # v values past e4m3's range: saturated, not NaN
    big = buf[:, 16: 16 + width]  # strided rows
    cs = cos_sin_cache(4096, D)
    pos = torch.randint(0, 4096, (T,), generator=g, device=DEV)
    nslots = 3 * T + 5
    slots = torch.randperm(nslots, generator=g, device=DEV)[:T]
    k8 = torch.full((nslots, Hkv, D), 0x55, dtype=torch.uint8, device=DEV).view(E4M3)
    v8 = k8.clone()
    q_out = torch.empty(T, H, D, dtype=dtype, device=DEV)
    stream = torch.cuda.current_stream().cuda_stream
    ext().rope_kv(q_out, k8, v8, big, pos, slots, cs, H, Hkv, stream)
    q2, k2, v2 = (torch.empty_like(q_out), torch.full((nslots, Hkv, D), float("nan"), dtype=dtype, device=DEV),
                  torch.full((nslots, Hkv, D), float("nan"), dtype=dtype, device=DEV))
    ext().rope_kv(q2, k2, v2, big, pos, slots, cs, H, Hkv, stream)  # the same kernel into pages of the model's dtype
    torch.cuda.synchronize()
    assert torch.equal(q_out, q2)
    k8, v8 = k8.view(torch.uint8), v8.view(torch.uint8)  # (indexing float8 tensors is not supported everywhere)
    assert torch.equal(k8[slots], to_e4m3(k2[slots]).view(torch.uint8))
    assert torch.equal(v8[slots], to_e4m3(v2[slots]).view(torch.uint8))
    assert torch.isfinite(v8[slots].view(E4M3).float()).all()
    untouched = torch.ones(nslots, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert (k8[untouched] == 0x55).all() and (v8[untouched] == 0x55).all()


def test_bad_shapes_are_refused():
    dtype = torch.bfloat16
    qkv = torch.zeros(4, (8 + 2 * 2) * 64, dtype=dtype, device=DEV)
    pos = torch.zeros(4, dtype=torch.int64, device=DEV)
    cs = cos_sin_cache(16, 64)
    cache = torch.zeros(8, 2, 64, dtype=dtype, device=DEV)
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(RuntimeError, match="q_out"):
        ext().rope_kv(torch.zeros(4, 7, 64, dtype=dtype, device=DEV), cache, cache.clone(), qkv, pos, pos, cs, 8, 2,
                      stream)
    with pytest.raises(RuntimeError, match="columns"):
        ext().rope_kv(torch.zeros(4, 8, 64, dtype=dtype, device=DEV), cache, cache.clone(), qkv, pos, pos, cs, 8, 3,
                      stream)
    with pytest.raises(RuntimeError, match="int64"):
        ext().rope_kv(torch.zeros(4, 8, 64, dtype=dtype, device=DEV), cache, cache.clone(), qkv, pos.int(), pos, cs,
                      8, 2, stream)
    with pytest.raises(RuntimeError, match="cos_sin"):
        ext().rope_kv(torch.zeros(4, 8, 64, dtype=dtype, device=DEV), cache, cache.clone(), qkv, pos, pos, cs.double(),
                      8, 2, stream)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,Hkv,D,R", [(32, 32, 128, 16), (9, 3, 64, 16), (8, 2, 128, 16), (8, 2, 128, 64)])
def test_lora_in_rope_kv_is_bitwise_the_expand_then_rope_kv(H, Hkv, D, R, dtype):
    """rope_kv_lora (the qkv rows' LoRA expand added inside the kernel) gives q_out and the K/V cache bit
    for bit as the SGMV CUDA-core expand into the qkv rows followed by rope_kv: decode rows with distinct,
    repeated and shared slots, base rows (-1), a slot outside the pool, ranks 0..R (odd ones, and one
    above the pool's rank dimension, clamped; with R = 64 ranks past 16, the expand's second batch of
    rank rows); v past each rank is NaN (never read)."""
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    g = torch.Generator(device=DEV).manual_seed(H + D)
    T, S = 24, 10
    outs = [H * D, Hkv * D, Hkv * D]
    width = sum(outs)
    row_slots = [3, 3, 7, -1, 0, 9, 9, 9, 2, 13, 5, 1, 4, 6, 8, -1, 3, 0, 0, 7, 2, 2, 5, 1]  # 13: outside
    rank_list = [16, 3, 5, 0, 7, 16, 1, 20, 9, 2] if R == 16 else [64, 17, 33, 0, 5, 48, 1, 70, 63, 2]  # > R: clamped
    ranks = torch.tensor([[rank_list[(s + 3 * gi) % S] for s in range(S)] for gi in range(3)], dtype=torch.int32,
                         device=DEV)
    b = [(torch.randn(S, R, o, generator=g, device=DEV) / 8).to(dtype) for o in outs]
    v = torch.randn(T, 3, R, generator=g, device=DEV)
    for t, s in enumerate(row_slots):  # entries past the row's rank are never read
        for gi in range(3):
            r = min(rank_list[(s + 3 * gi) % S], R) if 0 <= s < S else 0
            v[t, gi, r:] = float("nan")
    buf = torch.randn(T, width + 32, generator=g, device=DEV).to(dtype)
    qkv = buf[:, 16: 16 + width]
    P = 4096
    cs = cos_sin_cache(P, D)
    pos = torch.randint(0, P, (T,), generator=g, device=DEV)
    nslots = 3 * T
    slots = torch.randperm(nslots, generator=g, device=DEV)[:T]
    stream = torch.cuda.current_stream().cuda_stream

    def fresh():
        return (torch.full((T, H, D), float("nan"), dtype=dtype, device=DEV),
                torch.full((nslots, Hkv, D), float("nan"), dtype=dtype, device=DEV),
                torch.full((nslots, Hkv, D), float("nan"), dtype=dtype, device=DEV))

    # the reference: the engine's separate expand into the qkv rows, then rope_kv
    ref_qkv = qkv.clone()
    seg = build_segments(row_slots, device=DEV, capacity=T)
    CudaSGMV().expand(list(ref_qkv.split(outs, dim=1)), v, b, ranks, None, seg, mma_min_rows=1 << 30)
    q1, k1, v1 = fresh()
    ext().rope_kv(q1, k1, v1, ref_qkv, pos, slots, cs, H, Hkv, stream)
    # the fused kernel on the untouched rows
    q2, k2, v2 = fresh()
    before = buf.clone()
    row_slot = torch.tensor(row_slots, dtype=torch.int32, device=DEV)
    ext().rope_kv_lora(q2, k2, v2, qkv, pos, slots, cs, H, Hkv, stream, v, b, ranks, row_slot)
    torch.cuda.synchronize()
    assert same_bits(q2, q1) and same_bits(k2, k1) and same_bits(v2, v1)
    assert same_bits(buf, before)  # the qkv rows themselves are not written
    assert not same_bits(q2, fresh()[0]) and not torch.isnan(q2).any()
    # and the add-on is there: without it the rows with an adapter differ
    q3, k3, v3 = fresh()
    ext().rope_kv(q3, k3, v3, qkv, pos, slots, cs, H, Hkv, stream)
    torch.cuda.synchronize()
    adapted = [t for t, s in enumerate(row_slots) if 0 <= s < S and rank_list[s % S] > 0]
    assert not torch.equal(q3[adapted], q2[adapted])
    untouched = [t for t, s in enumerate(row_slots) if not 0 <= s < S]
    assert same_bits(q3[untouched], q2[untouched])


def test_rope_kv_lora_refuses_bad_operands():
    dtype, T, H, Hkv, D, S, R = torch.bfloat16, 4, 8, 2, 64, 3, 8
    qkv = torch.zeros(T, (H + 2 * Hkv) * D, dtype=dtype, device=DEV)
    pos = torch.zeros(T, dtype=torch.int64, device=DEV)
    cs = cos_sin_cache(16, D)
    cache = torch.zeros(8, Hkv, D, dtype=dtype, device=DEV)
    q_out = torch.zeros(T, H, D, dtype=dtype, device=DEV)
    stream = torch.cuda.current_stream().cuda_stream
    v = torch.zeros(T, 3, R, device=DEV)
    b = [torch.zeros(S, R, o, dtype=dtype, device=DEV) for o in (H * D, Hkv * D, Hkv * D)]
    ranks = torch.zeros(3, S, dtype=torch.int32, device=DEV)
    rs = torch.zeros(T, dtype=torch.int32, device=DEV)

    def call(**kw):
        args = dict(v=v, b=b, ranks=ranks, row_slot=rs)
        args.update(kw)
        ext().rope_kv_lora(q_out, cache, cache.clone(), qkv, pos, pos, cs, H, Hkv, stream, args["v"], args["b"],
                           args["ranks"], args["row_slot"])

    call()  # well-formed
    with pytest.raises(RuntimeError, match="v must be"):
        call(v=v.double())
    with pytest.raises(RuntimeError, match="b must hold"):
        call(b=b[:2])
    with pytest.raises(RuntimeError, match=r"b\[1\]"):
        call(b=[b[0], b[0], b[2]])
    with pytest.raises(RuntimeError, match="ranks"):
        call(ranks=ranks[:2])
    with pytest.raises(RuntimeError, match="row_slot"):
        call(row_slot=rs.long())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pdl_launch_after_an_early_epilogue_reads_its_rows(dtype):
    """rope_kv(pdl=True) launched right after an FP8 epilogue that lets it start at once (early=True), which writes
    the qkv rows: every block waits for the epilogue before it reads them or writes a page, so q and the pages are
    those of rope_kv launched after the stream has finished, bit for bit, in every round (a block reading before its
    wait would see the previous round's rows, left in the buffer)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    e = ext()
    T, H, Hkv, D = 256, 64, 8, 128  # (an epilogue of 2,560 blocks: long enough for an early reader to run ahead)
    width = (H + 2 * Hkv) * D
    g = torch.Generator(device=DEV).manual_seed(11)
    cs = cos_sin_cache(4096, D)
    pos = torch.randint(0, 4096, (T,), generator=g, device=DEV)
    slots = torch.randperm(2 * T, generator=g, device=DEV)[:T]
    ones_t, ones_n = torch.ones(T, device=DEV), torch.ones(width, device=DEV)
    qkv = torch.zeros(T, width, dtype=dtype, device=DEV)
    stream = torch.cuda.current_stream().cuda_stream
    for rnd in range(12):
        y = torch.randn(T, width, generator=g, device=DEV) * (rnd + 1)
        k_cache = torch.full((2 * T, Hkv, D), float("nan"), dtype=dtype, device=DEV)
        v_cache, q_out = torch.full_like(k_cache, float("nan")), torch.empty(T, H, D, dtype=dtype, device=DEV)
        e.fp8_epilogue(qkv, y, ones_t, ones_n, None, [width], None, [], None, None, True, stream, 0, True)
        e.rope_kv(q_out, k_cache, v_cache, qkv, pos, slots, cs, H, Hkv, stream, pdl=True)
        torch.cuda.synchronize()
        assert torch.equal(qkv, y.to(dtype))  # (unit scales: the epilogue stores y rounded)
        want_k, want_v, want_q = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan")), \
            torch.empty_like(q_out)
        e.rope_kv(want_q, want_k, want_v, qkv, pos, slots, cs, H, Hkv, stream)
        torch.cuda.synchronize()
        assert torch.equal(q_out.view(torch.int16), want_q.view(torch.int16)), rnd
        assert torch.equal(k_cache[slots].view(torch.int16), want_k[slots].view(torch.int16)), rnd
        assert torch.equal(v_cache[slots].view(torch.int16), want_v[slots].view(torch.int16)), rnd

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
    from lorafleet.runner.lora.build import load

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

"""A tiny shrink + expand run of every kernel path (and the fused one-launch path), the FP8 GEMM with its
K split and the decode attention kernel (one chunk, several, a request without pages, a table with page
ids out of range and pages past its indices), meant for compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python tests/gpu/sanitizer_case.py

(without the caching allocator every tensor is its own allocation, so memcheck sees reads and
writes just past a tensor's end). Also usable with --tool racecheck / synccheck / initcheck.
Exits non-zero on a wrong result.
"""

from __future__ import annotations

import sys

import torch

from lorafleet.runner.lora.segments import build_segments
from lorafleet.runner.lora.sgmv_cuda import CudaSGMV


def main() -> int:
    dev = "cuda"
    torch.manual_seed(0)
    in_dim, out_dims, S, R = 136, [72, 24, 40], 5, 24
    host_ranks = [[3, 16, 0, 24, 9], [8, 1, 5, 0, 24], [17, 16, 2, 7, 0]]
    # a 70-row prefill segment, decode rows, base-model rows, and unused trailing segments
    row_slots = [1] * 70 + [0, 3, -1, 4, 4, 2, -1]
    T, G = len(row_slots), len(out_dims)
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float16):
        a = [(torch.randn(S, R, in_dim, device=dev) / in_dim**0.5).to(dtype) for _ in out_dims]
        b = [(torch.randn(S, R, od, device=dev) / 4).to(dtype) for od in out_dims]
        ranks = torch.tensor(host_ranks, dtype=torch.int32, device=dev)
        x = torch.randn(T, in_dim, device=dev).to(dtype)
        seg = build_segments(row_slots, device=dev, capacity=12)
        for opts in ({}, {"shrink_mma_min_rows": 1, "expand_mma_min_rows": 1},
                     {"shrink_mma_min_rows": 10**9, "expand_mma_min_rows": 10**9}, {"fused": True}):
            fused_call = opts.pop("fused", False)
            sg = CudaSGMV(**opts)
            fused = torch.randn(T, sum(out_dims) + 16, device=dev).to(dtype)
            y0 = fused.clone()
            ys = list(fused[:, 8 : 8 + sum(out_dims)].split(out_dims, dim=1))
            v = torch.full((T, G, R), float("nan"), device=dev)
            if fused_call:
                for _ in range(3):  # the counters must be back at zero after every launch
                    ys_copy = [y.clone() for y in ys]
                    sg.add(ys_copy, v, x, a, b, ranks, host_ranks, seg, mma=False)
                sg.add(ys, v, x, a, b, ranks, host_ranks, seg, mma=False)
            else:
                sg.shrink(v, x, a, ranks, host_ranks, seg)
                sg.expand(ys, v, b, ranks, host_ranks, seg)
                # the write mode into strided fp32 views: only the adapted rows' projections written (the rest, and
                # the columns beside the views, keep their NaN), and y0 + the add-on, rounded once, is the
                # accumulating expand's y
                addon = torch.full((T, sum(out_dims) + 8), float("nan"), device=dev)
                sg.expand(list(addon[:, 4: 4 + sum(out_dims)].split(out_dims, dim=1)), v, b, ranks, host_ranks, seg,
                          write=True)
                torch.cuda.synchronize()
                written = torch.zeros(T, sum(out_dims) + 8, dtype=torch.bool)  # (on the host: a few hundred writes)
                col = 4
                for g, od in enumerate(out_dims):
                    for i, s in enumerate(row_slots):
                        written[i, col: col + od] = s >= 0 and host_ranks[g][s] > 0
                    col += od
                if not (torch.isnan(addon).cpu() == ~written).all():
                    print(f"FAIL dtype={dtype} opts={opts}: the write mode wrote outside the adapted rows' projections")
                    return 1
                summed = y0[:, 8: 8 + sum(out_dims)].float() + addon[:, 4: 4 + sum(out_dims)].nan_to_num(nan=0.0)
                if not torch.equal(summed.to(dtype), fused[:, 8: 8 + sum(out_dims)]):
                    print(f"FAIL dtype={dtype} opts={opts}: the written add-on is not the accumulating expand's")
                    return 1
            torch.cuda.synchronize()
            off = 8
            for g, od in enumerate(out_dims):
                want = torch.zeros(T, od, dtype=torch.float64, device=dev)
                for i, s in enumerate(row_slots):
                    r = host_ranks[g][s] if s >= 0 else 0
                    if r:
                        want[i] = (x[i].double() @ a[g][s, :r].double().T) @ b[g][s, :r].double()
                got = ys[g].double() - y0[:, off : off + od].double()
                off += od
                err = ((got - want).norm() / want.norm()).item()
                worst = max(worst, err)
                if not err < 2e-2:
                    print(f"FAIL dtype={dtype} opts={opts} projection {g}: relative error {err:.3e}")
                    return 1
    fp8 = fp8_case()
    if fp8 is None:
        return 1
    da = decode_attention_case()
    if da is None:
        return 1
    print(f"sanitizer case ok (worst relative error {worst:.2e}; FP8 GEMM {fp8}; decode attention {da})")
    return 0


def decode_attention_case() -> str | None:
    """csrc/decode_attn.cu over e4m3 and bf16 pages of 5 tokens, 2 K/V heads of 64 with 3 query heads each (and with
    one each, the K/V rows copied ahead through shared memory, 5 and 3 stages; and the tensor-core kernel over e4m3
    pages with 3 and 1 query heads per K/V head): a request
    of one chunk, one of several (chunks of 16, at most 4: so longer ones), one without pages, and one whose table
    names page ids outside the pool and whose indptr runs past the indices (clamped: no access outside the tensors);
    each launch on exactly-sized tensors. None on a wrong result."""
    import math

    from lorafleet.runner.kernels import load

    ext, dev = load(), "cuda"
    Hkv, D, ps, pages = 2, 64, 5, 40
    lens = [3, 150, 0, 9]
    tables = [[7], list(range(8, 38)), [], [10 ** 6, -3]]
    indptr = torch.tensor([0, 1, 31, 31, 34], dtype=torch.int32, device=dev)  # the last row's end is past indices
    indices = torch.tensor(sum(tables, []), dtype=torch.int32, device=dev)
    last = torch.tensor([3, 5, 1, 4], dtype=torch.int32, device=dev)
    worst = 0.0
    # (3 query heads per K/V head on the register version; one, with the rows copied ahead through shared memory)
    for kv_dtype, H, stages, mma in ((torch.float8_e4m3fn, 6, 0, False), (torch.bfloat16, 6, 0, False),
                                     (torch.float8_e4m3fn, 2, 5, False), (torch.bfloat16, 2, 3, False),
                                     (torch.float8_e4m3fn, 6, 3, True), (torch.float8_e4m3fn, 2, 3, True)):
        k = torch.randn(pages, ps, Hkv, D, device=dev).to(kv_dtype)
        v = torch.randn(pages, ps, Hkv, D, device=dev).to(kv_dtype)
        q = torch.randn(len(lens), H, D, device=dev).bfloat16()
        out = torch.full_like(q, float("nan"))
        chunks = 4
        po = torch.empty(len(lens) * H * chunks * D, device=dev)
        pml = torch.empty(len(lens) * H * chunks * 2, device=dev)
        counters = torch.zeros(len(lens) * Hkv, dtype=torch.int32, device=dev)
        ext.decode_attention(out, q, k, v, indptr, indices, last, po, pml, counters, 1 / math.sqrt(D), 0.0, -1, 16,
                             chunks, 3, torch.cuda.current_stream().cuda_stream, stages, mma, False, mma)
        torch.cuda.synchronize()
        for b in (0, 1):  # the well-formed requests against fp64
            t = torch.arange(lens[b], device=dev)
            slots = torch.tensor(tables[b], device=dev)[t // ps] * ps + t % ps
            kk = k.view(-1, Hkv, D).view(torch.uint8)[slots].view(kv_dtype).double() if kv_dtype != torch.bfloat16 \
                else k.view(-1, Hkv, D)[slots].double()
            vv = v.view(-1, Hkv, D).view(torch.uint8)[slots].view(kv_dtype).double() if kv_dtype != torch.bfloat16 \
                else v.view(-1, Hkv, D)[slots].double()
            qq = q[b].double().view(Hkv, H // Hkv, D)
            p = (torch.einsum("hgd,lhd->hgl", qq, kk) / math.sqrt(D)).softmax(-1)
            want = torch.einsum("hgl,lhd->hgd", p, vv).reshape(H, D)
            err = ((out[b].double() - want).norm() / want.norm()).item()
            worst = max(worst, err)
            if not err < 1e-2:
                print(f"FAIL decode_attention {kv_dtype} stages {stages} request {b}: relative error {err:.3e}")
                return None
        if out[2].abs().max().item() != 0 or not torch.isfinite(out[3]).all() or counters.abs().sum().item() != 0:
            print(f"FAIL decode_attention {kv_dtype} stages {stages}: the empty or clamped request, or the counters")
            return None
    return f"worst relative error {worst:.2e}"


def fp8_case() -> str | None:
    """csrc/fp8_gemm.cu with K split over blocks (the workspace and counters) and a last row tile of one live
    warp, 5 and 33 token rows; "skipped" without FP8 tensor cores, None on a wrong result."""
    from lorafleet.runner.kernels import load
    from lorafleet.runner.model.fp8 import fp8_tensor_cores, quantize_rows, quantize_tokens

    if not fp8_tensor_cores(torch.device("cuda")):
        return "skipped (no FP8 tensor cores)"
    ext = load()
    worst = 0.0
    for M, K, N in ((5, 4096, 4112), (33, 1024, 272)):
        x = torch.randn(M, K, device="cuda").bfloat16()
        w = quantize_rows(torch.randn(N, K, device="cuda") * 0.05)
        xq, sx = quantize_tokens(x, ext)
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ext.fp8_gemm(out, xq, sx.view(-1), w.q, w.scale, torch.cuda.current_stream().cuda_stream)
        want = (xq.float() * sx) @ w.dequant(torch.float32).t()
        err = ((out.float() - want).norm() / want.norm()).item()
        worst = max(worst, err)
        if not err < 1e-2:
            print(f"FAIL fp8_gemm M={M} K={K} N={N}: relative error {err:.3e}")
            return None
    return f"worst relative error {worst:.2e}"


if __name__ == "__main__":
    sys.exit(main())

"""The project's decode attention kernel (csrc/decode_attn.cu), eager, once per case, for Nsight Compute to read its
hardware counters (where its time goes at the contexts where it streams K/V slower than flashinfer's decode):

    ncu --clock-control none --kernel-name regex:decode_attention --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy --section MemoryWorkloadAnalysis python3 bench/ncu_decode_attn.py [--cases ...]

Cases: SHAPE_bB_cCTX_PAGES, e.g. 7b_b32_c1024_e4m3 (Llama-2-7B's 32 heads of 128; 70b: 64 query heads over 8 K/V
heads; pages bf16 or e4m3, 16 tokens each, shuffled as in a long-running engine). Each case launches the kernel twice
with the workers a CUDA graph of that batch takes: a warm-up, then the launch to read (the 2nd, 4th, ... kernel of the
report).
"""

from __future__ import annotations

import argparse
import math
import re

import torch

SHAPES = {"7b": (32, 32, 128), "70b": (64, 8, 128)}
PAGE = 16


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["7b_b32_c1024_e4m3", "7b_b32_c1024_bf16", "7b_b32_c128_e4m3",
                                                  "70b_b32_c1024_e4m3"],
                   help="default: 7b_b32_c1024_e4m3 7b_b32_c1024_bf16 7b_b32_c128_e4m3 70b_b32_c1024_e4m3")
    p.add_argument("--stages", type=int, default=3, choices=(0, 3, 5),
                   help="the K/V copies' stages where each K/V head has one query head (default: 3, the engine's)")
    p.add_argument("--mma", action="store_true",
                   help="e4m3 cases also on the tensor-core kernel (3 stages), after the CUDA-core kernel's launches")
    args = p.parse_args()
    cases = []
    for case in args.cases:
        m = re.fullmatch(r"(7b|70b)_b(\d+)_c(\d+)_(bf16|e4m3)", case)
        if m is None or int(m[2]) < 1 or int(m[3]) < 1:
            p.error(f"case {case!r} is not SHAPE_bBATCH_cCONTEXT_PAGES (SHAPE 7b or 70b, PAGES bf16 or e4m3)")
        cases.append((m[1], int(m[2]), int(m[3]), torch.bfloat16 if m[4] == "bf16" else torch.float8_e4m3fn))
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")

    from lorafleet.runner.executor.attention import decode_kernel as dk
    from lorafleet.runner.kernels import load

    ext, dev = load(), torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for shape, batch, ctx, kv_dtype in cases:
        H, Hkv, D = SHAPES[shape]
        pps = math.ceil(ctx / PAGE)
        pages = batch * pps
        gen = torch.Generator().manual_seed(ctx + batch)
        indices = torch.randperm(pages, generator=gen).to(torch.int32).to(dev)
        indptr = torch.arange(0, pages + 1, pps, dtype=torch.int32).to(dev)
        last = torch.full((batch,), ctx - (pps - 1) * PAGE, dtype=torch.int32).to(dev)
        kv = torch.randn(2, pages, PAGE, Hkv, D, device=dev).to(kv_dtype)
        q = torch.randn(batch, H, D, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(q)
        ws = dk.Workspace(batch, H, Hkv, D, dev)
        workers = dk.workers(sms, batch, Hkv)
        kv_mb = batch * ctx * Hkv * D * 2 * kv.element_size() / 1e6
        runs = [(args.stages if H == Hkv else 0, False)]
        if args.mma and kv_dtype == torch.float8_e4m3fn:
            runs.append((3, True))
        for stages, mma in runs:
            for _ in range(2):
                ext.decode_attention(out, q, kv[0], kv[1], indptr, indices, last, ws.partial_o, ws.partial_ml,
                                     ws.counters, 1 / math.sqrt(D), 0.0, -1, dk.CHUNK, dk.MAX_CHUNKS, workers,
                                     torch.cuda.current_stream().cuda_stream, stages, False, False, mma)
            torch.cuda.synchronize()
            print(f"{shape} batch {batch} context {ctx} {str(kv_dtype)[6:]} pages: {workers} worker(s), "
                  f"{stages} stages{', tensor cores' if mma else ''}, {kv_mb:.1f} MB of K/V per call", flush=True)
        del kv, ws
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

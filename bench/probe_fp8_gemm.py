"""Decode-sized FP8 GEMMs on the GPU: what each way of calling the FP8 tensor cores reaches, against bf16.

For each projection of the Llama-2-7B and -70B shapes at M token rows (default 32): the bf16 product
(F.linear), the engine's call (torch._scaled_mm with per-token and per-row scales), the same with the operands
swapped (W @ x.T, so the GEMM's long side is the weight's rows), per-tensor scales with the row scales
applied after an fp32 output, and the project's kernel (csrc/fp8_gemm.cu) on the e4m3 activations (`own`) and
on the bf16 ones, weight-only (`own_bf16`); their largest relative errors against the fp32 product of the same
operands are reported as `own_max_rel_err`, `own_bf16_max_rel_err`). The engine's decode product is the
unit-scale one into fp32 (`unit_fp32`: cuBLASLt; `sm90`: the project's wgmma kernel, csrc/fp8_gemm_sm90.cu, where
the build has it; `sm90_max_rel_err` against the fp32 product of the e4m3 operands; `sm90_s2`, `sm90_s4`: K in
2 or 4 parts run as a batch, partial sums only). Weights rotate over
copies larger than L2, so every call reads from HBM. Reports us per call replayed from a CUDA graph (as the
engine's decode steps run) with the weight bytes / that time (TB/s), and us per call launched from Python.

    python bench/probe_fp8_gemm.py --out probe_fp8_gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

SHAPES = {  # name: (K, N) of x [M, K] @ W.T, W [N, K]
    "7b.qkv": (4096, 12288), "7b.o": (4096, 4096), "7b.gate_up": (4096, 22016), "7b.down": (11008, 4096),
    "70b.qkv": (8192, 10240), "70b.o": (8192, 8192), "70b.gate_up": (8192, 57344), "70b.down": (28672, 8192),
}


def timed(fn, iters: int) -> float:
    """us per call, the calls launched one by one from Python (as an eager engine step does)."""
    for _ in range(3):
        fn(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(i)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters  # us


def graph_timed(fn, iters: int, replays: int = 5) -> float:
    """us per call with the calls replayed from one CUDA graph (as the engine's decode steps run): the GPU's
    time for the call, without Python's launch cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (iters * replays)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[32])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path("probe_fp8_gemm.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from lorafleet.runner.kernels import load
    from lorafleet.runner.model.fp8 import quantize_rows, quantize_tokens, sm90_gemm_available

    try:
        ext = load()
    except Exception as exc:  # no compiler: the own kernel is left out
        print(f"the CUDA extension did not build ({exc}): no `own` variant", file=sys.stderr)
        ext = None

    dev = torch.device("cuda")
    one = torch.ones((), device=dev)
    rows = []
    for name, (K, N) in SHAPES.items():
        copies = max(2, int(200e6 // (N * K)) + 1)  # > 200 MB of FP8 weights per rotation
        w16 = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(min(copies, 2))]
        ws = [quantize_rows(w16[i % len(w16)]) for i in range(copies)]
        w16 = [w16[i % len(w16)].clone() for i in range(max(2, copies // 2))]
        for M in args.rows:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            xq, sx = quantize_tokens(x)
            sxt = sx.view(1, -1).contiguous()
            rs = [w.scale.view(1, -1).contiguous() for w in ws]
            cs = [w.scale.view(-1, 1).contiguous() for w in ws]
            out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            out32 = torch.empty(M, N, device=dev, dtype=torch.float32)
            fns = {
                "bf16": lambda i: torch.nn.functional.linear(x, w16[i % len(w16)]),
                "rowwise": lambda i: torch._scaled_mm(xq, ws[i % copies].q.t(), scale_a=sx, scale_b=rs[i % copies],
                                                      out_dtype=torch.bfloat16),
                "rowwise_swapped": lambda i: torch._scaled_mm(ws[i % copies].q, xq.t(), scale_a=cs[i % copies],
                                                              scale_b=sxt, out_dtype=torch.bfloat16).t(),
                "tensor_fp32_then_scale": lambda i: (torch._scaled_mm(xq, ws[i % copies].q.t(), scale_a=one,
                                                                      scale_b=one, out_dtype=torch.float32)
                                                     * sx * rs[i % copies]).to(torch.bfloat16),
                "unit_fp32": lambda i: torch._scaled_mm(xq, ws[i % copies].q.t(), scale_a=one, scale_b=one,
                                                        out_dtype=torch.float32),
            }
            if M <= 64 and sm90_gemm_available(ext, dev):
                fns["sm90"] = lambda i: ext.fp8_gemm_sm90(out32, xq, ws[i % copies].q,
                                                          torch.cuda.current_stream().cuda_stream)
                for s in (2, 4):  # K in s parts as a batch (partial sums only; the epilogue would add them)
                    part = torch.empty(s, M, N, device=dev, dtype=torch.float32)
                    fns[f"sm90_s{s}"] = (lambda part, s: lambda i: ext.fp8_gemm_sm90(
                        part, xq, ws[i % copies].q, torch.cuda.current_stream().cuda_stream, s))(part, s)
            if ext is not None and M <= 64:
                fns["own"] = lambda i: ext.fp8_gemm(out, xq, sx.view(-1), ws[i % copies].q, ws[i % copies].scale,
                                                    torch.cuda.current_stream().cuda_stream)  # (a capture's)
                fns["own_bf16"] = lambda i: ext.fp8_gemm_bf16(out, x, ws[i % copies].q, ws[i % copies].scale,
                                                              torch.cuda.current_stream().cuda_stream)
            row = {"gemm": name, "M": M, "K": K, "N": N}
            if "sm90" in fns:
                fns["sm90"](0)
                exact = xq.float() @ ws[0].q.float().t()
                row["sm90_max_rel_err"] = float(((out32 - exact).abs() / exact.abs().max()).max())
            if "own" in fns:
                w32 = ws[0].dequant(torch.float32).t()
                for label, exact in (("own", (xq.float() * sx) @ w32), ("own_bf16", x.float() @ w32)):
                    fns[label](0)
                    row[f"{label}_max_rel_err"] = float(((out.float() - exact).abs() / exact.abs().max()).max())
            for label, fn in fns.items():
                try:
                    us = graph_timed(fn, args.iters)
                    eager = timed(fn, args.iters)
                    nbytes = N * K * (2 if label == "bf16" else 1)
                    row[label] = {"us": round(us, 1), "tb_s": round(nbytes / us / 1e6, 2),
                                  "eager_us": round(eager, 1)}
                except Exception as exc:  # a variant this torch / cuBLASLt does not take
                    row[label] = {"error": str(exc)[:120]}
            rows.append(row)
            times = "  ".join(f"{k} {v['us']:7.1f}us {v['tb_s']:4.2f}TB/s" if "us" in v else f"{k} err"
                              for k, v in row.items() if isinstance(v, dict))
            errors = "".join(f"  {k} {v:.1e}" for k, v in row.items() if k.endswith("_max_rel_err"))
            print(f"{name:12s} M={M:3d} {times}{errors}", flush=True)
        del ws, w16
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                    "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

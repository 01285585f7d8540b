"""The FP8 product of a decode step and its epilogue (scales, bias, the rows' LoRA expand), each replayed from a CUDA
graph: the wgmma product into fp32 then the epilogue's own launch, against the product with the epilogue inside it
(csrc/fp8_gemm_sm90.cu fp8_gemm_sm90_fused), per Llama-2-7B projection, with 32 distinct adapters, one, and none.

    python bench/probe_fused_epilogue.py --out probe_fused_epilogue.json
"""

from __future__ import annotations

import argparse

import torch

from probe_norm_lora import timed, write_json

# projection -> (output spans, K) of the Llama-2-7B shape
SHAPES = {"qkv": ([4096, 4096, 4096], 4096), "o": ([4096], 4096), "down": ([4096], 11008)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--reps", type=int, default=64)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from lorafleet.runner.kernels import load
    from lorafleet.runner.model.fp8 import quantize_rows, quantize_tokens

    ext = load()
    T, R, S = args.rows, args.rank, args.slots

    def cur() -> int:  # read at each call: a CUDA graph captures on a side stream of its own
        return torch.cuda.current_stream().cuda_stream

    rows: dict[str, dict[str, float]] = {}
    for name, (spans, K) in SHAPES.items():
        N, G = sum(spans), len(spans)
        w = quantize_rows(torch.randn(N, K, device="cuda") * 0.05)
        xq, sx = quantize_tokens(torch.randn(T, K, device="cuda").bfloat16())
        sx = sx.view(-1).contiguous()
        y = torch.empty(T, N, device="cuda")
        out = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
        b = [(torch.randn(S, R, n, device="cuda") * 0.05).bfloat16() for n in spans]
        v = torch.randn(T, G, R, device="cuda")
        ranks = torch.full((G, S), R, dtype=torch.int32, device="cuda")
        for mix, slots in (("distinct", list(range(T))), ("identical", [0] * T), ("none", None)):
            lora = ((v, b, ranks, torch.tensor(slots, dtype=torch.int32, device="cuda")) if slots is not None
                    else (None, [], None, None))

            def two_launches(lora=lora):
                st = cur()
                ext.fp8_gemm_sm90(y, xq, w.q, st, 1, True)
                ext.fp8_epilogue(out, y, sx, w.scale, None, spans, *lora, True, st)

            def fused(lora=lora):
                ext.fp8_gemm_sm90_fused(out, xq, w.q, sx, w.scale, None, spans, *lora, True, cur())

            rows[f"{name} {mix}"] = {"two_launches": round(timed(two_launches, args.reps), 2),
                                     "fused": round(timed(fused, args.reps), 2)}
    print(f"{'projection, adapters (us per call, CUDA graph)':48s} {'two launches':>12s} {'fused':>8s} {'ratio':>6s}")
    for k, r in rows.items():
        print(f"{k:48s} {r['two_launches']:12.2f} {r['fused']:8.2f} {r['fused'] / r['two_launches']:6.3f}")
    write_json(args.out, rows=T, rank=R, us_per_call=rows)


if __name__ == "__main__":
    main()

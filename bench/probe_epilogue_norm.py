"""The o and down projections of a decode step with adapters, then the add + RMSNorm after them, each chain replayed
from a CUDA graph: the product into fp32 (bf16 weights: the rows' LoRA shrink first on the producer warp group's
warps, as the default two launches run it; e4m3 weights: the unit-scale product, v given), then either the FP8
epilogue's launch (scales, bias, the rows' LoRA expand) and the norm's launch, as a step runs them today, or both in
one launch (csrc/sgmv.cu epilogue_norm; b0 / b1 / b2: B's rows of none, one or two of a lane's vectors read before
its wait). Llama-2-7B and -70B shapes, 32 distinct adapters and one; each product reads
its weight from DRAM (copies cycled past the L2), as a step's layers do. The design's measurement before the decoder
takes it.

    python bench/probe_epilogue_norm.py --out probe_epilogue_norm.json
"""

from __future__ import annotations

import torch

from probe_norm_lora import L2_DEFEAT, cur, projection_probe_args, timed, write_json

# shape -> projection -> (N, K)
SHAPES = {"7b": {"o": (4096, 4096), "down": (4096, 11008)}, "70b": {"o": (8192, 8192), "down": (8192, 28672)}}


def main() -> None:
    ap = projection_probe_args(__doc__, SHAPES)
    ap.add_argument("--weights", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"],
                    help="weight formats (default both)")
    args = ap.parse_args()

    from lorafleet.runner.kernels import load
    from lorafleet.runner.model.fp8 import quantize_rows, quantize_tokens, shrink_first_args

    ext = load()
    T, R, S = args.rows, args.rank, args.slots

    rows: dict[str, dict[str, float]] = {}
    for prec, shape, name in [(p, sh, n) for p in args.weights for sh in args.shapes for n in SHAPES[sh]]:
        N, K = SHAPES[shape][name]
        copies = max(1, -(-L2_DEFEAT // (N * K * (2 if prec == "bf16" else 1))))
        if prec == "bf16":
            ws = [(torch.randn(N, K, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
            x = torch.randn(T, K, device="cuda").bfloat16()
            xs = torch.ones(max(T, N), device="cuda")  # (unit scales)
        else:
            ws = [quantize_rows(torch.randn(N, K, device="cuda") * 0.02) for _ in range(copies)]
            x, xs = quantize_tokens(torch.randn(T, K, device="cuda").bfloat16())
            xs = xs.view(-1).contiguous()
        turn = [0]

        def weight():
            turn[0] += 1
            return ws[turn[0] % len(ws)]
        y = torch.empty(T, N, device="cuda")
        out = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(T, N, device="cuda").bfloat16()
        res_out, x_out = torch.empty_like(res), torch.empty_like(res)
        w_norm = (torch.rand(N, device="cuda") + 0.5).bfloat16()
        a = [(torch.randn(S, R, K, device="cuda") * 0.02).bfloat16()]
        b = [(torch.randn(S, R, N, device="cuda") * 0.02).bfloat16()]
        v = torch.randn(T, 1, R, device="cuda")
        ranks = torch.full((1, S), R, dtype=torch.int32, device="cuda")
        sync = torch.zeros(4, dtype=torch.int32, device="cuda")
        for mix, slots in (("distinct", list(range(T))), ("identical", [0] * T)):
            row_slot = torch.tensor(slots, dtype=torch.int32, device="cuda")
            lora = (v, b, ranks, row_slot)

            def product():
                st, w = cur(), weight()
                if prec == "bf16":  # the shrink first, on the producer's warps (the default two launches)
                    ext.fp8_gemm_sm90(y, x, w, st, 1, **shrink_first_args(x, [N], lora + (a,), sync, True))
                    return xs[:T], xs[:N]
                ext.fp8_gemm_sm90(y, x, w.q, st, 1, True)
                return xs, w.scale

            def separate():
                sx, sw = product()
                ext.fp8_epilogue(out, y, sx, sw, None, [N], *lora, True, cur())
                ext.rms_norm(x_out, out, res, res_out, w_norm, 1e-5, 0.0, None, None, True, cur(), early=True)

            def together(early_b=-1):
                sx, sw = product()
                ext.epilogue_norm(x_out, res, res_out, w_norm, 1e-5, 0.0, None, None, y, sx, sw, None, *lora, True,
                                  cur(), early=True, early_b=early_b)

            def product_alone():
                product()

            k = f"{prec} {shape} {name} {mix}"
            r = rows[k] = {"product": round(timed(product_alone, args.reps), 2),
                           "epilogue_then_norm": round(timed(separate, args.reps), 2),
                           **{f"epilogue_norm_b{b}": round(timed(lambda b=b: together(b), args.reps), 2)
                              for b in (0, 1, 2)}}
            if len(rows) == 1:
                print(f"{'weights shape projection adapters (us a chain)':44s} {'product':>8s} {'+epi+norm':>10s} "
                      f"{'+both b0':>9s} {'b1':>7s} {'b2':>7s}")
            print(f"{k:44s} {r['product']:8.2f} {r['epilogue_then_norm']:10.2f} {r['epilogue_norm_b0']:9.2f} "
                  f"{r['epilogue_norm_b1']:7.2f} {r['epilogue_norm_b2']:7.2f}", flush=True)
    write_json(args.out, rows=T, rank=R, us_per_chain=rows)


if __name__ == "__main__":
    main()

"""The FP8 product of a decode step and its epilogue (scales, bias, the rows' LoRA expand), each replayed from a CUDA
graph: the wgmma product into fp32 then the epilogue's own launch, against the product with the epilogue inside it
(csrc/fp8_gemm_sm90.cu fp8_gemm_sm90_fused), per Llama-2-7B and -70B projection (qkv, o, down), with 32 distinct
adapters, one, and none; each launch reads its weight from DRAM (copies cycled past the L2), as a step's layers do.

    python bench/probe_fused_epilogue.py --out probe_fused_epilogue.json
"""

from __future__ import annotations

import torch

from probe_common import L2_DEFEAT, cur, projection_probe_args, timed, write_json

# shape -> projection -> (output spans, K)
SHAPES = {
    "7b": {"qkv": ([4096, 4096, 4096], 4096), "o": ([4096], 4096), "down": ([4096], 11008)},
    "70b": {"qkv": ([8192, 1024, 1024], 8192), "o": ([8192], 8192), "down": ([8192], 28672)},
}


def main() -> None:
    args = projection_probe_args(__doc__, SHAPES).parse_args()

    from lorafleet.runner.kernels import load
    from lorafleet.runner.model.fp8 import quantize_rows, quantize_tokens

    ext = load()
    T, R, S = args.rows, args.rank, args.slots

    rows: dict[str, dict[str, float]] = {}
    for shape, name, (spans, K) in [(sh, n, v) for sh in args.shapes for n, v in SHAPES[sh].items()]:
        N, G = sum(spans), len(spans)
        # copies of the weight read in turn, so that each launch streams its weight from DRAM as in a step
        ws = [quantize_rows(torch.randn(N, K, device="cuda") * 0.05) for _ in range(max(1, -(-L2_DEFEAT // (N * K))))]
        turn = [0]

        def weight():
            turn[0] += 1
            return ws[turn[0] % len(ws)]
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
                st, w = cur(), weight()
                ext.fp8_gemm_sm90(y, xq, w.q, st, 1, True)
                ext.fp8_epilogue(out, y, sx, w.scale, None, spans, *lora, True, st)

            def fused(lora=lora):
                w = weight()
                ext.fp8_gemm_sm90_fused(out, xq, w.q, sx, w.scale, None, spans, *lora, True, cur())

            rows[f"{shape} {name} {mix}"] = {"two_launches": round(timed(two_launches, args.reps), 2),
                                     "fused": round(timed(fused, args.reps), 2)}
    print(f"{'projection, adapters (us per call, CUDA graph)':48s} {'two launches':>12s} {'fused':>8s} {'ratio':>6s}")
    for k, r in rows.items():
        print(f"{k:48s} {r['two_launches']:12.2f} {r['fused']:8.2f} {r['fused'] / r['two_launches']:6.3f}")
    write_json(args.out, rows=T, rank=R, us_per_call=rows)


if __name__ == "__main__":
    main()

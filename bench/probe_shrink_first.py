"""Where a decode projection's LoRA time goes on the wgmma product, per Llama-2-7B projection, for e4m3 and bf16
operands: the product into fp32 alone, with the rows' shrink first on its producer warps (32 distinct adapters, one),
each then followed by the epilogue's launch (the expand with adapters), against the one-launch product of steps
without adapters. Every call reads its weight, A and B pools from DRAM (copies cycled past the L2), as a step's layers
do, and follows the previous call's epilogue with programmatic dependent launch, as in a decode graph.

    python bench/probe_shrink_first.py --out probe_shrink_first.json

Columns (us per call, CUDA graph): `plain` (the product), `plain+epi` (and the epilogue without LoRA), `shrink 32`
/ `shrink 1` (the product with the shrink first), `lora 32` / `lora 1` (that product and the epilogue with the expand:
what a step with adapters runs), `off` (the one-launch product of a step without adapters). The shrink's own cost is
`shrink - plain`; LoRA's whole cost per projection is `lora - off`.
"""

from __future__ import annotations

import torch

from probe_common import L2_DEFEAT, cur, projection_probe_args, timed, write_json

# shape -> projection -> (output spans, K)
SHAPES = {
    "7b": {"qkv": ([4096, 4096, 4096], 4096), "o": ([4096], 4096), "gate_up": ([11008, 11008], 4096),
           "down": ([4096], 11008)},
}
OPERANDS = ("e4m3", "bf16")


def main() -> None:
    ap = projection_probe_args(__doc__, SHAPES)
    ap.add_argument("--operands", nargs="+", default=list(OPERANDS), choices=OPERANDS,
                    help="the products' operands (default: both)")
    args = ap.parse_args()

    from lorafleet.runner.kernels import load
    from lorafleet.runner.model.fp8 import quantize_rows, quantize_tokens

    ext = load()
    T, R, S = args.rows, args.rank, args.slots
    cols = ("plain", "plain+epi", "shrink 32", "shrink 1", "lora 32", "lora 1", "off")
    rows: dict[str, dict[str, float]] = {}
    for operands in args.operands:
        for shape, name, (spans, K) in [(sh, n, v) for sh in args.shapes for n, v in SHAPES[sh].items()]:
            torch.manual_seed(len(rows))
            N, G = sum(spans), len(spans)
            e4m3 = operands == "e4m3"
            per_set = N * K * (1 if e4m3 else 2) + 2 * S * R * (K * G + N)
            sets = []
            for _ in range(max(1, -(-L2_DEFEAT // per_set))):
                w32 = torch.randn(N, K, device="cuda") * 0.05
                w = quantize_rows(w32) if e4m3 else None
                sets.append({"w": w.q if e4m3 else w32.bfloat16(), "w_scale": w.scale if e4m3 else None,
                             "a": [(torch.randn(S, R, K, device="cuda") * 0.05).bfloat16() for _ in spans],
                             "b": [(torch.randn(S, R, n, device="cuda") * 0.05).bfloat16() for n in spans]})
                del w32
            turn = [0]

            def pick():
                turn[0] += 1
                return sets[turn[0] % len(sets)]

            x = torch.randn(T, K, device="cuda").bfloat16()
            xq, sx = quantize_tokens(x) if e4m3 else (x, None)
            unit = torch.ones(max(T, N), device="cuda")
            sx = sx.view(-1).contiguous() if e4m3 else unit[:T]
            y = torch.empty(T, N, device="cuda")
            out = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
            v = torch.zeros(T, G, R, device="cuda")
            ranks = torch.full((G, S), R, dtype=torch.int32, device="cuda")
            # a call site's counters each (the engine's rule: no two launches in flight share them; a product
            # draws its tickets before it waits for the kernel before, so the next call's could meet this one's)
            syncs = torch.zeros(8, 4, dtype=torch.int32, device="cuda")
            slots = {"32": torch.arange(T, dtype=torch.int32, device="cuda") % S,
                     "1": torch.zeros(T, dtype=torch.int32, device="cuda")}

            def product(st, s, mix=None):
                shrink = {} if mix is None else dict(lora_x=x, cols=spans, v=v, b=s["b"], ranks=ranks,
                                                     row_slot=slots[mix], a=s["a"], sync=syncs[turn[0] % 8],
                                                     shrink_producer=True)
                ext.fp8_gemm_sm90(y, xq, s["w"], st, 1, True, **shrink)

            def epilogue(st, s, mix=None):
                ws = s["w_scale"] if e4m3 else unit[:N]
                lora = (None, [], None, None) if mix is None else (v, s["b"], ranks, slots[mix])
                ext.fp8_epilogue(out, y, sx, ws, None, spans, *lora, True, st, early=True)

            def chain(mix=None, epi=False):
                def run():
                    st, s = cur(), pick()
                    product(st, s, mix)
                    if epi:
                        epilogue(st, s, mix)
                return run

            def off():
                s = pick()
                ws = s["w_scale"] if e4m3 else unit[:N]
                ext.fp8_gemm_sm90_fused(out, xq, s["w"], sx, ws, None, spans, None, [], None, None, True, cur())

            fns = {"plain": chain(), "plain+epi": chain(epi=True), "shrink 32": chain("32"), "shrink 1": chain("1"),
                   "lora 32": chain("32", True), "lora 1": chain("1", True), "off": off}
            key = f"{operands} {shape} {name}"
            rows[key] = {c: round(timed(fns[c], args.reps), 2) for c in cols}
            torch.cuda.synchronize()
            assert not syncs.any(), f"{key}: the shrink's counters were left non-zero"
            sets.clear()
            torch.cuda.empty_cache()
    print(f"{'operands, projection (us per call, CUDA graph)':36s}" + "".join(f"{c:>10s}" for c in cols)
          + f"{'shr32-pl':>9s}{'shr1-pl':>9s}{'lora1-off':>10s}")
    for k, r in rows.items():
        print(f"{k:36s}" + "".join(f"{r[c]:10.2f}" for c in cols) + f"{r['shrink 32'] - r['plain']:9.2f}"
              f"{r['shrink 1'] - r['plain']:9.2f}{r['lora 1'] - r['off']:10.2f}")
    write_json(args.out, rows=T, rank=R, slots=S, us_per_call=rows)


if __name__ == "__main__":
    main()

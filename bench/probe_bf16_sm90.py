"""The bf16 base product of a decode step on Hopper's wgmma (csrc/fp8_gemm_sm90.cu with bf16 operands) against
cuBLAS's, and with LoRA the chain each would run: cuBLAS's product, then the shrink and the expand (today's decode
path), against the shrink, then the wgmma product with the expand in its epilogue (fp8_gemm_sm90_fused, unit scales),
the shrink inside that same launch, the expand's share alone (v given) and the product without LoRA. Per Llama-2-7B (and -70B) projection, each launch reading its
weight from DRAM (copies cycled past the L2), each chain replayed from a CUDA graph.

    python bench/probe_bf16_sm90.py --out probe_bf16_sm90.json
"""

from __future__ import annotations

import argparse

import torch

from probe_common import timed, write_json

# shape -> projection -> (output spans, K)
SHAPES = {
    "7b": {"qkv": ([4096, 4096, 4096], 4096), "gate_up": ([11008, 11008], 4096), "o": ([4096], 4096),
           "down": ([4096], 11008)},
    "70b": {"qkv": ([8192, 1024, 1024], 8192), "gate_up": ([28672, 28672], 8192), "o": ([8192], 8192),
            "down": ([8192], 28672)},
}
L2_DEFEAT = 160 << 20  # bytes of weight copies cycled through: over 3x the H200's 50 MB L2, as a step's layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64], help="rows of the product alone")
    ap.add_argument("--lora-rows", type=int, default=32, help="rows of the LoRA chains")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--reps", type=int, default=32)
    ap.add_argument("--shapes", nargs="+", default=["7b"], choices=list(SHAPES))
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from lorafleet.runner.kernels import load

    ext = load()
    R, S = args.rank, args.slots
    dev, bf = "cuda", torch.bfloat16

    def cur() -> int:  # read at each call: a CUDA graph captures on a side stream of its own
        return torch.cuda.current_stream().cuda_stream

    product: dict[str, dict[str, float]] = {}
    chains: dict[str, dict[str, float]] = {}
    for shape, name, (spans, K) in [(sh, n, v) for sh in args.shapes for n, v in SHAPES[sh].items()]:
        N, G = sum(spans), len(spans)
        ws = [(torch.randn(N, K, device=dev) * 0.02).to(bf) for _ in range(max(1, -(-L2_DEFEAT // (2 * N * K))))]
        turn = [0]

        def weight():
            turn[0] += 1
            return ws[turn[0] % len(ws)]
        ones_n = torch.ones(N, device=dev)
        for T in args.rows:
            x = torch.randn(T, K, device=dev).to(bf)
            out = torch.empty(T, N, device=dev, dtype=bf)
            ones_m = torch.ones(T, device=dev)

            def cublas(x=x, out=out):
                torch.mm(x, weight().t(), out=out)

            def wgmma(x=x, out=out, ones_m=ones_m):
                ext.fp8_gemm_sm90_fused(out, x, weight(), ones_m, ones_n, None, spans, None, [], None, None, True,
                                        cur())

            def wgmma_f32(x=x, y=torch.empty(T, N, device=dev)):  # the product alone, fp32 out: no epilogue of ours
                ext.fp8_gemm_sm90(y, x, weight(), cur(), 1, True, False)
            c, g, p = timed(cublas, args.reps), timed(wgmma, args.reps), timed(wgmma_f32, args.reps)
            w0 = ws[0]
            ref = x.float() @ w0.float().t()
            ext.fp8_gemm_sm90_fused(out, x, w0, ones_m, ones_n, None, spans, None, [], None, None, True, cur())
            product[f"{shape} {name} {T} rows"] = {"cublas": round(c, 2), "wgmma": round(g, 2),
                                                   "wgmma_f32": round(p, 2),
                                                   "weight_tb_s": round(2 * N * K / g / 1e6, 2),
                                                   "rel_err": float((out.float() - ref).abs().max() / ref.abs().max())}
        T = args.lora_rows
        x = torch.randn(T, K, device=dev).to(bf)
        out = torch.empty(T, N, device=dev, dtype=bf)
        ones_m = torch.ones(T, device=dev)
        a = [(torch.randn(S, R, K, device=dev) * 0.05).to(bf) for _ in spans]
        b = [(torch.randn(S, R, n, device=dev) * 0.05).to(bf) for n in spans]
        v = torch.zeros(T, G, R, device=dev)
        syncs = torch.zeros(args.reps + 1, 4, dtype=torch.int32, device=dev)  # counters: one row per call of a graph
        turn_sync = [0]
        ranks = torch.full((G, S), R, dtype=torch.int32, device=dev)
        for mix in ("distinct", "identical"):
            slots = list(range(T)) if mix == "distinct" else [0] * T
            row_slot = torch.tensor(slots, dtype=torch.int32, device=dev)
            indptr = torch.tensor(list(range(T + 1)) if mix == "distinct" else [0, T], dtype=torch.int32, device=dev)
            seg_slots = torch.tensor(slots if mix == "distinct" else [0], dtype=torch.int32, device=dev)
            ys = list(out.split(spans, dim=1))

            def shrink():
                ext.shrink(v, x, a, ranks, indptr, seg_slots, 1 << 30, True, cur(), 0, 0, 0, None, None, False, False)

            def today():
                torch.mm(x, weight().t(), out=out)
                shrink()
                ext.expand(ys, v, b, ranks, indptr, seg_slots, 1 << 30, True, cur(), 0, False)

            def fused(row_slot=row_slot):
                shrink()
                expand_only(row_slot)

            def expand_only(row_slot=row_slot):  # v as the last shrink left it: the expand's share alone
                ext.fp8_gemm_sm90_fused(out, x, weight(), ones_m, ones_n, None, spans, v, b, ranks, row_slot, True,
                                        cur())

            def inside(row_slot=row_slot):  # the shrink inside the same launch (counters of its own)
                turn_sync[0] += 1
                ext.fp8_gemm_sm90_fused(out, x, weight(), ones_m, ones_n, None, spans, v, b, ranks, row_slot, True,
                                        cur(), a=a, sync=syncs[turn_sync[0] % len(syncs)])

            def no_lora():
                ext.fp8_gemm_sm90_fused(out, x, weight(), ones_m, ones_n, None, spans, None, [], None, None, True,
                                        cur())
            variants = {"cublas_shrink_expand": today, "shrink_wgmma_expand": fused, "wgmma_shrink_inside": inside,
                        "wgmma_expand_only": expand_only}
            variants["wgmma_no_lora"] = no_lora  # (last: left out of the comparison below)
            r = {k: round(timed(f, args.reps), 2) for k, f in variants.items()}
            turn[0] = -1  # the next calls on ws[0]
            today()
            first = out.float().clone()
            r["rel_diff"] = 0.0
            for f in [f for k, f in variants.items() if not k.endswith("no_lora")][1:]:
                turn[0] = -1
                out.fill_(float("nan"))
                f()
                r["rel_diff"] = max(r["rel_diff"], float((out.float() - first).abs().max() / first.abs().max()))
            chains[f"{shape} {name} {mix}"] = r
    print(f"{'projection, rows (us per call, CUDA graph)':40s} {'cuBLAS':>8s} {'wgmma':>8s} {'ratio':>6s} {'TB/s':>6s}"
          f" {'rel err':>8s} {'f32 out':>8s}")
    for k, r in product.items():
        print(f"{k:40s} {r['cublas']:8.2f} {r['wgmma']:8.2f} {r['wgmma'] / r['cublas']:6.3f} {r['weight_tb_s']:6.2f}"
              f" {r['rel_err']:8.1e} {r['wgmma_f32']:8.2f}")
    names = [k for k in next(iter(chains.values())) if k != "rel_diff"] if chains else []
    print(f"{f'projection, adapters ({args.lora_rows} rows), us':32s} " + " ".join(f"{n[:14]:>14s}" for n in names)
          + f" {'diff':>8s}")
    for k, r in chains.items():
        print(f"{k:32s} " + " ".join(f"{r[n]:14.2f}" for n in names) + f" {r['rel_diff']:8.1e}")
    write_json(args.out, rank=R, product_us=product, lora_chain_us=chains)


if __name__ == "__main__":
    main()

"""Decode attention alone: the project's kernel (csrc/decode_attn.cu) against flashinfer's batch decode (CUDA cores and
tensor cores, the latter also with no request's K/V split, as batch-invariant engines plan it), bf16 and e4m3 pages,
next to the bytes of K/V each call must read.

Per shape (Llama-2-7B: 32 heads of 128, no grouping; Llama-2-70B on one GPU: 64 query heads over 8 K/V heads), batch
and context: every layer has its own pages (32 layers, so nothing stays in L2), the page tables are shuffled, and
the 32 layer calls run in one CUDA graph; µs per layer call, the K/V bytes it read per second, and its time against
the floor (those bytes at the card's measured copy rate, src/lorafleet/bench/rates.py). Each variant's output is
checked against flashinfer's CUDA-core kernel on the same pages; the project's kernel with its K/V rows copied ahead
through shared memory (`_s3`, `_s5`: stages, where each K/V head has one query head) and as a programmatic dependent
launch (`_pdl`) also against its register version's bits, as is the staged launch that converts e4m3 bytes by integer
ops (`_ic`); the tensor-core kernel on e4m3 pages (`_mma`, any group; its own bits, so checked against flashinfer
only). `--chunks`: the staged programmatic launch also with other
chunk sizes (`_cN`; a request's bits follow its chunks, so these are checked against flashinfer only) and 1 / 2 / 4 / 8
workers; `--spread`: request lengths drawn around each context instead of all equal (the same mean).

    python bench/probe_decode_attn.py --out probe_decode_attn.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch

SHAPES = {"7b": (32, 32, 128), "70b": (64, 8, 128)}
LAYERS = 32


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file for the rows")
    p.add_argument("--ctx", type=int, nargs="+", default=[128, 370, 1024, 4096],
                   help="context lengths (default: 128 370 1024 4096)")
    p.add_argument("--batch", type=int, nargs="+", default=[32, 8], help="requests per call (default: 32 8)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="default: 7b 70b")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default: 16)")
    p.add_argument("--chunks", type=int, nargs="*", default=[],
                   help="other chunk sizes (multiples of 16) for the staged launch, 1/2/4/8 workers (default: none)")
    p.add_argument("--spread", type=float, default=0.0,
                   help="request lengths uniform in ctx x [1 - s, 1 + s] (0 <= s < 1; default 0: all ctx)")
    args = p.parse_args()
    if any(c <= 0 or c % 16 for c in args.chunks) or not 0 <= args.spread < 1:
        p.error("--chunks must be positive multiples of 16, --spread in [0, 1)")

    from probe_decode import graph_decoder

    from lorafleet.bench.kernels import Timer
    from lorafleet.bench.rates import card_rates
    from lorafleet.runner.executor.attention import decode_kernel as dk
    from lorafleet.runner.kernels import load

    ext, timer, dev, ps = load(), Timer(flush_bytes=1 << 20), torch.device("cuda"), args.page_size
    floor_tb_s = round(card_rates(dev)["bandwidth"] / 1e12, 2)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for shape in args.shapes:
        H, Hkv, D = SHAPES[shape]
        for batch in args.batch:
            for ctx in args.ctx:
                gen = torch.Generator().manual_seed(ctx + batch)
                if args.spread:
                    lens = (ctx * (1 + args.spread * (2 * torch.rand(batch, generator=gen) - 1))).round().int()
                    lens = lens.clamp(min=1).tolist()
                else:
                    lens = [ctx] * batch
                pages = [math.ceil(n / ps) for n in lens]
                P = sum(pages)
                perm = torch.randperm(P, generator=gen).to(torch.int32)
                indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).to(torch.int32)
                last = torch.tensor([n - (k - 1) * ps for n, k in zip(lens, pages)], dtype=torch.int32)
                q = torch.randn(batch, H, D, dtype=torch.bfloat16, device=dev)
                for kv_name, kv_dtype in (("bf16", torch.bfloat16), ("e4m3", torch.float8_e4m3fn)):
                    caches = []
                    for _ in range(LAYERS):
                        c = torch.randn(2, P, ps, Hkv, D, device=dev).to(kv_dtype)
                        caches.append((c[0], c[1]))  # contiguous K and V pages, as the engine's
                    kv_bytes = sum(lens) * Hkv * D * 2 * caches[0][0].element_size()
                    out = {}
                    times = {}
                    for tc, no_split in ((False, False), (True, False), (True, True)):
                        w = graph_decoder(indptr, perm.to(dev), last, H, Hkv, D, ps, kv_dtype, tc, no_split)
                        o = torch.empty_like(q)
                        name = ("flashinfer_tc_nosplit" if no_split else "flashinfer_tc") if tc else "flashinfer"
                        times[name] = timer.graph_us([lambda: [w.run(q, c, out=o) for c in caches]]) / LAYERS
                        out[name] = o.clone()
                        del w
                    wsp = dk.Workspace(batch, H, Hkv, D, dev)
                    t_indptr, t_indices, t_last = indptr.to(dev), perm.to(dev), last.to(dev)
                    o = torch.empty_like(q)
                    chosen = dk.workers(sms, batch, Hkv)  # as in a CUDA graph (lengths unknown)
                    # (stages: the K/V rows copied ahead through shared memory, where each K/V head has one query head;
                    # pdl: each layer's call a programmatic dependent launch of the call before, as the engine launches
                    # it after rope_kv with stages)
                    variants = [(w, 0, False) for w in sorted({1, 2, 4, chosen})]
                    if H == Hkv:
                        variants += [(w, st, True) for st in (3, 5) for w in sorted({1, 2, chosen})]
                        variants += [(chosen, 5, False)]
                    variants = [(w, st, pdl, dk.CHUNK, False, False) for w, st, pdl in variants]
                    if H == Hkv:
                        variants += [(w, 3, True, c, False, False) for c in args.chunks for w in (1, 2, 4, 8)]
                    if H == Hkv and kv_name == "e4m3":  # the bytes to fp32 by integer ops (the same values)
                        variants += [(chosen, 3, True, dk.CHUNK, True, False)]
                        variants += [(w, 3, True, c, True, False) for c in args.chunks for w in (2, 4)]
                    if kv_name == "e4m3":  # the tensor-core kernel (any group; its own bits)
                        variants += [(w, 3, True, dk.CHUNK, False, True) for w in sorted({1, 2, chosen})]
                        variants += [(w, 3, True, c, False, True) for c in args.chunks for w in (2, 4)]
                    for workers, stages, pdl, chunk, ic, mma in variants:
                        def own(workers=workers, stages=stages, pdl=pdl, chunk=chunk, ic=ic, mma=mma):
                            for k, v in caches:
                                ext.decode_attention(o, q, k, v, t_indptr, t_indices, t_last, wsp.partial_o,
                                                     wsp.partial_ml, wsp.counters, 1 / math.sqrt(D), 0.0, -1,
                                                     chunk, dk.MAX_CHUNKS, workers,
                                                     torch.cuda.current_stream().cuda_stream, stages, pdl, ic, mma)

                        name = "lorafleet" + (f"_c{chunk}" if chunk != dk.CHUNK else "") + (
                            f"_w{workers}" if workers != chosen or chunk != dk.CHUNK else "") + (
                            f"_s{stages}" if stages else "") + ("_pdl" if pdl else "") + ("_ic" if ic else "") + (
                            "_mma" if mma else "")
                        times[name] = timer.graph_us([own]) / LAYERS
                        out[name] = o.clone()
                    ref = out["flashinfer"].float()
                    floor_us = kv_bytes / (floor_tb_s * 1e12) * 1e6
                    for name, us in times.items():
                        r = {"shape": shape, "batch": batch, "ctx": ctx, "spread": args.spread, "pages": kv_name,
                             "kernel": name,
                             "us_per_layer": round(us, 2), "kv_tb_s": round(kv_bytes / (us * 1e-6) / 1e12, 2),
                             "of_floor": round(floor_us / us, 3), "ms_per_step": round(us * LAYERS / 1e3, 3),
                             "max_diff_vs_flashinfer": float((out[name].float() - ref).abs().max()),
                             "agrees": bool((out[name].float() - ref).abs().max() <= 2e-2 * ref.abs().max())}
                        base = name.split("_s")[0].removesuffix("_pdl")  # (_ic: also the conversion's values)
                        # staged copies and the launch's kind change no bit of the register version's
                        if base != name and base in out and not name.endswith("_mma"):
                            r["same_bits_as_registers"] = bool(torch.equal(out[name], out[base]))
                        print(json.dumps(r), flush=True)
                        rows.append(r)
                    del caches
                    torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"floor_tb_s": floor_tb_s, "page_size": ps, "rows": rows}, f, indent=1)
    print("µs per layer call (lorafleet: the workers the engine's graphs take; _wN: N workers)")
    key = lambda r: (r["shape"], r["batch"], r["ctx"], r["pages"])  # noqa: E731
    for k in dict.fromkeys(map(key, rows)):
        cells = [f"{r['kernel']} {r['us_per_layer']}{'' if r['agrees'] else ' WRONG'}"
                 f"{' BITS' if r.get('same_bits_as_registers') is False else ''}" for r in rows if key(r) == k]
        print(f"{k[0]:4} B={k[1]:<3} ctx={k[2]:<5} {k[3]:5} " + " | ".join(cells))


if __name__ == "__main__":
    main()

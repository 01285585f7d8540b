"""The LoRA shrink of a decode step alone, each launch replayed from a CUDA graph: per projection group of the
Llama-2-7B and -70B shapes (rank 16 on every projection, 32 rows), 32 distinct adapters (one-row segments) and one
(one 32-row segment, also cut into one-row items: row_items), with and without the rows' e4m3 quantization in the
same launch (FP8 weights), for each number of rank rows per decode item (decode_ranks), beside the bytes it must
read (x, and A of each distinct adapter; each launch reads its A from DRAM, x stays in L2 as after the kernel that
wrote it) and the rate that makes.

    python bench/probe_shrink.py --out probe_shrink.json
"""

from __future__ import annotations

import argparse

import torch

from probe_common import timed, write_json

L2_DEFEAT = 160 << 20  # bytes of A pools cycled through: over 3x the H200's 50 MB L2

# shape -> group -> (K, projections in the group); every projection's A is [rank, K]
GROUPS = {
    "7b": {"qkv": (4096, 3), "o": (4096, 1), "gate_up": (4096, 2), "down": (11008, 1)},
    "70b": {"qkv": (8192, 3), "o": (8192, 1), "gate_up": (8192, 2), "down": (28672, 1)},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--rows", type=int, default=32, help="decode rows of the step")
    ap.add_argument("--rank", type=int, default=16, help="rank of every projection's adapter")
    ap.add_argument("--reps", type=int, default=64, help="launches per graph replay")
    ap.add_argument("--shapes", nargs="+", default=list(GROUPS), choices=list(GROUPS), help="model shapes")
    ap.add_argument("--out", default="", help="JSON file of the results (none: print only)")
    args = ap.parse_args()

    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    T, R = args.rows, args.rank
    dt = torch.bfloat16
    sg = CudaSGMV()
    # identical_row_items: the one adapter's 32-row segment cut into one-row items of decode_ranks rank rows
    # (row_items, LORAFLEET_SHRINK_ROW_ITEMS) instead of items of 2 rows x 2 rank rows; the same bits
    mixes = {"distinct": (list(range(T)), T), "identical": ([0] * T, 1), "identical_row_items": ([0] * T, 1)}
    segs = {m: build_segments(slots, "cuda", capacity=T) for m, (slots, _) in mixes.items()}
    rows = []
    for shape in args.shapes:
        for group, (K, G) in GROUPS[shape].items():
            # enough copies of the A pools that a graph's launches read them from DRAM, as a step's layers do
            copies = max(1, min(64, -(-L2_DEFEAT // (T * G * R * K * 2))))
            pools = [[(torch.randn(T, R, K, device="cuda") * 0.05).to(dt) for _ in range(G)] for _ in range(copies)]
            ranks = torch.full((G, T), R, dtype=torch.int32, device="cuda")
            x = torch.randn(T, K, device="cuda").to(dt)
            v = torch.zeros(T, G, R, device="cuda")
            q = (torch.empty(T, K, device="cuda", dtype=torch.float8_e4m3fn), torch.empty(T, device="cuda"))
            for mix, (_, adapters) in mixes.items():
                nbytes = (T * K + adapters * G * R * K) * 2
                for quant in (False, True):
                    extra = T * K + T * 4 if quant else 0  # the e4m3 rows and their scales written
                    for dr in (0, 1, 2, 4):
                        turn = [0]

                        def call(dr=dr, mix=mix, quant=quant, turn=turn):
                            a = pools[turn[0] % copies]  # (the capture calls this once per launch of the graph)
                            turn[0] += 1
                            sg.shrink(v, x, a, ranks, None, segs[mix], mma_min_rows=1 << 30, decode_ranks=dr,
                                      quant=q if quant else None, row_items=mix == "identical_row_items")

                        us = timed(call, args.reps)
                        rows.append({"shape": shape, "group": group, "K": K, "projections": G, "mix": mix,
                                     "quant": quant, "decode_ranks": dr, "us": round(us, 2),
                                     "bytes": nbytes + extra, "gb_s": round((nbytes + extra) / us / 1e3, 1)})
    print(f"{'shape group mix quant':32s} " + " ".join(f"{'dr=' + str(d):>8s}" for d in (0, 1, 2, 4))
          + f" {'MB':>6s} {'GB/s best':>9s}")
    for i in range(0, len(rows), 4):
        r4 = rows[i:i + 4]
        r = r4[0]
        best = min(r4, key=lambda x: x["us"])
        print(f"{r['shape'] + ' ' + r['group'] + ' ' + r['mix'] + (' +quant' if r['quant'] else ''):32s} "
              + " ".join(f"{x['us']:8.2f}" for x in r4) + f" {r['bytes'] / 1e6:6.1f} {best['gb_s']:9.0f}")
    write_json(args.out, rows=T, rank=R, launches=rows)


if __name__ == "__main__":
    main()

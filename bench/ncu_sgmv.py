"""One decode-shaped LoRA call per case (the qkv group of a Llama-2-7B layer, rank 16, bf16), eager, for
Nsight Compute to read the hardware counters of the SGMV kernels:

    ncu --clock-control none --kernel-name regex:sgmv --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy python3 bench/ncu_sgmv.py [--cases b32_distinct b256_distinct ...]

Cases: bN_distinct (N one-row segments, each its own adapter), bN_identical (one N-row segment). Each case
runs the shrink then the expand of the CUDA-core path (what decode graphs launch) twice: a warm-up pair,
then the pair to read (the 2nd, 4th, 6th, ... pair of kernels in ncu's report).
"""

from __future__ import annotations

import argparse

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", default=["b32_distinct", "b32_identical", "b256_distinct"])
    args = p.parse_args()

    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    dev, bf = torch.device("cuda"), torch.bfloat16
    K, N, R = 4096, 4096, 16
    sg = CudaSGMV(shrink_mma_min_rows=1 << 30, expand_mma_min_rows=1 << 30)
    for case in args.cases:
        batch, mix = case.split("_")
        T = int(batch.removeprefix("b"))
        S = max(T, 1)
        a = [torch.randn(S, R, K, dtype=bf, device=dev) / 64 for _ in range(3)]
        b = [torch.randn(S, R, N, dtype=bf, device=dev) / 64 for _ in range(3)]
        ranks = torch.full((3, S), R, dtype=torch.int32, device=dev)
        seg = build_segments(list(range(T)) if mix == "distinct" else [0] * T, dev, capacity=T)
        x = torch.randn(T, K, dtype=bf, device=dev)
        y = torch.zeros(T, 3 * N, dtype=bf, device=dev)
        ys = list(y.split([N, N, N], dim=1))
        v = torch.empty(T, 3, R, dtype=torch.float32, device=dev)
        for _ in range(2):  # warm-up, then the measured call
            sg.shrink(v, x, a, ranks, None, seg)
            sg.expand(ys, v, b, ranks, None, seg)
        torch.cuda.synchronize()
        print(f"{case}: done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

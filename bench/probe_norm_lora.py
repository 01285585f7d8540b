"""Decode-sized launches around a norm, each replayed from a CUDA graph (how decode steps run them): flashinfer's
add + RMSNorm, the project's norm, the LoRA shrink and expand, and the norm_lora launch that does the expand, the norm
and the shrink at once (csrc/sgmv.cu) — alone, and as the chains they replace. Llama-2-7B shape by default.

    python bench/probe_norm_lora.py --out probe_norm_lora.json
"""

from __future__ import annotations

import argparse
import json

import torch


def timed(fn, reps: int, rounds: int = 5) -> float:
    """Microseconds per call of `fn` (which enqueues one chain), `reps` calls per graph replay, best of `rounds`."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    best = float("inf")
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / reps)
    return best


L2_DEFEAT = 160 << 20  # bytes of weight copies cycled through: over 3x the H200's 50 MB L2, as a step's layers


def cur() -> int:
    """The current stream, read at each call: a CUDA graph captures on a side stream of its own."""
    return torch.cuda.current_stream().cuda_stream


def projection_probe_args(doc: str, shapes: dict) -> argparse.ArgumentParser:
    """The options of a probe of decode-sized projections with adapters (rows, rank, slots, reps, shapes, out)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32, help="token rows (default 32)")
    ap.add_argument("--rank", type=int, default=16, help="every adapter's rank (default 16)")
    ap.add_argument("--slots", type=int, default=64, help="adapter slots in the pools (default 64)")
    ap.add_argument("--reps", type=int, default=64, help="chains per graph replay (default 64)")
    ap.add_argument("--shapes", nargs="+", default=list(shapes), choices=list(shapes))
    ap.add_argument("--out", default="", help="write the figures as JSON here")
    return ap


def write_json(path: str, **fields) -> None:
    """A probe's results as JSON at `path`, after the card and the torch version (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump({"card": torch.cuda.get_device_name(), "torch": torch.__version__, **fields}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--reps", type=int, default=64)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    from lorafleet.runner.kernels import load
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV
    from lorafleet.runner.model.norm import OwnNorm

    import flashinfer

    T, H, R, S = args.rows, args.hidden, args.rank, args.slots
    dt = torch.bfloat16
    a3 = [(torch.randn(S, R, H, device="cuda") * 0.05).to(dt) for _ in range(3)]
    b1 = (torch.randn(S, R, H, device="cuda") * 0.05).to(dt)
    ranks3 = torch.full((3, S), R, dtype=torch.int32, device="cuda")
    ranks1 = torch.full((1, S), R, dtype=torch.int32, device="cuda")
    h = torch.randn(T, H, device="cuda").to(dt)
    res = torch.randn(T, H, device="cuda").to(dt)
    w = torch.ones(H, device="cuda", dtype=dt)
    x = torch.empty_like(h)
    v1 = torch.randn(T, 1, R, device="cuda")
    v3 = torch.zeros(T, 3, R, device="cuda")
    sg, sg_nopdl = CudaSGMV(), CudaSGMV(pdl=False)
    zero1 = torch.zeros(S, dtype=torch.int32, device="cuda")
    own = OwnNorm(load(), 1e-5, 0.0)
    n = own.operands(h, res, w)
    h2, res2 = h.clone(), res.clone()
    rows = {}
    for mix, slots in (("distinct", list(range(T))), ("identical", [0] * T)):
        seg = build_segments(slots, "cuda", capacity=T)
        row_slot = torch.tensor(slots, dtype=torch.int32, device="cuda")
        big = 1 << 30
        ops = {
            "flashinfer_add_rmsnorm": lambda: flashinfer.norm.fused_add_rmsnorm(h2, res2, w, 1e-5),
            "own_norm": lambda: own.run(x, n),
            "shrink_qkv": lambda: sg.shrink(v3, x, a3, ranks3, None, seg, mma_min_rows=big),
            "expand_o": lambda: sg.expand((h2,), v1, (b1,), ranks1, None, seg, mma_min_rows=big),
            "norm_lora": lambda: sg.norm_lora(x, n, row_slot, (v1, b1, ranks1[0]), (v3, a3, ranks3)),
            "norm_lora_shrink_only": lambda: sg.norm_lora(x, n, row_slot, None, (v3, a3, ranks3)),
            "norm_lora_norm_only": lambda: sg.norm_lora(x, n, row_slot, (v1, b1, zero1), None),
            "norm_lora_expand_only": lambda: sg.norm_lora(x, n, row_slot, (v1, b1, ranks1[0]), None),
            "norm_lora_unstaged": lambda: sg.norm_lora(x, n, row_slot, (v1, b1, ranks1[0]), (v3, a3, ranks3),
                                                       stage_bytes=0),
            "norm_lora_no_pdl": lambda: sg_nopdl.norm_lora(x, n, row_slot, (v1, b1, ranks1[0]), (v3, a3, ranks3)),
            "chain_expand_flashinfer_shrink": lambda: (
                sg.expand((h2,), v1, (b1,), ranks1, None, seg, mma_min_rows=big),
                flashinfer.norm.fused_add_rmsnorm(h2, res2, w, 1e-5),
                sg.shrink(v3, h2, a3, ranks3, None, seg, mma_min_rows=big)),
            "chain_expand_own_shrink": lambda: (
                sg.expand((h2,), v1, (b1,), ranks1, None, seg, mma_min_rows=big), own.run(x, n),
                sg.shrink(v3, x, a3, ranks3, None, seg, mma_min_rows=big)),
        }
        rows[mix] = {k: round(timed(fn, args.reps), 2) for k, fn in ops.items()}
    print(f"{'launch (us, in a CUDA graph)':34s} {'distinct':>9s} {'identical':>9s}")
    for k in rows["distinct"]:
        print(f"{k:34s} {rows['distinct'][k]:9.2f} {rows['identical'][k]:9.2f}")
    write_json(args.out, rows=T, hidden=H, rank=R, us_per_call=rows)


if __name__ == "__main__":
    main()

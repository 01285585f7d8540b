"""What the decode-sized probes share: a chain timed from CUDA graph replays, the L2-defeating weight budget, the
current stream, the options of a projection probe and the JSON they write."""

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

"""Kernel benchmark: the LoRA add-on (shrink + expand) of one projection, ours against its peers.

For each shape (default: 4096->4096 r=16, 4096->4096 r=64, 11008->4096 r=16; bf16), batch size
{1..256} and adapter workload (distinct, uniform, skewed, identical; Punica's four), it times

    cuda        CudaSGMV (csrc/ kernels)
    loop        one matmul pair per segment (TorchSGMV)
    gather_bmm  gather each row's A and B, then two batched matmuls
    grouped_mm  gather each segment's A and B, then torch._grouped_mm (when this torch has it)

each eager (wall clock per call, back-to-back) and replayed in a CUDA graph (device time per
replay, measured with CUDA events around the replay, with L2 flushed before every replay so that
weights, x and y come from device memory as they do inside a model). The adapter pool is far bigger
than L2 and replays rotate among several disjoint adapter sets. Every case is first checked against
an fp64 reference (ours must match; a peer that does not is reported as wrong).

The memory floor of a case counts each distinct adapter's A and B once, x once and y read + written,
at 4.2 TB/s (the H200's measured copy bandwidth).

    lorafleet bench kernels [--out bench_kernels.json] [--plot bench_kernels.png] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

WORKLOADS = ("distinct", "uniform", "skewed", "identical")
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BANDWIDTH = 4.2e12  # bytes/s
HEADLINE = "h4096_r16"
IMPLS = ("cuda", "loop", "gather_bmm", "grouped_mm")


@dataclass(frozen=True)
class Shape:
    name: str
    in_dim: int
    out_dim: int
    rank: int


SHAPES = (
    Shape("h4096_r16", 4096, 4096, 16),
    Shape("h4096_r64", 4096, 4096, 64),
    Shape("down11008_r16", 11008, 4096, 16),
)


def assign(workload: str, n: int, num_adapters: int, rng) -> list[int]:
    """Adapter index per request (Punica's workloads): distinct, uniform over ceil(sqrt(n)),
    skewed (Zipf alpha 1.5), identical."""
    import numpy as np

    if workload == "distinct":
        return rng.permutation(num_adapters)[:n].tolist()
    if workload == "uniform":
        return rng.integers(0, min(num_adapters, math.ceil(math.sqrt(n))), size=n).tolist()
    if workload == "skewed":
        p = np.arange(1, num_adapters + 1, dtype=np.float64) ** -1.5
        return rng.choice(num_adapters, size=n, p=p / p.sum()).tolist()
    if workload == "identical":
        return [0] * n
    raise ValueError(workload)


@dataclass
class Case:
    """One rotation's inputs: x, y, the row -> slot map and the tables every implementation needs."""

    x: object
    y: object
    v: object
    row_slots: list[int]
    seg: object  # SegmentTable
    row_idx: object  # int64 [T] slot of every row
    seg_slots: object  # int64 [nseg]
    seg_ends: object  # int32 [nseg] cumulative row ends
    y0: object = None
    extra: dict = field(default_factory=dict)


def _make_impls(pool_a, pool_b, ranks, host_ranks) -> dict[str, Callable[[Case], Callable[[], None]]]:
    import torch

    from lorafleet.runner.lora.sgmv import TorchSGMV
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    ours, loop = CudaSGMV(), TorchSGMV()

    def cuda(c: Case):
        def fn():
            ours.shrink(c.v, c.x, [pool_a], ranks, host_ranks, c.seg)
            ours.expand([c.y], c.v, [pool_b], ranks, host_ranks, c.seg)
        return fn

    def loop_fn(c: Case):
        def fn():
            loop.shrink(c.v, c.x, [pool_a], ranks, host_ranks, c.seg)
            loop.expand([c.y], c.v, [pool_b], ranks, host_ranks, c.seg)
        return fn

    def gather_bmm(c: Case):
        def fn():
            a = pool_a.index_select(0, c.row_idx)  # [T, r, in]
            v = torch.bmm(c.x.unsqueeze(1), a.transpose(1, 2))  # [T, 1, r]
            b = pool_b.index_select(0, c.row_idx)  # [T, r, out]
            c.y.add_(torch.bmm(v, b).squeeze(1))
        return fn

    def grouped_mm(c: Case):
        def fn():
            a = pool_a.index_select(0, c.seg_slots)  # [nseg, r, in]
            v = torch._grouped_mm(c.x, a.transpose(1, 2), offs=c.seg_ends)  # [T, r]
            b = pool_b.index_select(0, c.seg_slots)  # [nseg, r, out]
            c.y.add_(torch._grouped_mm(v, b, offs=c.seg_ends))
        return fn

    impls = {"cuda": cuda, "loop": loop_fn, "gather_bmm": gather_bmm}
    if hasattr(torch, "_grouped_mm"):
        impls["grouped_mm"] = grouped_mm
    return impls


def _reference(c: Case, pool_a, pool_b, rank):
    import torch

    out = torch.zeros(c.x.shape[0], pool_b.shape[2], dtype=torch.float64, device=c.x.device)
    slots = torch.tensor(c.row_slots, device=c.x.device)
    for s in sorted(set(c.row_slots)):
        rows = (slots == s).nonzero().squeeze(1)
        out[rows] = (c.x[rows].double() @ pool_a[s, :rank].double().T) @ pool_b[s, :rank].double()
    return out


def _rel_err(c: Case, want) -> float:
    got = c.y.double() - c.y0.double()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


class Timer:
    def __init__(self, flush_bytes: int = 256 << 20):
        import torch

        self.torch = torch
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")

    def graph_us(self, fns: list[Callable[[], None]], reps: int) -> float:
        """Median device time of one graph replay, L2 flushed before each."""
        torch = self.torch
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (cuBLAS handles, extension load) off the capture
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graphs = []
        for fn in fns:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            graphs.append(g)
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            self.flush.zero_()
            starts[i].record()
            graphs[i % len(graphs)].replay()
            ends[i].record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
        del graphs
        return statistics.median(times[2:] if len(times) > 4 else times)

    def eager_us(self, fns: list[Callable[[], None]], budget_s: float = 0.05, max_calls: int = 200) -> float:
        """Wall-clock per call, calls back to back (CPU launch cost included, as in eager serving)."""
        torch = self.torch
        for fn in fns:
            fn()
        torch.cuda.synchronize()
        samples, t_end = [], time.perf_counter() + budget_s
        calls = 0
        while calls < max_calls and (calls < 3 * len(fns) or time.perf_counter() < t_end):
            t0 = time.perf_counter()
            for fn in fns:
                fn()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) * 1e6 / len(fns))
            calls += len(fns)
        return statistics.median(samples)


def floor_us(n_distinct: int, batch: int, shape: Shape, elem: int = 2) -> float:
    weights = n_distinct * shape.rank * (shape.in_dim + shape.out_dim) * elem
    activations = batch * shape.in_dim * elem + 2 * batch * shape.out_dim * elem
    return (weights + activations) / BANDWIDTH * 1e6


def run_shape(shape: Shape, batches, workloads, impls_wanted, rotations: int, reps: int, timer: Timer,
              log) -> list[dict]:
    import numpy as np
    import torch

    from lorafleet.runner.lora.segments import build_segments

    dev, dtype = "cuda", torch.bfloat16
    per_rot = max(batches)
    S = rotations * per_rot  # disjoint adapter sets, far bigger than L2 together
    gen = torch.Generator(device=dev).manual_seed(0)
    pool_a = (torch.randn(S, shape.rank, shape.in_dim, generator=gen, device=dev) / math.sqrt(shape.in_dim)).to(dtype)
    pool_b = (torch.randn(S, shape.rank, shape.out_dim, generator=gen, device=dev) / math.sqrt(shape.rank)).to(dtype)
    host_ranks = [[shape.rank] * S]
    ranks = torch.tensor(host_ranks, dtype=torch.int32, device=dev)
    impls = _make_impls(pool_a, pool_b, ranks, host_ranks)
    results = []
    for workload in workloads:
        for batch in batches:
            rng = np.random.default_rng(batch * 7 + len(workload))
            cases = []
            for rot in range(rotations):
                adapters = sorted(assign(workload, batch, per_rot, rng))
                row_slots = [rot * per_rot + a for a in adapters]
                seg = build_segments(row_slots, device=dev, capacity=batch)
                ends = torch.tensor(seg.host_indptr[1:], dtype=torch.int32, device=dev)
                cases.append(Case(
                    x=torch.randn(batch, shape.in_dim, device=dev).to(dtype),
                    y=torch.randn(batch, shape.out_dim, device=dev).to(dtype),
                    v=torch.empty(batch, 1, shape.rank, device=dev),
                    row_slots=row_slots, seg=seg,
                    row_idx=torch.tensor(row_slots, dtype=torch.int64, device=dev),
                    seg_slots=torch.tensor(seg.host_slots, dtype=torch.int64, device=dev),
                    seg_ends=ends,
                ))
            n_distinct = len(set(cases[0].row_slots))
            rec = {"shape": shape.name, "in": shape.in_dim, "out": shape.out_dim, "rank": shape.rank,
                   "dtype": "bf16", "workload": workload, "batch": batch, "distinct_adapters": n_distinct,
                   "floor_us": floor_us(n_distinct, batch, shape), "us": {}, "rel_err": {}}
            want = _reference(cases[0], pool_a, pool_b, shape.rank)
            for name in impls_wanted:
                if name not in impls:
                    continue
                c0 = cases[0]
                c0.y0 = c0.y.clone()
                try:
                    impls[name](c0)()
                    torch.cuda.synchronize()
                except Exception as exc:  # a peer this torch build cannot run
                    if name == "cuda":
                        raise
                    rec["us"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                    continue
                err = _rel_err(c0, want)
                rec["rel_err"][name] = err
                if name == "cuda" and not err < 2e-2:
                    raise SystemExit(f"WRONG RESULT: cuda kernels on {shape.name} {workload} batch={batch}: "
                                     f"relative error {err:.3e}")
                fns = [impls[name](c) for c in cases]
                entry = {"graph": timer.graph_us(fns, reps), "eager": timer.eager_us(fns)}
                if not err < 2e-2:
                    entry["wrong"] = True
                rec["us"][name] = entry
                del fns
            results.append(rec)
            ours = rec["us"].get("cuda", {})
            log(f"{shape.name:>14} {workload:>9} {batch:>4}: floor {rec['floor_us']:6.2f} us  "
                + "  ".join(f"{k} {v.get('graph', float('nan')):7.2f}/{v.get('eager', float('nan')):7.1f}"
                            for k, v in rec["us"].items() if "error" not in v)
                + ("" if ours else "  (cuda missing)"))
            del cases
            gc.collect()
            torch.cuda.empty_cache()
    return results


def headline(results: list[dict], card: str, date: str) -> dict:
    graph_us: dict[str, dict[str, float]] = {}
    for r in results:
        if r["shape"] == HEADLINE and "graph" in r["us"].get("cuda", {}):
            graph_us.setdefault(r["workload"], {})[str(r["batch"])] = round(r["us"]["cuda"]["graph"], 3)
    return {"card": card, "date": date, "shape": "4096->4096 r=16 bf16, one projection, shrink+expand, CUDA graph",
            "graph_us": graph_us}


def table(results: list[dict], shape_name: str) -> str:
    rows = [r for r in results if r["shape"] == shape_name]
    if not rows:
        return ""
    names = [n for n in IMPLS if any(n in r["us"] for r in rows)]
    head = f"{shape_name}: graph-replay us (eager us) per call; floor = bytes / 4.2 TB/s"
    cols = "workload   batch  floor " + "".join(f"{n:>20}" for n in names)
    lines = [head, cols]
    for r in rows:
        cells = []
        for n in names:
            e = r["us"].get(n)
            if not e or "error" in e:
                cells.append(f"{'-':>20}")
            else:
                mark = "!" if e.get("wrong") else ""
                cells.append(f"{e['graph']:9.2f} ({e['eager']:7.1f}){mark}".rjust(20))
        lines.append(f"{r['workload']:<10} {r['batch']:>5} {r['floor_us']:6.2f} " + "".join(cells))
    return "\n".join(lines)


def plot(results: list[dict], path: str, card: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in results if r["shape"] == HEADLINE]
    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(4 * len(WORKLOADS), 3.6), sharey=True)
    for ax, wl in zip(axes, WORKLOADS):
        sub = sorted((r for r in rows if r["workload"] == wl), key=lambda r: r["batch"])
        if not sub:
            continue
        xs = [r["batch"] for r in sub]
        for name in IMPLS:
            ys = [r["us"].get(name, {}).get("graph") for r in sub]
            if any(y is not None for y in ys):
                ax.plot(xs, [y if y is not None else float("nan") for y in ys], marker="o", ms=3, label=name)
        ax.plot(xs, [r["floor_us"] for r in sub], "k--", lw=1, label="memory floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(wl)
        ax.set_xlabel("batch size")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("latency (us), CUDA graph")
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"LoRA add-on 4096->4096 r=16 bf16 (shrink+expand), {card}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorafleet bench kernels", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench_kernels.json", help="full results as JSON (default %(default)s)")
    p.add_argument("--plot", default="bench_kernels.png", help="latency-vs-batch PNG, needs matplotlib ('' = none)")
    p.add_argument("--quick", action="store_true", help="headline shape only, fewer batch sizes")
    p.add_argument("--shapes", default="", help=f"comma-separated subset of {','.join(s.name for s in SHAPES)}")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated implementations to run")
    p.add_argument("--reps", type=int, default=60, help="graph replays timed per case (default %(default)s)")
    p.add_argument("--rotations", type=int, default=4, help="disjoint adapter sets replays rotate over")


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = [s for s in SHAPES if not args.shapes or s.name in args.shapes.split(",")]
    batches = (1, 8, 32, 64, 256) if args.quick else BATCHES
    if args.quick:
        shapes = [s for s in shapes if s.name == HEADLINE] or shapes[:1]
    impls = [n for n in args.impls.split(",") if n]
    card = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    timer = Timer()
    t0 = time.time()
    results = []
    for shape in shapes:
        results += run_shape(shape, batches, WORKLOADS, impls, args.rotations, args.reps, timer,
                             log=lambda s: print(s, flush=True))
    doc = {"card": card, "date": date, "torch": torch.__version__, "cuda": torch.version.cuda,
           "bandwidth_Bps": BANDWIDTH, "seconds": round(time.time() - t0, 1),
           "sgmv": headline(results, card, date), "cases": results}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    plotted = bool(args.plot) and plot(results, args.plot, card)
    print()
    for shape in shapes:
        if shape.name != HEADLINE:
            print(table(results, shape.name))
            print()
    print(table(results, HEADLINE) if any(s.name == HEADLINE for s in shapes) else "")
    print(f"\nwrote {args.out}" + (f" and {args.plot}" if plotted else "") + f" ({doc['seconds']} s, {card})")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

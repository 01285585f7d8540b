"""Kernel benchmark: the LoRA add-on (shrink + expand) of one projection, ours against its peers.

For each shape (default: 4096->4096 r=16, 4096->4096 r=64, 11008->4096 r=16; bf16), batch size
{1..256} and adapter workload (distinct, uniform, skewed, identical; Punica's four), it times

    cuda        CudaSGMV.add as a decode step calls it: shrink, then expand, every segment on CUDA cores
    cuda_fused  the same in one fused launch (same bits; what decode steps launched until 2026-12-01)
    cuda_2launch  two launches with the default thresholds (tensor cores for long segments)
    loop        one matmul pair per segment (a Python loop over adapters)
    gather_bmm  gather each row's A and B, then two batched matmuls
    grouped_mm  gather each segment's A and B, then torch._grouped_mm (when this torch has it)

three ways:

    graph       per call, steady state inside a CUDA graph: one graph holds N calls, each on its own
                adapter set, x and y, with N chosen so that the N calls touch > 150 MB (2.5x L2): every
                call reads its weights, x and y from device memory, as a LoRA call inside a model does.
                No graph-launch overhead; the gaps between kernels are included. The headline number.
    graph_cold  one call replayed alone right after an L2 flush (graph launch latency included).
    eager       wall clock per call, calls back to back (CPU launch cost included).

Every case is first checked against an fp64 reference (ours must match; a peer that does not is
marked wrong). The memory floor counts each distinct adapter's A and B once, x once and y read and
written, at the card's measured copy bandwidth (bench/rates.py).

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
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from lorafleet.common import cli_args

WORKLOADS = ("distinct", "uniform", "skewed", "identical")
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
HEADLINE = "h4096_r16"
IMPLS = ("cuda", "cuda_fused", "cuda_2launch", "loop", "gather_bmm", "grouped_mm")


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
    y_init: object = None  # y before any call (checks restart from it)
    y0: object = None


def _make_impls(pool_a, pool_b, ranks, host_ranks) -> dict[str, Callable[[Case], Callable[[], None]]]:
    import torch

    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    ours = CudaSGMV()

    def cuda(c: Case):  # what a decode step launches: shrink and expand, CUDA-core path
        return lambda: ours.add([c.y], c.v, c.x, [pool_a], [pool_b], ranks, host_ranks, c.seg, mma=False, fused=False)

    def cuda_fused(c: Case):  # the same as one fused launch
        return lambda: ours.add([c.y], c.v, c.x, [pool_a], [pool_b], ranks, host_ranks, c.seg, mma=False)

    def cuda_2launch(c: Case):
        return lambda: ours.add([c.y], c.v, c.x, [pool_a], [pool_b], ranks, host_ranks, c.seg, fused=False)

    def loop_fn(c: Case):
        segs = [(s, lo, hi) for s, lo, hi in zip(c.seg.host_slots, c.seg.host_indptr, c.seg.host_indptr[1:]) if s >= 0]

        def fn():  # one matmul pair per segment (per adapter), as a plain PyTorch server would do
            for s, lo, hi in segs:
                c.y[lo:hi] += (c.x[lo:hi] @ pool_a[s].T) @ pool_b[s]
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

    nopdl = CudaSGMV(pdl=False)

    def cuda_nopdl(c: Case):  # diagnostics: without programmatic dependent launch
        return lambda: nopdl.add([c.y], c.v, c.x, [pool_a], [pool_b], ranks, host_ranks, c.seg, fused=False)

    def cuda_shrink(c: Case):  # diagnostics: the shrink alone
        return lambda: ours.shrink(c.v, c.x, [pool_a], ranks, host_ranks, c.seg)

    def cuda_expand(c: Case):  # diagnostics: the expand alone
        return lambda: ours.expand([c.y], c.v, [pool_b], ranks, host_ranks, c.seg)

    impls = {"cuda": cuda, "cuda_fused": cuda_fused, "cuda_2launch": cuda_2launch, "loop": loop_fn,
             "gather_bmm": gather_bmm, "cuda_nopdl": cuda_nopdl,
             "cuda_shrink": cuda_shrink, "cuda_expand": cuda_expand}
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

    def _warm(self, fns):
        torch = self.torch
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (cuBLAS handles, extension load) off the capture
            for fn in fns[:4]:
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _capture(self, fns) -> object:
        g = self.torch.cuda.CUDAGraph()
        with self.torch.cuda.graph(g):
            for fn in fns:
                fn()
        return g

    def graph_us(self, fns: list[Callable[[], None]], replays: int = 12) -> float:
        """Per call: median replay time of one graph holding every call in `fns`, divided by their number."""
        torch = self.torch
        self._warm(fns)
        g = self._capture(fns)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for s, e in ev:
            s.record()
            g.replay()
            e.record()
        torch.cuda.synchronize()
        del g
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in ev) / len(fns)

    def graph_cold_us(self, fns: list[Callable[[], None]], reps: int) -> float:
        """One call replayed alone (its own graph) right after an L2 flush: median device time."""
        torch = self.torch
        fns = fns[:4]
        self._warm(fns)
        graphs = [self._capture([fn]) for fn in fns]
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for i, (s, e) in enumerate(ev):
            self.flush.zero_()
            s.record()
            graphs[i % len(graphs)].replay()
            e.record()
        torch.cuda.synchronize()
        del graphs
        times = [s.elapsed_time(e) * 1e3 for s, e in ev]
        return statistics.median(times[2:] if len(times) > 4 else times)

    def eager_us(self, fns: list[Callable[[], None]], budget_s: float = 0.05, max_calls: int = 400) -> float:
        """Wall-clock per call, calls back to back (CPU launch cost included, as in eager serving)."""
        torch = self.torch
        for fn in fns[:4]:
            fn()
        torch.cuda.synchronize()
        samples, t_end, calls = [], time.perf_counter() + budget_s, 0
        fns = fns[:16]
        while calls < max_calls and (calls < 2 * len(fns) or time.perf_counter() < t_end):
            t0 = time.perf_counter()
            for fn in fns:
                fn()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) * 1e6 / len(fns))
            calls += len(fns)
        return statistics.median(samples)


def footprint(n_distinct: int, batch: int, shape: Shape, elem: int = 2) -> int:
    """Bytes one call must move: distinct A and B once, x once, y read and written."""
    return (n_distinct * shape.rank * (shape.in_dim + shape.out_dim) + batch * (shape.in_dim + 2 * shape.out_dim)) * elem


def floor_us(n_distinct: int, batch: int, shape: Shape, bandwidth: float) -> float:
    """The call's bytes (footprint) at `bandwidth` bytes/s, in us."""
    return footprint(n_distinct, batch, shape) / bandwidth * 1e6


def run_shape(shape: Shape, batches, workloads, impls_wanted, slots: int, cold_reps: int, timer: Timer,
              bandwidth: float, log) -> list[dict]:
    import numpy as np
    import torch

    from lorafleet.runner.lora.segments import build_segments

    dev, dtype = "cuda", torch.bfloat16
    S = slots  # far bigger than L2: rotations of adapter sets come back to a set only after >= S adapters
    gen = torch.Generator(device=dev).manual_seed(0)
    pool_a = (torch.randn(S, shape.rank, shape.in_dim, generator=gen, device=dev) / math.sqrt(shape.in_dim)).to(dtype)
    pool_b = (torch.randn(S, shape.rank, shape.out_dim, generator=gen, device=dev) / math.sqrt(shape.rank)).to(dtype)
    host_ranks = [[shape.rank] * S]
    ranks = torch.tensor(host_ranks, dtype=torch.int32, device=dev)
    impls = _make_impls(pool_a, pool_b, ranks, host_ranks)
    v = torch.empty(max(batches), 1, shape.rank, device=dev)
    results = []
    for workload in workloads:
        for batch in batches:
            rng = np.random.default_rng(batch * 7 + len(workload))
            adapters = sorted(assign(workload, batch, max(batches), rng))
            distinct = sorted(set(adapters))
            n_distinct = len(distinct)
            # N calls touching > 150 MB in total (N <= 512), each on the next n_distinct slots
            rotations = max(2, min(512, math.ceil(150e6 / footprint(n_distinct, batch, shape))))
            rotations = min(rotations, max(2, S // n_distinct))
            cases = []
            for rot in range(rotations):
                base = rot * n_distinct
                row_slots = [(base + distinct.index(a)) % S for a in adapters]
                seg = build_segments(row_slots, device=dev, capacity=batch)
                y = torch.randn(batch, shape.out_dim, device=dev).to(dtype)
                cases.append(Case(
                    x=torch.randn(batch, shape.in_dim, device=dev).to(dtype),
                    y=y, v=v[:batch], row_slots=row_slots, seg=seg,
                    row_idx=torch.tensor(row_slots, dtype=torch.int64, device=dev),
                    seg_slots=torch.tensor(seg.host_slots, dtype=torch.int64, device=dev),
                    seg_ends=torch.tensor(seg.host_indptr[1:], dtype=torch.int32, device=dev),
                    y_init=y.clone(),
                ))
            rec = {"shape": shape.name, "in": shape.in_dim, "out": shape.out_dim, "rank": shape.rank,
                   "dtype": "bf16", "workload": workload, "batch": batch, "distinct_adapters": n_distinct,
                   "calls_per_graph": rotations, "floor_us": floor_us(n_distinct, batch, shape, bandwidth), "us": {},
                   "rel_err": {}}
            c0 = cases[0]
            want = _reference(c0, pool_a, pool_b, shape.rank)
            for name in impls_wanted:
                if name not in impls:
                    continue
                c0.y.copy_(c0.y_init)
                c0.y0 = c0.y_init
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
                if name.startswith("cuda") and not err < 2e-2:
                    raise SystemExit(f"WRONG RESULT: cuda kernels on {shape.name} {workload} batch={batch}: "
                                     f"relative error {err:.3e}")
                fns = [impls[name](c) for c in cases]
                try:
                    entry = {"graph": timer.graph_us(fns), "graph_cold": timer.graph_cold_us(fns, cold_reps),
                             "eager": timer.eager_us(fns)}
                except Exception as exc:  # e.g. a peer that cannot be captured in a graph
                    if name == "cuda":
                        raise
                    torch.cuda.synchronize()
                    rec["us"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
                    continue
                if not err < 2e-2:
                    entry["wrong"] = True
                rec["us"][name] = entry
                del fns
            results.append(rec)
            log(f"{shape.name:>14} {workload:>9} {batch:>4} (N={rotations:>3}): floor {rec['floor_us']:6.2f} us  "
                + "  ".join(f"{k} {e['graph']:7.2f}/{e['graph_cold']:7.2f}/{e['eager']:7.1f}"
                            for k, e in rec["us"].items() if "error" not in e))
            del cases
            gc.collect()
            torch.cuda.empty_cache()
    return results


# Steps with prefill: segment lengths of one step (each segment its own adapter unless noted).
PREFILL_LAYOUTS = {
    "2x250+30x1": [250, 250] + [1] * 30,
    "4x120+28x1": [120] * 4 + [1] * 28,
    "8x64": [64] * 8,
    "1x600 (one adapter)": [600],
    "1x32 (decode, one adapter)": [32],
    "1x64+31x1 (64-row chunk)": [64] + [1] * 31,
    "1x256+31x1 (256-row chunk)": [256] + [1] * 31,
    "4x512+200x1 (max batch 256)": [512] * 4 + [1] * 200,
    "8x240+150x1 (max batch 256, mixed)": [240] * 8 + [1] * 150,  # like a profiled step of bench e2e --sweep 256
}
# (name, in, out of each projection): the engine's grouped calls of a Llama-2-7B layer.
GROUP_INDEX = {"qkv": 0, "o": 1, "gate_up": 2, "down": 3}  # pool.GROUP_SPANS order
PREFILL_SHAPES = (("qkv", 4096, (4096, 4096, 4096)), ("o", 4096, (4096,)), ("gate_up", 4096, (11008, 11008)),
                  ("down", 11008, (4096,)))
# shrink threshold of each variant (two launches); "fused" is the one-launch CUDA-core call (what a step
# below both thresholds launches), "engine" the call of steps with prompt rows (`add` with the group's
# GROUP_MMA_ROWS); "engine_expand_2sm" the engine's two launches with the expand held to 2 blocks per SM
# (the occupancy of the tensor-core capable bf16 expand before commit 5a6fa77, when it held 99 registers),
# only where the engine makes two launches
PREFILL_VARIANTS = {"engine": 0, "engine_expand_2sm": -2, "fused": None, "cuda_cores": 10**9, "mma>=32": 32,
                    "mma>=64": 64, "mma>=128": 128, "mma>=256": 256, "mma>=512": 512}


def run_prefill(timer: Timer, log, rank: int = 16, rotations: int = 8, layouts: str = "",
                variants: str = "") -> list[dict]:
    """Shrink + expand of one grouped projection for prefill-like segment tables, per shrink threshold
    (the expand keeps its default), against one matmul pair per segment in PyTorch. `layouts` /
    `variants`: comma-separated subsets of PREFILL_LAYOUTS (name prefixes) / PREFILL_VARIANTS."""
    import torch

    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV
    from lorafleet.runner.lora.step import GROUP_MMA_ROWS

    pick_layouts = [w.strip() for w in layouts.split(",") if w.strip()]
    pick_variants = [w.strip() for w in variants.split(",") if w.strip()]
    bad = [w for w in pick_layouts if not any(name.startswith(w) for name in PREFILL_LAYOUTS)]
    bad += [w for w in pick_variants if w not in PREFILL_VARIANTS]
    if bad:
        raise SystemExit(f"bench kernels --prefill: unknown layout or variant {', '.join(bad)} "
                         f"(layouts: {', '.join(PREFILL_LAYOUTS)}; variants: {', '.join(PREFILL_VARIANTS)})")
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(1)
    results = []
    for shape_name, in_dim, outs in PREFILL_SHAPES:
        G = len(outs)
        slots = 64
        a = [(torch.randn(slots, rank, in_dim, generator=gen, device=dev) / math.sqrt(in_dim)).to(dtype) for _ in outs]
        b = [(torch.randn(slots, rank, o, generator=gen, device=dev) / math.sqrt(rank)).to(dtype) for o in outs]
        host_ranks = [[rank] * slots for _ in outs]
        ranks = torch.tensor(host_ranks, dtype=torch.int32, device=dev)
        for layout, lengths in PREFILL_LAYOUTS.items():
            if pick_layouts and not any(layout.startswith(w) for w in pick_layouts):
                continue
            T = sum(lengths)
            cases = []
            for rot in range(rotations):
                row_slots = []
                for i, n in enumerate(lengths):
                    row_slots += [(rot * len(lengths) + i) % slots] * n
                seg = build_segments(row_slots, device=dev, capacity=len(lengths))
                x = torch.randn(T, in_dim, device=dev).to(dtype)
                ys = [torch.randn(T, o, device=dev).to(dtype) for o in outs]
                v = torch.empty(T, G, rank, device=dev)
                cases.append((x, ys, v, seg, row_slots, [y.clone() for y in ys]))
            # fp64 reference of the add-on, first rotation
            x, ys, v, seg, row_slots, y0 = cases[0]
            rows = SimpleNamespace(x=x, row_slots=row_slots)
            want = [_reference(rows, a[g], b[g], rank) for g in range(G)]
            rec = {"shape": shape_name, "layout": layout, "rows": T, "segments": len(lengths), "rank": rank,
                   "us": {}, "rel_err": {}}
            for variant, thr in PREFILL_VARIANTS.items():
                if pick_variants and variant not in pick_variants:
                    continue
                impl = CudaSGMV(shrink_mma_min_rows=thr if thr and thr > 0 else 64)
                group_rows = GROUP_MMA_ROWS[GROUP_INDEX[shape_name]]
                if thr is not None and thr < 0 and T < min(group_rows):
                    continue  # the engine's call is the one fused launch here: no expand launch to hold

                def make(c, impl=impl, a=a, b=b, ranks=ranks, host_ranks=host_ranks, thr=thr, rows=group_rows):
                    def fn():
                        if thr is None:
                            impl.add(c[1], c[2], c[0], a, b, ranks, host_ranks, c[3], mma=False)
                            return
                        if thr == 0:
                            impl.add(c[1], c[2], c[0], a, b, ranks, host_ranks, c[3], mma_rows=rows)
                            return
                        if thr < 0:  # the engine's two launches, the expand held to -thr blocks per SM
                            impl.shrink(c[2], c[0], a, ranks, host_ranks, c[3], mma_min_rows=rows[0])
                            impl.expand(c[1], c[2], b, ranks, host_ranks, c[3], mma_min_rows=rows[1],
                                        blocks_per_sm=-thr)
                            return
                        impl.shrink(c[2], c[0], a, ranks, host_ranks, c[3])
                        impl.expand(c[1], c[2], b, ranks, host_ranks, c[3])
                    return fn
                for g in range(G):
                    ys[g].copy_(y0[g])
                make(cases[0])()
                torch.cuda.synchronize()
                err = max(((ys[g].double() - y0[g].double() - want[g]).norm() / want[g].norm()).item() for g in range(G))
                rec["rel_err"][variant] = err
                if not err < 2e-2:
                    raise SystemExit(f"WRONG RESULT: cuda kernels ({variant}) on {shape_name} {layout}: {err:.3e}")
                rec["us"][variant] = timer.graph_us([make(c) for c in cases])

            def loop(c, a=a, b=b, G=G):
                segs = [(s, lo, hi) for s, lo, hi in zip(c[3].host_slots, c[3].host_indptr, c[3].host_indptr[1:])]

                def fn():
                    for s, lo, hi in segs:
                        for g in range(G):
                            c[1][g][lo:hi] += (c[0][lo:hi] @ a[g][s].T) @ b[g][s]
                return fn
            rec["us"]["loop"] = timer.graph_us([loop(c) for c in cases])
            results.append(rec)
            log(f"{shape_name:>5} {layout:>28} T={T:>4}: " + "  ".join(f"{k} {u:7.1f}" for k, u in rec["us"].items()))
            del cases
            gc.collect()
    return results


def prefill_table(results: list[dict]) -> str:
    names = [n for n in list(PREFILL_VARIANTS) + ["loop"] if any(n in r["us"] for r in results)]
    lines = ["| projection | segments | rows | " + " | ".join(names) + " |",
             "|---|---|---:|" + "---:|" * len(names)]
    for r in results:
        lines.append(f"| {r['shape']} | {r['layout']} | {r['rows']} | "
                     + " | ".join(f"{r['us'][n]:.1f}" if n in r["us"] else "–" for n in names) + " |")
    return "\n".join(lines)


def headline(results: list[dict], card: str, date: str) -> dict:
    graph_us: dict[str, dict[str, float]] = {}
    for r in results:
        if r["shape"] == HEADLINE and "graph" in r["us"].get("cuda", {}):
            graph_us.setdefault(r["workload"], {})[str(r["batch"])] = round(r["us"]["cuda"]["graph"], 3)
    return {"card": card, "date": date, "shape": "4096->4096 r=16 bf16, one projection, shrink+expand, CUDA graph",
            "graph_us": graph_us}


def table(results: list[dict], shape_name: str, bandwidth: float) -> str:
    rows = [r for r in results if r["shape"] == shape_name]
    if not rows:
        return ""
    extra = sorted({n for r in rows for n in r["us"]} - set(IMPLS))
    names = [n for n in IMPLS if any(n in r["us"] for r in rows)] + extra
    head = (f"{shape_name}: us per call. graph = steady state in a CUDA graph (cold weights); cold = one replay "
            f"after an L2 flush; floor = bytes / {bandwidth / 1e12:.2f} TB/s; ! = wrong result")
    cols = "workload  batch  floor   cuda graph  cold eager" + "".join(f"{n + ' graph':>17}" for n in names[1:])
    lines = [head, cols]
    for r in rows:
        ours = r["us"].get("cuda", {})
        cells = f"{ours.get('graph', float('nan')):11.2f} {ours.get('graph_cold', float('nan')):5.1f} "
        cells += f"{ours.get('eager', float('nan')):5.0f}"
        for n in names[1:]:
            e = r["us"].get(n)
            cells += f"{'-':>17}" if not e or "error" in e else f"{e['graph']:16.1f}{'!' if e.get('wrong') else ' '}"
        lines.append(f"{r['workload']:<9} {r['batch']:>5} {r['floor_us']:6.2f} " + cells)
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
    from lorafleet.cli import HelpFormatter

    p = argparse.ArgumentParser(prog="lorafleet bench kernels", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=cli_args.output_file, default=Path("bench_kernels.json"),
                   help="full results as JSON (default: bench_kernels.json)")
    p.add_argument("--plot", default="bench_kernels.png", help="latency-vs-batch PNG, needs matplotlib ('': none)")
    p.add_argument("--quick", action="store_true", help="headline shape only, fewer batch sizes")
    p.add_argument("--shapes", default="", help=f"comma-separated subset of {','.join(s.name for s in SHAPES)} "
                   "(default: all)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help="comma-separated implementations (also: cuda_nopdl, cuda_shrink, cuda_expand)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated workloads")
    p.add_argument("--batches", default="", help=f"comma-separated batch sizes (default: {','.join(map(str, BATCHES))}; "
                   "with --quick: 1,8,32,64,256)")
    p.add_argument("--reps", type=int, default=40, help="cold single-call replays timed per case")
    p.add_argument("--slots", type=int, default=1024, help="adapters in the pool")
    p.add_argument("--prefill", action="store_true",
                   help="instead: steps with prefill (long segments), qkv and down of Llama-2-7B at rank 16, "
                        "per tensor-core shrink threshold, µs per call inside a CUDA graph")
    p.add_argument("--prefill-layouts", default="", metavar="NAMES",
                   help=f"with --prefill: comma-separated layout name prefixes of {', '.join(PREFILL_LAYOUTS)} "
                        "(default: all)")
    p.add_argument("--prefill-variants", default="", metavar="NAMES",
                   help=f"with --prefill: comma-separated subset of {', '.join(PREFILL_VARIANTS)} (default: all)")


def run(args: argparse.Namespace) -> int:
    import torch

    from lorafleet.bench.rates import card_rates, describe

    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = [s for s in SHAPES if not args.shapes or s.name in args.shapes.split(",")]
    batches = (1, 8, 32, 64, 256) if args.quick else BATCHES
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
    workloads = tuple(w for w in args.workloads.split(",") if w)
    if args.quick:
        shapes = [s for s in shapes if s.name == HEADLINE] or shapes[:1]
    impls = [n for n in args.impls.split(",") if n]
    card = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    timer = Timer()
    t0 = time.time()
    if args.prefill:
        pre = run_prefill(timer, log=lambda s: print(s, flush=True), layouts=args.prefill_layouts,
                          variants=args.prefill_variants)
        doc = {"card": card, "date": date, "torch": torch.__version__, "seconds": round(time.time() - t0, 1),
               "prefill": pre}
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print("\n" + prefill_table(pre) + f"\n\nwrote {args.out} ({doc['seconds']} s, {card})")
        return 0
    rates = card_rates()
    print(f"memory floor at {describe(rates)}", flush=True)
    results = []
    for shape in shapes:
        results += run_shape(shape, batches, workloads, impls, args.slots, args.reps, timer, rates["bandwidth"],
                             log=lambda s: print(s, flush=True))
    doc = {"card": card, "date": date, "torch": torch.__version__, "cuda": torch.version.cuda,
           "bandwidth_Bps": rates["bandwidth"], "floor_rates": rates, "seconds": round(time.time() - t0, 1),
           "sgmv": headline(results, card, date), "cases": results}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    plotted = bool(args.plot) and plot(results, args.plot, card)
    print()
    for shape in shapes:
        if shape.name != HEADLINE:
            print(table(results, shape.name, rates["bandwidth"]))
            print()
    print(table(results, HEADLINE, rates["bandwidth"]) if any(s.name == HEADLINE for s in shapes) else "")
    print(f"\nwrote {args.out}" + (f" and {args.plot}" if plotted else "") + f" ({doc['seconds']} s, {card})")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

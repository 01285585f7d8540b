"""Probes of the two largest non-GEMM costs of a decode step on the GPU (Llama-2-7B shape, bf16).

1. Decode attention: flashinfer's paged decode at batch 32 over 32 layers (each layer its own cache,
   so nothing stays in L2), per context length and variant, inside a CUDA graph; µs per layer call
   and the KV bytes it moved per second.
2. LoRA beside the GEMM: the qkv GEMM of 32 rows with cuBLAS told to leave SMs free
   (torch's SM carve-out) and the fused SGMV call (32 distinct adapters) on a second stream.
3. LoRA in its neighbourhood: 32 layers of GEMMs, flashinfer norms and the LoRA calls, per LoRA variant
   (none, a bare extra launch, zero ranks, one adapter, 32 adapters, with and without PDL), and the
   launch-shape knobs of the two-launch path (shrink blocks per SM x decode rank rows, expand blocks
   per SM), which never change a result bit. `--batch 256`: the same at max batch 256.
4. A step with prompt rows at max batch 256 in its neighbourhood (`mixed`): the LoRA calls of prompt
   chunks beside one-row decode segments, per threshold and launch split.
5. The decode GEMMs per batch (`gemm`): weights as [out, in] or [in, out], cuBLAS or cuBLASLt.

    python bench/probe_decode.py --out probe.json
    python bench/probe_decode.py --out mixed.json --skip attention lora layers gemm
    python bench/probe_decode.py --out knobs.json --only distinct_two_launch_s distinct_shrink_only_s
        (only section 3, only `off` and the variants whose names start with these prefixes)
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

L, H, D = 32, 32, 128


_TIMER = []


def timer():
    """The kernel benchmark's graph timer (one per process)."""
    from lorafleet.bench.kernels import Timer

    if not _TIMER:
        _TIMER.append(Timer(flush_bytes=1 << 20))
    return _TIMER[0]


def graph_time(fn) -> float:
    """Seconds per replay of a CUDA graph holding fn()."""
    return timer().graph_us([fn]) * 1e-6


def attention(ctxs, batch: int, log) -> list[dict]:
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    dev = torch.device("cuda")
    rows = []
    for ps in (16, 64):
        for ctx in ctxs:
            pps = math.ceil(ctx / ps)
            P = batch * pps
            gen = torch.Generator().manual_seed(ctx)
            caches = [torch.randn(P, 2, ps, H, D, dtype=torch.bfloat16, device=dev) for _ in range(L)]
            caches = [(c[:, 0], c[:, 1]) for c in caches]  # NHD views, k and v
            perm = torch.randperm(P, generator=gen).to(torch.int32)
            indptr = torch.arange(0, P + 1, pps, dtype=torch.int32)
            last = torch.full((batch,), ctx - (pps - 1) * ps, dtype=torch.int32)
            q = torch.randn(batch, H, D, dtype=torch.bfloat16, device=dev)
            out = torch.empty_like(q)
            kv_bytes = batch * ctx * H * D * 2 * 2
            for tc in (False, True):
                ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
                w = BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_cuda_graph=True, use_tensor_cores=tc,
                    paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
                    paged_kv_indices_buffer=torch.zeros(P, dtype=torch.int32, device=dev),
                    paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=dev))
                w.plan(indptr, perm.to(dev), last, H, H, D, ps, q_data_type=torch.bfloat16,
                       kv_data_type=torch.bfloat16)

                def run():
                    for c in caches:
                        w.run(q, c, out=out)

                t = graph_time(run) / L
                r = {"page_size": ps, "ctx": ctx, "tensor_cores": tc, "us_per_layer": round(t * 1e6, 2),
                     "kv_tb_s": round(kv_bytes / t / 1e12, 2), "ms_per_step_32_layers": round(t * L * 1e3, 3)}
                log(r)
                rows.append(r)
                del w, ws
            del caches
            torch.cuda.empty_cache()
    return rows


def lora_beside_gemm(log) -> list[dict]:
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    dev = torch.device("cuda")
    T, K, N, S, R = 32, 4096, 4096, 32, 16
    bf = torch.bfloat16
    ws = [torch.randn(3 * N, K, dtype=bf, device=dev) / 64 for _ in range(L)]
    x = torch.randn(T, K, dtype=bf, device=dev)
    y = torch.empty(T, 3 * N, dtype=bf, device=dev)
    y2 = torch.zeros(T, 3 * N, dtype=bf, device=dev)
    a = [[torch.randn(S, R, K, dtype=bf, device=dev) / 64 for _ in range(3)] for _ in range(L)]
    b = [[torch.randn(S, R, N, dtype=bf, device=dev) / 64 for _ in range(3)] for _ in range(L)]
    ranks = torch.full((3, S), R, dtype=torch.int32, device=dev)
    v = torch.empty(T, 3, R, dtype=torch.float32, device=dev)
    seg = build_segments(list(range(T)), dev, capacity=T)
    sg = CudaSGMV()
    ys = list(y.view(T, 3, N).unbind(1))
    ys2 = list(y2.view(T, 3, N).unbind(1))
    hr = [[R] * S] * 3
    sg.add(ys2, v, x, a[0], b[0], ranks, hr, seg, mma=False)
    side = torch.cuda.Stream()
    rows = []

    def serial():
        for i in range(L):
            torch.matmul(x, ws[i].t(), out=y)
            sg.add(ys, v, x, a[i], b[i], ranks, hr, seg, mma=False)

    def gemm_only():
        for i in range(L):
            torch.matmul(x, ws[i].t(), out=y)

    def lora_only():
        for i in range(L):
            sg.add(ys, v, x, a[i], b[i], ranks, hr, seg, mma=False)

    def beside():
        for i in range(L):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                sg.add(ys2, v, x, a[i], b[i], ranks, hr, seg, mma=False)
            torch.matmul(x, ws[i].t(), out=y)
            torch.cuda.current_stream().wait_stream(side)
            y.add_(y2)

    for carve in (0, 8, 16, 32, 48):
        torch._C._set_sm_carveout_experimental(carve or None)
        for name, fn in (("gemm_only", gemm_only), ("lora_only", lora_only), ("serial", serial), ("beside", beside)):
            if name == "lora_only" and carve:
                continue
            if name == "serial" and carve:
                continue
            t = graph_time(fn) / L
            r = {"carveout": carve, "variant": name, "us_per_layer": round(t * 1e6, 2)}
            log(r)
            rows.append(r)
    torch._C._set_sm_carveout_experimental(None)
    return rows


class Layers:
    """32 Llama-2-7B layers over T rows in a decode step's neighbourhood: per projection group a cuBLAS
    GEMM and the LoRA part under test, flashinfer's add+RMSNorm and SiLU*up between them, every layer its
    own weights and an adapter pool of S slots (rank R), so nothing stays in L2."""

    def __init__(self, T: int, S: int, R: int = 16):
        dev, bf = torch.device("cuda"), torch.bfloat16
        Hd, I = 4096, 11008
        self.shapes = [(Hd, [Hd, Hd, Hd]), (Hd, [Hd]), (Hd, [I, I]), (I, [Hd])]  # per group: in, outs
        shapes = self.shapes
        self.W = [[torch.randn(sum(outs), k, dtype=bf, device=dev) / 64 for k, outs in shapes] for _ in range(L)]
        self.A = [[[torch.randn(S, R, k, dtype=bf, device=dev) / 64 for _ in outs] for k, outs in shapes]
                  for _ in range(L)]
        self.B = [[[torch.randn(S, R, o, dtype=bf, device=dev) / 64 for o in outs] for _k, outs in shapes]
                  for _ in range(L)]
        self.ranks = [torch.full((len(outs), S), R, dtype=torch.int32, device=dev) for _k, outs in shapes]
        self.norm_w = torch.ones(Hd, dtype=bf, device=dev)
        self.h = torch.randn(T, Hd, dtype=bf, device=dev)
        self.res = torch.randn(T, Hd, dtype=bf, device=dev)
        self.outs_buf = [torch.empty(T, sum(outs), dtype=bf, device=dev) for _k, outs in shapes]
        self.act = torch.empty(T, I, dtype=bf, device=dev)
        self.v = torch.empty(T, 3, R, dtype=torch.float32, device=dev)
        self.vs = {g: self.v.view(-1)[: T * g * R].view(T, g, R) for g in (1, 2, 3)}

    def run(self, lora, before=None) -> None:
        """One pass: lora(i, g, x, y, outs) after each GEMM; before(i, g, x, outs) ahead of it."""
        import flashinfer

        x = self.h
        for i in range(L):
            flashinfer.fused_add_rmsnorm(x, self.res, self.norm_w, 1e-5)
            for g, (k, outs) in enumerate(self.shapes):
                y = self.outs_buf[g]
                if before is not None:
                    before(i, g, x, outs)
                torch.matmul(x, self.W[i][g].t(), out=y)
                lora(i, g, x, y, outs)
                if g == 0:
                    x = self.h  # stands in for the attention output
                elif g == 1:
                    flashinfer.fused_add_rmsnorm(y, self.res, self.norm_w, 1e-5)
                    x = y
                elif g == 2:
                    flashinfer.silu_and_mul(y, out=self.act)
                    x = self.act
                else:
                    x = y

    def time(self, variants, log, extra: dict | None = None) -> list[dict]:
        """µs per layer of each (name, lora or (before, lora)) variant, and over the first one (`off`)."""
        rows, base = [], None
        for name, fn in variants:
            before, fn = fn if isinstance(fn, tuple) else (None, fn)
            t = graph_time(lambda fn=fn, before=before: self.run(fn, before)) / L
            base = t if base is None else base
            r = {**(extra or {}), "variant": name, "us_per_layer": round(t * 1e6, 2),
                 "over_off_us_per_layer": round((t - base) * 1e6, 2),
                 "over_off_ms_per_step": round((t - base) * L * 1e3, 3)}
            log(r)
            rows.append(r)
        return rows

    def timelines(self, variants, names, log, first: int, count: int) -> list[dict]:
        """Kernels first .. first + count of one pass, for the variants named in `names`."""
        rows = []
        for name, fn in variants:
            if name in names:
                before, fn = fn if isinstance(fn, tuple) else (None, fn)
                tl = timeline(lambda fn=fn, before=before: self.run(fn, before), first=first, count=count)
                log(f"timeline {name}: " + "; ".join(f"{k['kernel'][:24]} +{k['gap_us']}/{k['us']}" for k in tl))
                rows.append({"variant": name, "timeline": tl})
        return rows


def lora_in_layers(log, batch: int = 32, only: list[str] | None = None) -> list[dict]:
    """The LoRA calls of 32 decode layers in their real neighbourhood: after each cuBLAS GEMM, before
    flashinfer's PDL-launched add+RMSNorm / SiLU*up, every layer its own weights and adapter pool (so
    nothing stays in L2). µs per layer for each way of doing the LoRA part; the difference to `off` is
    what LoRA costs a decode step, which isolates the fixed per-call cost (`zero_ranks`: launch and
    table only; `identical`: one adapter, ~no bytes) from the bytes (`distinct`).

    `{mix}_two_launch_s{bps}_r{rb}` / `{mix}_shrink_only_s{bps}_r{rb}`: the shrink with at most `bps`
    blocks per SM and `rb` rank rows per item of one-row segments (`identical` is one 32-row segment,
    which `rb` does not touch); `{mix}_two_launch_e{bps}`: the expand with at most `bps` blocks per SM.
    `only`: time `off` and just the variants whose names start with one of these prefixes."""
    from lorafleet.runner.lora.pool import GROUP_SPANS
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    dev = torch.device("cuda")
    T = batch
    lay = Layers(T, S=max(64, T))  # a slot per row: `distinct` reads every adapter once per layer
    A, B, ranks, vs, h, outs_buf = lay.A, lay.B, lay.ranks, lay.vs, lay.h, lay.outs_buf
    v = lay.v
    zero = [torch.zeros_like(r) for r in ranks]
    segs = {"distinct": build_segments(list(range(T)), dev, capacity=T),
            "identical": build_segments([0] * T, dev, capacity=T)}
    assert [g for _p, g in GROUP_SPANS] == [len(o) for _k, o in lay.shapes]

    side = torch.cuda.Stream()

    def sgmv_call(sg, seg, rk, mma=False):
        def call(i, g, x, y, outs):
            ys = list(y.split(outs, dim=1))
            sg.add(ys, vs[len(outs)], x, A[i][g], B[i][g], rk[g], None, seg, mma, (1 << 30, 1 << 30))
        return call

    def side_shrink(sg, seg, rk, cap=0, groups=(0, 1, 2, 3)):
        """The shrink on a second stream beside the GEMM (it needs only x), at most `cap` blocks, the
        expand after both; groups not in `groups` run shrink and expand after the GEMM."""
        def before(i, g, x, outs):
            if g in groups:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    sg.shrink(vs[len(outs)], x, A[i][g], rk[g], None, seg, max_blocks=cap)

        def after(i, g, x, y, outs):
            if g in groups:
                torch.cuda.current_stream().wait_stream(side)
            else:
                sg.shrink(vs[len(outs)], x, A[i][g], rk[g], None, seg)
            sg.expand(list(y.split(outs, dim=1)), vs[len(outs)], B[i][g], rk[g], None, seg)
        return before, after

    def extra_launch(i, g, x, y, outs):
        v.view(-1)[:1].zero_()

    fused, nopdl = CudaSGMV(), CudaSGMV(pdl=False)
    variants = [("off", lambda *a: None), ("extra_launch", extra_launch),
                ("zero_ranks", sgmv_call(fused, segs["distinct"], zero)),
                ("identical", sgmv_call(fused, segs["identical"], ranks)),
                ("distinct", sgmv_call(fused, segs["distinct"], ranks)),
                ("identical_nopdl", sgmv_call(nopdl, segs["identical"], ranks)),
                ("distinct_nopdl", sgmv_call(nopdl, segs["distinct"], ranks))]
    big = 1 << 30
    two = CudaSGMV(shrink_mma_min_rows=big, expand_mma_min_rows=big)
    for mix in ("identical", "distinct"):
        seg = segs[mix]
        variants.append((f"{mix}_side", side_shrink(two, seg, ranks)))
        for cap in (8, 16, 32):
            variants.append((f"{mix}_side_wide_cap{cap}", side_shrink(two, seg, ranks, cap, (0, 2))))
        variants.append((f"{mix}_side_all_cap16", side_shrink(two, seg, ranks, 16)))
        variants.append((f"{mix}_two_launch", lambda i, g, x, y, outs, seg=seg: (
            two.shrink(vs[len(outs)], x, A[i][g], ranks[g], None, seg),
            two.expand(list(y.split(outs, dim=1)), vs[len(outs)], B[i][g], ranks[g], None, seg))))
        variants.append((f"{mix}_shrink_only", lambda i, g, x, y, outs, seg=seg: two.shrink(
            vs[len(outs)], x, A[i][g], ranks[g], None, seg)))
        variants.append((f"{mix}_expand_only", lambda i, g, x, y, outs, seg=seg: two.expand(
            list(y.split(outs, dim=1)), vs[len(outs)], B[i][g], ranks[g], None, seg)))
        # launch-shape knobs (the same bits as the default calls): shrink blocks per SM x decode rank rows
        for bps in (2, 3, 4):
            for rb in (1, 2, 4):
                variants.append((f"{mix}_two_launch_s{bps}_r{rb}", lambda i, g, x, y, outs, seg=seg, bps=bps, rb=rb: (
                    two.shrink(vs[len(outs)], x, A[i][g], ranks[g], None, seg, blocks_per_sm=bps, decode_ranks=rb),
                    two.expand(list(y.split(outs, dim=1)), vs[len(outs)], B[i][g], ranks[g], None, seg))))
        for bps in (2, 3, 4):
            for rb in (1, 2, 4):
                variants.append((f"{mix}_shrink_only_s{bps}_r{rb}", lambda i, g, x, y, outs, seg=seg, bps=bps, rb=rb:
                                 two.shrink(vs[len(outs)], x, A[i][g], ranks[g], None, seg, blocks_per_sm=bps,
                                            decode_ranks=rb)))
        for ebps in (2, 3):  # expand blocks per SM, default shrink
            variants.append((f"{mix}_two_launch_e{ebps}", lambda i, g, x, y, outs, seg=seg, ebps=ebps: (
                two.shrink(vs[len(outs)], x, A[i][g], ranks[g], None, seg),
                two.expand(list(y.split(outs, dim=1)), vs[len(outs)], B[i][g], ranks[g], None, seg,
                           blocks_per_sm=ebps))))
    if only:  # `off` first: the baseline of every other row
        variants = [(n, f) for n, f in variants if n == "off" or any(n.startswith(p) for p in only)]
    for seg in segs.values():  # counters, extension load
        fused.add([outs_buf[1]], vs[1], h, A[0][1], B[0][1], ranks[1], None, seg, False)
        nopdl.add([outs_buf[1]], vs[1], h, A[0][1], B[0][1], ranks[1], None, seg, False)
    rows = lay.time(variants, log)
    rows += lay.timelines(variants, ("off", "identical", "distinct_two_launch", "identical_side_wide_cap16",
                                     "distinct_side_wide_cap16"), log, first=40, count=22)
    return rows  # the tensors go with the frame; main() empties the cache after each section


def lora_mixed_in_layers(log, layout: str = "8x240+150x1") -> list[dict]:
    """A step with prompt rows at max batch 256 in its neighbourhood: 32 layers of GEMMs over all rows,
    flashinfer norms and the LoRA calls, every segment its own adapter (prompt chunks of `layout`'s
    long segments, one-row decode segments; the pool has a slot per segment and every layer its own
    weights, so, as in the engine, no adapter stays in L2). µs per layer over `off`, per way of
    launching the LoRA calls:

    `engine`: one shrink and one expand per group with the engine's thresholds (step.GROUP_MMA_ROWS);
    `mma129`: every group takes tensor cores from 129 rows (o and down too);
    `split`, `split_mma129`: the same per-segment paths, but two tables: the long segments in the
    tensor-core capable launches, the one-row segments in CUDA-core launches of their own (4 blocks
    per SM, 1 x 2 decode items), four launches per group;
    `*_shrink_only`, `*_expand_only`: attribution. Then one layer's kernel timeline per variant."""
    from lorafleet.runner.lora.segments import build_segments
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV
    from lorafleet.runner.lora.step import GROUP_MMA_ROWS

    dev = torch.device("cuda")
    lengths = []
    for part in layout.split("+"):
        n, rows = part.split("x")
        lengths += [int(rows)] * int(n)
    T, S = sum(lengths), len(lengths)
    lay = Layers(T, S)
    A, B, ranks, vs = lay.A, lay.B, lay.ranks, lay.vs
    row_slots = [s for s, n in enumerate(lengths) for _ in range(n)]
    seg = build_segments(row_slots, dev, capacity=S)

    def part(keep) -> object:  # the same rows, with the slots of the segments not kept set to -1
        t = build_segments(row_slots, dev, capacity=S)
        t.slots.copy_(torch.tensor([s if keep(n) else -1 for s, n in enumerate(lengths)], dtype=torch.int32))
        return t

    big = 1 << 30
    sg = CudaSGMV()

    def call(thr_of, split: bool, halves=("shrink", "expand")):
        tables = {}
        for g in range(4):
            thr = thr_of(g)
            if split and thr not in tables:
                tables[thr] = (part(lambda n, thr=thr: n >= thr[0]), part(lambda n, thr=thr: n < thr[0]))

        def fn(i, g, x, y, outs):
            ys = list(y.split(outs, dim=1))
            thr, vg = thr_of(g), vs[len(outs)]
            launches = [(tables[thr][0], thr), (tables[thr][1], (big, big))] if split else [(seg, thr)]
            for t, (st, et) in launches:
                if "shrink" in halves:
                    sg.shrink(vg, x, A[i][g], ranks[g], None, t, mma_min_rows=st)
            for t, (st, et) in launches:
                if "expand" in halves:
                    sg.expand(ys, vg, B[i][g], ranks[g], None, t, mma_min_rows=et)
        return fn

    engine = lambda g: GROUP_MMA_ROWS[g]  # noqa: E731
    mma129 = lambda g: (129, 129)  # noqa: E731
    variants = [("off", lambda *a: None)]
    for vname, thr, split in (("engine", engine, False), ("split", engine, True), ("mma129", mma129, False),
                              ("split_mma129", mma129, True)):
        variants.append((vname, call(thr, split)))
        variants.append((vname + "_shrink_only", call(thr, split, ("shrink",))))
        variants.append((vname + "_expand_only", call(thr, split, ("expand",))))
    rows = lay.time(variants, log, {"layout": layout, "rows": T})
    rows += lay.timelines(variants, ("engine", "split", "mma129", "split_mma129"), log, first=20, count=24)
    return rows  # the tensors go with the frame; main() empties the cache after each section


def gemm_layouts(log, batches=(32, 64, 128, 256)) -> list[dict]:
    """The decode GEMMs of the Llama-2-7B shapes, 32 layers (every layer its own weights, so nothing stays
    in L2), per batch and way of calling cuBLAS: `linear` = x @ W.T on the [out, in] weights (what the
    model calls), `mm_t` = x @ Wt on weights stored as [in, out]; each with torch's default BLAS backend
    and with cuBLASLt preferred (`*_lt`). µs per call, and weight bytes per second."""
    from lorafleet.runner.model.ops import prefer_cublaslt

    dev, bf = torch.device("cuda"), torch.bfloat16
    shapes = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
    rows = []
    for name, (n, k) in shapes.items():
        W = [torch.randn(n, k, dtype=bf, device=dev) / 64 for _ in range(L)]
        WT = [w.t().contiguous() for w in W]
        for b in batches:
            x = torch.randn(b, k, dtype=bf, device=dev)
            y = torch.empty(b, n, dtype=bf, device=dev)
            ways = {"linear": [lambda w=w: torch.matmul(x, w.t(), out=y) for w in W],
                    "mm_t": [lambda w=w: torch.mm(x, w, out=y) for w in WT]}
            for lib in ("default", "cublaslt"):
                for way, fns in ways.items():
                    if lib == "cublaslt":
                        with prefer_cublaslt():
                            t = timer().graph_us(fns) * 1e-6
                    else:
                        t = timer().graph_us(fns) * 1e-6
                    r = {"gemm": name, "batch": b, "way": way + ("_lt" if lib == "cublaslt" else ""),
                         "us": round(t * 1e6, 2), "weight_tb_s": round(n * k * 2 / t / 1e12, 2)}
                    log(r)
                    rows.append(r)
        del W, WT
        torch.cuda.empty_cache()
    for b in batches:  # per layer: the four GEMMs
        per = {}
        for r in rows:
            if r["batch"] == b:
                per[r["way"]] = per.get(r["way"], 0.0) + r["us"]
        log(f"batch {b}: µs per layer " + ", ".join(f"{w} {u:.1f}" for w, u in per.items()))
        rows.append({"batch": b, "us_per_layer": {w: round(u, 2) for w, u in per.items()}})
    return rows


def timeline(fn, first: int, count: int) -> list[dict]:
    """Kernels `first` .. `first + count` of one replay of a CUDA graph holding fn(), from the profiler:
    name, gap after the previous kernel's end and duration (µs)."""
    from torch.profiler import ProfilerActivity, profile

    t = timer()
    t._warm([fn])
    g = t._capture([fn])
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    out, prev_end = [], None
    for e in ev[first: first + count]:
        st, en = e.time_range.start, e.time_range.end
        short = e.name.removeprefix("void ").split("<")[0].split("::")[-1].split("(")[0]
        out.append({"kernel": short[:40], "gap_us": round(st - prev_end, 2) if prev_end is not None else None,
                    "us": round(en - st, 2)})
        prev_end = en if prev_end is None else max(prev_end, en)
    del g
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, nargs="+", default=[150, 370, 1000])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", default="probe.json")
    p.add_argument("--skip", nargs="*", default=[], choices=["attention", "lora", "layers", "mixed", "gemm"])
    p.add_argument("--mixed-layout", default="8x240+150x1",
                   help="segments of the `mixed` probe's step: COUNTxROWS parts joined by + (default %(default)s)")
    p.add_argument("--only", nargs="+", default=None, metavar="PREFIX",
                   help="run only the `layers` probe, and in it only `off` and the variants whose names start "
                        "with one of these prefixes (e.g. distinct_two_launch_s distinct_shrink_only_s)")
    args = p.parse_args()
    t0 = time.time()

    def log(m):
        print(f"[{time.time() - t0:6.1f}s] {m}", flush=True)

    res = {"card": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save() -> None:  # after every section: a run cut short keeps what finished
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    sections = (("layers", "lora_in_layers", lambda: lora_in_layers(log, args.batch, args.only)),
                ("mixed", "lora_mixed_in_layers", lambda: lora_mixed_in_layers(log, args.mixed_layout)),
                ("gemm", "gemm_layouts", lambda: gemm_layouts(log)),
                ("lora", "lora_beside_gemm", lambda: lora_beside_gemm(log)),
                ("attention", "attention", lambda: attention(args.ctx, args.batch, log)))
    for name, key, run in sections:
        if name in args.skip or (args.only and name != "layers"):
            continue
        try:
            res[key] = run()
        except Exception as e:  # report and go on to the next probe
            log(f"{name} probe failed: {e!r}")
        save()
        torch.cuda.empty_cache()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

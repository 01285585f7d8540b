"""Probes of the two largest non-GEMM costs of a decode step on the GPU (Llama-2-7B shape, bf16).

1. Decode attention: flashinfer's paged decode at batch 32 over 32 layers (each layer its own cache,
   so nothing stays in L2), per context length and variant, inside a CUDA graph; µs per layer call
   and the KV bytes it moved per second.
2. LoRA beside the GEMM: the qkv GEMM of 32 rows with cuBLAS told to leave SMs free
   (torch's SM carve-out) and the fused SGMV call (32 distinct adapters) on a second stream.
3. The decode GEMMs per batch (`gemm`): weights as [out, in] or [in, out], cuBLAS or cuBLASLt.

The LoRA calls inside whole layers are measured on the engine's own layer loop by `lorafleet bench e2e
--profile` (per-step device time by kernel category).

    python bench/probe_decode.py --out probe.json
    python bench/probe_decode.py --out gemm.json --skip attention lora
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


def graph_decoder(indptr, indices, last, heads: int, kv_heads: int, D: int, page_size: int, kv_dtype, tc: bool,
                  no_split: bool = False):
    """flashinfer's decode wrapper with fixed buffers (as the engine's CUDA graphs hold it), planned for this CSR page
    table (host indptr / last, device indices) with bf16 queries; `no_split` (tensor cores only): every request's K/V
    one chunk, as batch-invariant engines plan it (KernelChoices.decode_no_split)."""
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    dev, batch = indices.device, last.numel()
    w = BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(256 << 20, dtype=torch.uint8, device=dev), "NHD", use_cuda_graph=True, use_tensor_cores=tc,
        paged_kv_indptr_buffer=torch.zeros(batch + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buffer=torch.zeros(indices.numel(), dtype=torch.int32, device=dev),
        paged_kv_last_page_len_buffer=torch.zeros(batch, dtype=torch.int32, device=dev))
    w.plan(indptr, indices, last, heads, kv_heads, D, page_size, q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
           **({"disable_split_kv": True} if no_split else {}))
    return w


def attention(ctxs, batch: int, log) -> list[dict]:
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
                w = graph_decoder(indptr, perm.to(dev), last, H, H, D, ps, torch.bfloat16, tc)

                def run():
                    for c in caches:
                        w.run(q, c, out=out)

                t = graph_time(run) / L
                r = {"page_size": ps, "ctx": ctx, "tensor_cores": tc, "us_per_layer": round(t * 1e6, 2),
                     "kv_tb_s": round(kv_bytes / t / 1e12, 2), "ms_per_step_32_layers": round(t * L * 1e3, 3)}
                log(r)
                rows.append(r)
                del w
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, nargs="+", default=[150, 370, 1000])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", default="probe.json")
    p.add_argument("--skip", nargs="*", default=[], choices=["attention", "lora", "gemm"])
    args = p.parse_args()
    t0 = time.time()

    def log(m):
        print(f"[{time.time() - t0:6.1f}s] {m}", flush=True)

    res = {"card": torch.cuda.get_device_name(), "torch": torch.__version__}

    def save() -> None:  # after every section: a run cut short keeps what finished
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    sections = (("gemm", "gemm_layouts", lambda: gemm_layouts(log)),
                ("lora", "lora_beside_gemm", lambda: lora_beside_gemm(log)),
                ("attention", "attention", lambda: attention(args.ctx, args.batch, log)))
    for name, key, run in sections:
        if name in args.skip:
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

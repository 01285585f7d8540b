"""Probes of the two largest non-GEMM costs of a decode step on the GPU (Llama-2-7B shape, bf16).

1. Decode attention: flashinfer's paged decode at batch 32 over 32 layers (each layer its own cache,
   so nothing stays in L2), per context length and variant, inside a CUDA graph; µs per layer call
   and the KV bytes it moved per second.
2. LoRA beside the GEMM: the qkv GEMM of 32 rows with cuBLAS told to leave SMs free
   (torch's SM carve-out) and the fused SGMV call (32 distinct adapters) on a second stream.

    python bench/probe_decode.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

L, H, D = 32, 32, 128


_TIMER = []


def graph_time(fn) -> float:
    """Seconds per replay of a CUDA graph holding fn() (the kernel benchmark's timer)."""
    from lorafleet.runner.bench_kernels import Timer

    if not _TIMER:
        _TIMER.append(Timer(flush_bytes=1 << 20))
    return _TIMER[0].graph_us([fn]) * 1e-6


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, nargs="+", default=[150, 370, 1000])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", default="probe.json")
    p.add_argument("--skip", nargs="*", default=[], choices=["attention", "lora"])
    args = p.parse_args()
    t0 = time.time()

    def log(m):
        print(f"[{time.time() - t0:6.1f}s] {m}", flush=True)

    res = {"card": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "lora" not in args.skip:
        try:
            res["lora_beside_gemm"] = lora_beside_gemm(log)
        except Exception as e:  # report and go on to the next probe
            log(f"lora probe failed: {e!r}")
    if "attention" not in args.skip:
        res["attention"] = attention(args.ctx, args.batch, log)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

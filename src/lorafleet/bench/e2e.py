"""`lorafleet bench e2e`: Llama-2-7B-shape serving throughput across adapter mixes, with peers.

One run on one GPU builds a 7B-shape Llama with random bf16 weights (no download) and
rank-16 adapters on all 7 projections (a population of distinct weight sets; request i of
the distinct mix uses its own adapter name, names beyond the population reuse weights but
load as their own adapters). Requests have ShareGPT-like lengths (lognormal, fixed seed;
means about 250 prompt and 235 output tokens), EOS is ignored, and all are submitted at
t=0 (FCFS, max batch 32). Peers in the same run: the same engine with LoRA off, and HF
transformers + PEFT mixed-adapter `generate` on a sample of requests.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from lorafleet.bench.rates import REFERENCE, card_rates, describe
from lorafleet.common import cli_args
from lorafleet.common.workloads import assign, sharegpt_requests  # noqa: F401 (re-exported)
from lorafleet.models import registry
from lorafleet.runner.model import synthetic
from lorafleet.scheduler.simulate import fit_step_model

# The families' benchmark shapes (lorafleet.models.*.SHAPES). Llama-2's context is 16k (not 4k) so that the
# long-prompt interference run fits 8k-token prompts (RoPE is unscaled: the weights are random anyway).
SHAPES = registry.shapes()
for _name in ("llama2-7b", "llama2-70b"):
    SHAPES[_name] = dict(SHAPES[_name], max_position_embeddings=16384)
LLAMA2_7B = SHAPES["llama2-7b"]
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def floor_model(cfg, rank: int, dtype_bytes: int = 2, tp: int = 1, proj_bytes: int | None = None,
                kv_bytes: int | None = None, rates: dict | None = None) -> dict:
    """Bytes and FLOPs that any engine must spend per step, from the model's shapes:
    every layer weight and lm_head read once per step, each attended KV token read once, each
    distinct adapter's A and B read once; 2 FLOPs per weight per token row. With tensor
    parallelism, per GPU: its 1/tp of the layers, KV and adapters, and the whole lm_head. `proj_bytes`
    / `kv_bytes`: bytes per projection weight / K-V element (1 with FP8; default `dtype_bytes`); FP8
    projections also count at twice the matmul rate (the FP8 tensor cores' dense rate over bf16's). `rates`: the
    card's copy bandwidth and bf16 matmul rate (bench/rates.py card_rates; default: the H200's measured ones)."""
    H, I, V, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    proj_bytes, kv_bytes = proj_bytes or dtype_bytes, kv_bytes or dtype_bytes
    layer = H * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * H + 3 * H * I
    adapter = rank * L * (H + cfg.q_dim + 2 * (H + cfg.kv_dim) + (cfg.q_dim + H) + 2 * (H + I) + (I + H))
    return {"weight_bytes": (L * layer // tp) * proj_bytes + V * H * dtype_bytes,
            "kv_bytes_per_token": 2 * L * cfg.kv_dim * kv_bytes // tp,
            "adapter_bytes": adapter * dtype_bytes // tp,
            "flops_per_row": 2 * L * layer // tp // (2 if proj_bytes == 1 else 1),
            "lm_head_flops": 2 * V * H,
            "bandwidth": (rates or REFERENCE)["bandwidth"], "matmul": (rates or REFERENCE)["matmul"]}


def floor_seconds(fm: dict, steps) -> float:
    """Sum over the run's steps of max(bytes / bandwidth, FLOPs / matmul rate), at the floor model's rates."""
    t = 0.0
    for pf, nd, _dt, kv, ads in steps:
        if not (pf or nd):
            continue
        nbytes = fm["weight_bytes"] + kv * fm["kv_bytes_per_token"] + ads * fm["adapter_bytes"]
        flops = (pf + nd) * fm["flops_per_row"] + nd * fm["lm_head_flops"]
        t += max(nbytes / fm["bandwidth"], flops / fm["matmul"])
    return t


def random_model(device, dtype, seed: int, fp8: bool = False):
    """The 7B-shape model with seeded random weights (the same weights a synthetic model directory gives),
    built with the environment's kernel choices (the engines made on it use the same); `fp8`: FP8 weights."""
    from lorafleet.runner.config import KernelChoices

    return synthetic.random_model(device, dtype, seed, LLAMA2_7B, name="llama-2-7b-shape", kernels=KernelChoices.from_env(),
                                  fp8=fp8)


def random_adapters(base, population: int, rank: int, dtype, device, seed: int):
    """`population` distinct rank-r adapters on all 7 projections, in pinned host memory."""
    from lorafleet.common.peft_config import AdapterSpec, ModuleLora
    from lorafleet.models.contract import PROJ_INDEX, PROJECTIONS
    from lorafleet.runner.lora.adapter import LoadedAdapter, Packed

    g = torch.Generator(device=device).manual_seed(seed)
    L = base.num_layers
    pin = torch.device(device).type == "cuda"
    spec_mods = tuple(ModuleLora(layer, p, rank, 1.0, "", "") for layer in range(L) for p in TARGETS)
    ranks = torch.zeros(L, len(PROJECTIONS), dtype=torch.int32, pin_memory=pin)
    for p in TARGETS:
        ranks[:, PROJ_INDEX[p]] = rank
    out = []
    for k in range(population):
        pa, pb, nbytes = {}, {}, 0
        for p in TARGETS:
            i, o = base.shape(p)
            for dim, dst in ((i, pa), (o, pb)):
                t = torch.empty(L, rank, dim, dtype=dtype, pin_memory=pin)
                t.copy_((torch.randn(L, rank, dim, generator=g, device=device) * 0.01).to(dtype))
                dst[PROJ_INDEX[p]] = t
                nbytes += t.numel() * t.element_size()
        weights = {(layer, p): (pa[PROJ_INDEX[p]][layer], pb[PROJ_INDEX[p]][layer]) for layer in range(L) for p in TARGETS}
        spec = AdapterSpec(f"w{k}", Path("."), None, spec_mods, nbytes, "BF16")
        out.append(LoadedAdapter(spec, weights, Packed(pa, pb, ranks, ranks.tolist())))
    return out


def write_peft_adapter(path: Path, adapter, rank: int) -> Path:
    """Save a LoadedAdapter (scaling 1) as a PEFT directory: adapter_config.json + safetensors."""
    from safetensors.torch import save_file

    ck = registry.family("llama").checkpoint
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, p), (a, bt) in adapter.weights.items():
        key = "base_model.model." + ck.module(layer, p)
        tensors[key + ".lora_A.weight"] = a.contiguous()  # [r, in]
        tensors[key + ".lora_B.weight"] = bt.t().contiguous()  # [out, r]
    save_file(tensors, str(path / "adapter_model.safetensors"))
    targets = sorted({ck.modules[p].split(".")[-1] for _, p in adapter.weights})
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets, "bias": "none",
         "base_model_name_or_path": "llama-2-7b-shape", "task_type": "CAUSAL_LM"}))
    return path


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def drive(engine, label: str, first: dict, end: dict) -> list[tuple]:
    """Step `engine` until every submitted request finished, noting each request's first-token and
    end times in `first` / `end`; returns per step (prefill tokens, decode requests, seconds, KV
    tokens attended, distinct adapters). A request that ends other than by stop/length is an error."""
    steps = []
    while engine.has_work():
        s0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        steps.append((engine.last_step[0], engine.last_step[1], now - s0, *engine.last_step_kv))
        for out in outs:
            if out.new_token_ids and out.seq_id not in first:
                first[out.seq_id] = now
            if out.finished:
                if out.finish_reason not in ("length", "stop"):
                    raise RuntimeError(f"{label}: request {out.seq_id} ended with {out.finish_reason}: {out.error}")
                end[out.seq_id] = now
    return steps


def run_mix(engine, reqs, names, weights_of, label: str, log, fm: dict | None = None) -> dict:
    """Submit everything at t0, step to completion; throughput, TTFT and TPOT. The prefix cache starts empty:
    a run never finds pages an earlier run (or the warm-up) left, so every mix computes the same prompts."""
    from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    engine.runner.phases = {}
    engine.blocks.clear_cache()
    requeued0, hits0 = engine.requeued, engine.blocks.stats["hits"]
    t0 = time.perf_counter()
    first, end, n_out = {}, {}, {}
    for i, ((ids, o), name) in enumerate(zip(reqs, names)):
        ref = AdapterRef(name, str(weights_of(i))) if name is not None else None
        engine.submit(Sequence(f"r{i}", ids, SamplingParams(max_tokens=o, ignore_eos=True), ref, arrival=float(i)))
        n_out[f"r{i}"] = o
    steps = drive(engine, label, first, end)
    wall = time.perf_counter() - t0
    total = sum(n_out.values())
    ttft = [first[k] - t0 for k in first]
    tpot = [(end[k] - first[k]) / (n_out[k] - 1) for k in end if n_out[k] > 1]
    decode_steps = [dt for pf, nd, dt, *_ in steps if pf == 0 and nd > 0]
    res = {"label": label, "requests": len(reqs), "output_tokens": total, "seconds": round(wall, 2),
           "output_tok_s": round(total / wall, 1), "ttft_p50_s": round(pct(ttft, 50), 3),
           "ttft_p99_s": round(pct(ttft, 99), 3), "tpot_p50_ms": round(1000 * pct(tpot, 50), 2),
           "tpot_p99_ms": round(1000 * pct(tpot, 99), 2), "steps": len(steps),
           "decode_step_ms_p50": round(1000 * pct(decode_steps, 50), 2),
           "evicted_and_resumed": engine.requeued - requeued0}  # KV pages ran out: re-prefilled later
    # Where the wall time went: decode-only steps, steps with prefill, steps that ran nothing.
    split = {"decode": [0, 0.0], "mixed": [0, 0.0], "idle": [0, 0.0]}
    for pf, nd, dt, *_ in steps:
        k = "mixed" if pf else ("decode" if nd else "idle")
        split[k][0] += 1
        split[k][1] += dt
    res["time_split"] = {k: {"steps": n, "seconds": round(t, 3), "ms_per_step": round(1000 * t / max(n, 1), 3)}
                         for k, (n, t) in split.items()}
    res["prefill_tokens"] = sum(st[0] for st in steps)
    res["prompt_tokens_cached"] = engine.blocks.stats["hits"] - hits0  # shared within the run only
    if fm is not None:
        fl = floor_seconds(fm, steps)
        res["floor_tok_s"] = round(total / fl, 1) if fl else None
        res["floor_fraction"] = round(fl / wall, 3)
    # (per launch of each kind: a step of a batch-invariant engine with decode and prompt rows is two launches)
    res["runner_phases_ms"] = {k: {"prepare": round(1000 * a / n, 3), "launch": round(1000 * b / n, 3),
                                   "wait_and_sample": round(1000 * c / n, 3), "launches": n}
                               for k, (a, b, c, n) in engine.runner.phases.items()}
    engine.runner.phases = None
    floor = f" ({res['floor_fraction']:.0%} of the floor {res['floor_tok_s']:.0f})" if res.get("floor_tok_s") else ""
    log(f"{label:>28}: {res['output_tok_s']:8.1f} tok/s{floor}  TTFT p50 {res['ttft_p50_s']:.2f}s p99 {res['ttft_p99_s']:.2f}s"
        f"  TPOT p50 {res['tpot_p50_ms']:.1f}ms p99 {res['tpot_p99_ms']:.1f}ms  ({wall:.1f}s)"
        + (f"  {res['evicted_and_resumed']} evicted and resumed" if res["evicted_and_resumed"] else ""))
    log(" " * 30 + "  ".join(f"{k} {v['steps']} x {v['ms_per_step']:.2f}ms" for k, v in res["time_split"].items())
        + "  | " + "  ".join(f"{k}: prep {v['prepare']:.2f} launch {v['launch']:.2f} wait {v['wait_and_sample']:.2f}"
                             for k, v in res["runner_phases_ms"].items()))
    res["_steps"] = steps
    return res


def profile_breakdown(engine, reqs, log, source_of=str, mixed_steps: int = 4, fm: dict | None = None,
                      identical: bool = False, lora: bool = True, context: int | None = None) -> dict:
    """GPU time per category over decode steps at full batch, vs wall time (the rest is host). With
    `mixed_steps`, first up to that many steps while the batch fills (from half of it decoding on, while
    prompts wait, so that each carries prompt rows beside decodes) -> `mixed`, with each profiled step's
    rows; a profiled step that carried no prompt rows is logged as such. Every request its own adapter, or
    (`identical`) all the same one; with the floor model `fm`, `lora_bytes_ms`: the time its adapters' bytes
    take at the floor's bandwidth, beside `lora_sgmv`. `lora=False`: no adapters (an engine without LoRA).
    `context`: each profiled request's prompt, in tokens (its own, repeated where shorter), so that the decode steps
    are profiled a few tokens past this context; None: its first 128 tokens."""
    from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence

    full = min(engine.config.max_batch_size, len(reqs))
    tag = "prof-same" if identical else "prof"
    for i, (ids, _) in enumerate(reqs[:full]):
        k = 0 if identical else i
        prompt = ids[:128] if context is None else (list(ids) * -(-context // max(1, len(ids))))[:context]
        engine.submit(Sequence(f"{tag}{i}", prompt, SamplingParams(max_tokens=200, ignore_eos=True),
                               AdapterRef(f"{tag}-{k}", source_of(k)) if lora else None))
    mixed = None
    for _ in range(2000):  # until every request is admitted (adapter loads) and decoding
        engine.step()
        if not engine.batcher.waiting and len(engine.batcher.running) == full:
            break
        decoding = sum(1 for s in engine.batcher.running if not s.prefilling)
        if mixed is None and mixed_steps and engine.batcher.waiting and decoding >= max(1, full // 2):
            mixed = profile_steps(engine, mixed_steps, while_=lambda: bool(engine.batcher.waiting))
    for _ in range(3):
        engine.step()
    out = profile_steps(engine, 10)
    out["wall_ms_unprofiled"] = timed_steps(engine, 10)
    if fm is not None and lora:
        out["adapters_per_step"] = 1 if identical else full
        out["lora_bytes_ms"] = round(1000 * out["adapters_per_step"] * fm["adapter_bytes"] / fm["bandwidth"], 3)
    if mixed is not None:
        out["mixed"] = mixed
    while engine.has_work():
        engine.step()
    for label, prof in (("decode step", out), ("step with prompt rows", mixed)):
        if prof is not None:
            log(f"per {label} (ms): {figures_line(prof)}")
    g = out["gaps"]
    log(f"    device idle between kernels {g['idle_ms_per_step']} ms per decode step (overlap "
        f"{g['overlap_ms_per_step']} ms); most idle after -> before: " + "; ".join(
            f"{p['after']} -> {p['before']} {p['idle_ms_per_step']} ({p['per_step']}x {p['mean_us']} us)"
            for p in g["pairs"][:6]))
    log("    device timeline per decode step, each kernel from where the ones before it ended (ms): " + ", ".join(
        f"{k} {v}" for k, v in g["exclusive_ms_per_step"].items()))
    if fm is not None and lora:
        log(f"    LoRA's own launches per decode step ({'one adapter' if identical else f'{full} distinct adapters'}): "
            f"{out['lora_sgmv']:.3f} ms of kernels against {out['lora_bytes_ms']:.3f} ms for its adapters' bytes "
            f"({out['lora_sgmv'] / max(out['lora_bytes_ms'], 1e-9):.1f}x; what runs inside the products is not "
            "counted here: the exposed figure against LoRA off is LoRA's cost)")
    if mixed is not None:
        log("    profiled steps with prompt rows (prompt rows, decodes): "
            + " ".join(f"({p},{d})" for p, d in mixed["rows"]))
        if any(p == 0 for p, _ in mixed["rows"]):
            log("    (some of them carried no prompt rows: the figures above average over them too)")
    elif mixed_steps:
        log("no step with prompt rows beside decodes was profiled (every prompt was admitted before half "
            "the batch decoded)")
    return out


def timed_steps(engine, n: int) -> float:
    """Wall ms per step of the engine's next `n` steps, without the profiler (whose cost grows with the launches)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    sync()
    return round(1000 * (time.perf_counter() - t0) / n, 3)


def lora_exposed(results: dict, off: dict) -> dict:
    """What LoRA adds to a full-batch decode step's wall time (ms): each LoRA mix's step against the LoRA-off step
    (`off`, profile_breakdown(lora=False)), timed without the profiler where both were (`wall_ms_unprofiled`), else
    the profiled walls. Unlike the kernels' sum (`lora_sgmv`), this leaves out the time the LoRA kernels run beside
    other kernels (programmatic dependent launch)."""
    out = {}
    for k in ("breakdown_lora_distinct", "breakdown_lora_identical"):
        if k in results:
            key = "wall_ms_unprofiled" if "wall_ms_unprofiled" in results[k] and "wall_ms_unprofiled" in off \
                else "wall_ms"
            out[k.removeprefix("breakdown_lora_")] = round(results[k][key] - off[key], 3)
    return out


def exposed_report(results: dict, exposed: dict) -> tuple[dict, str]:
    """Each LoRA mix's exposed time (lora_exposed) over its adapters' bytes' time (`lora_bytes_ms` of its breakdown,
    where the floor model gave one), and the log line that says both."""
    ratios, parts = {}, []
    for k, v in exposed.items():
        floor = results.get(f"breakdown_lora_{k}", {}).get("lora_bytes_ms")
        if floor:
            ratios[k] = round(v / floor, 2)
            parts.append(f"{k} {v} ms ({ratios[k]}x its adapters' bytes, {floor} ms)")
        else:
            parts.append(f"{k} {v} ms")
    return ratios, ", ".join(parts)


def prefill_rate(engine, prompts: list[list[int]], adapters: list, label: str, log, profile: bool = False) -> dict:
    """Prompt tokens per second of prefilling `prompts` (one new token each, all queued at t = 0, the prefix
    cache off), request i on `adapters[i]` ((name, source) or None). Every adapter is loaded by a warm-up
    of 16-token prompts first, so the time is the prefill's alone. `profile`: then the device time of the steps
    that prefill the first four prompts again (at most four steps), by category and by kernel (profile_steps),
    under "profile"."""
    from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence

    def run(tag: str, ids_of) -> tuple[float, int]:
        for i, ad in enumerate(adapters):
            engine.submit(Sequence(f"{tag}{i}", ids_of(i), SamplingParams(max_tokens=1, ignore_eos=True),
                                   AdapterRef(*ad) if ad is not None else None))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        steps = drive(engine, label, {}, {})
        return time.perf_counter() - t0, len(steps)

    caching = engine.blocks.caching
    engine.blocks.caching = False
    prof = None
    try:
        run("pw", lambda i: prompts[i][:16])
        seconds, steps = run("pf", lambda i: prompts[i])
        if profile:
            k = min(4, len(prompts))
            for i in range(k):
                engine.submit(Sequence(f"pp{i}", prompts[i], SamplingParams(max_tokens=1, ignore_eos=True),
                                       AdapterRef(*adapters[i]) if adapters[i] is not None else None))
            prof = profile_steps(engine, k, top=16, while_=engine.has_work)
            drive(engine, label, {}, {})
    finally:
        engine.blocks.caching = caching
    tokens = sum(len(p) for p in prompts)
    res = {"prompts": len(prompts), "prompt_tokens": tokens, "seconds": round(seconds, 4), "steps": steps,
           "prompt_tok_s": round(tokens / seconds, 1)}
    log(f"{label:>28}: {res['prompt_tok_s']:10.1f} prompt tokens/s  ({len(prompts)} prompts of "
        f"{tokens // max(len(prompts), 1)} tokens, {steps} steps, {seconds:.2f}s)")
    if prof is not None:
        res["profile"] = prof
        log(f"{'per prefill step (ms)':>28}: {figures_line(prof)}")
        log(" " * 30 + "; ".join(f"{kernel_label(t['kernel'])} {t['ms_per_step']} ({t['calls_per_step']:g}x)"
                                 for t in prof["top_kernels"][:10]))
    return res


def figures_line(prof: dict) -> str:
    """A profile's figures (category ms, wall, host and gaps, ...) on one line, without its per-kernel
    and per-step lists."""
    return ", ".join(f"{k} {v}" for k, v in prof.items()
                     if k not in ("top_kernels", "rows", "mixed", "adapters_per_step", "lora_bytes_ms", "gaps",
                                  "wall_ms_unprofiled"))


def kernel_category(name: str) -> str:
    """The breakdown category of a GPU kernel by its name: attention means flashinfer's decode and
    prefill attention kernels with their split-merge and page-index helpers (its norm and activation
    kernels are other GPU work); cuBLAS's split-K reduce belongs to its GEMM."""
    k = name.lower()
    if "sgmv" in k:
        return "lora_sgmv"
    if "nccl" in k or "allreduce" in k:
        return "allreduce"
    if any(t in k for t in ("batchdecode", "batchprefill", "prefillwithkvcache", "attention", "mergestate",
                            "sparseindicestovectorsparseoffsets")):
        return "attention"
    if any(t in k for t in ("gemm", "cutlass", "nvjet", "xmma", "gemv", "splitkreduce")):
        return "dense_gemm"
    if "argmax" in k or "softmax" in k or "sort" in k or "topk" in k:
        return "sampling"
    return "other_gpu"


def profile_steps(engine, n: int, top: int = 12, while_=None) -> dict:
    """Device time per category (ms per step) over the engine's next `n` steps (fewer if `while_()`
    turns false before one), their wall time, the rest as host and gaps, the `top` kernels by device
    time (ms per step), and each step's (prompt rows, decodes)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    rows = []
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            if rows and while_ is not None and not while_():
                break
            before = engine.steps
            engine.step()
            rows.append(tuple(engine.last_step) if engine.steps > before else (0, 0))  # (0, 0): launched nothing
        sync()
        n = len(rows)
        wall = (time.perf_counter() - t0) / n
    cats = {"dense_gemm": 0.0, "attention": 0.0, "lora_sgmv": 0.0, "allreduce": 0.0, "sampling": 0.0,
            "other_gpu": 0.0}
    kernels = []
    for ev in prof.key_averages():
        if getattr(ev, "device_type", None) != DeviceType.CUDA:
            continue  # CPU-side ops; their kernels are counted as CUDA events
        dt = getattr(ev, "self_device_time_total", 0) or 0
        if not dt:
            continue
        kernels.append((dt, ev.key, ev.count))
        cats[kernel_category(ev.key)] += dt
    out = {k: round(v / n / 1000, 3) for k, v in cats.items()}  # ms per step
    gpu = sum(out.values())
    out["wall_ms"] = round(1000 * wall, 3)
    out["host_and_gaps_ms"] = round(out["wall_ms"] - gpu, 3)
    out["top_kernels"] = [{"kernel": key[:160], "ms_per_step": round(dt / n / 1000, 3), "calls_per_step": c / n}
                          for dt, key, c in sorted(kernels, reverse=True)[:top]]
    spans = []
    for ev in prof.events():
        if getattr(ev, "device_type", None) == DeviceType.CUDA and not ev.name.startswith("Memcpy"):
            spans.append((ev.time_range.start, ev.time_range.end, ev.name))
    out["gaps"] = kernel_gaps(spans, n, top)
    out["rows"] = rows  # (prompt rows, decodes) of each profiled step
    return out


def kernel_label(name: str) -> str:
    """A kernel's short name: its function's identifier without namespaces, template arguments and
    parameters (cuBLAS's nvjet kernels by their first three fields; a CUTLASS `device_kernel<Op>` by its Op's)."""
    if name.startswith("nvjet"):
        return "_".join(name.split("_")[:3])
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    head, _, rest = name.partition("<")
    head = head.split("(", 1)[0].rsplit("::", 1)[-1].strip()
    if head == "device_kernel" and rest:
        inner = re.split(r"[<(,]", rest, maxsplit=1)[0].rsplit("::", 1)[-1].strip()
        return f"device_kernel<{inner}>" if inner else head
    return head or name[:40]


def kernel_gaps(spans, n_steps: int, top: int = 12) -> dict:
    """Where the device sat idle between kernels, from their (start, end, name) spans in µs: each kernel's
    start minus the latest end of the kernels before it (when positive) is idle time, counted against the
    pair (the kernel that ended last, this kernel) by short name; when negative it is overlap (a kernel that
    started early under programmatic dependent launch, or a second stream). ms per step over `n_steps`;
    the `top` pairs by idle time. `exclusive_ms_per_step`: the device timeline by kernel_category, each kernel
    counted only from where the kernels before it ended (its end minus max(its start, that frontier)): a kernel
    that starts early and waits does not count its wait, so these and the idle time add up to the span of the
    kernels, where the per-kernel device times count overlapping stretches twice. Each pair also has its median and
    largest gap (µs), which tell a gap of every step from one long gap in the window (e.g. the first step's host
    work after the profiler's synchronization)."""
    idle: dict[tuple[str, str], list[float]] = {}
    exclusive: dict[str, float] = {}
    total_idle = total_overlap = 0.0
    frontier, last = None, None
    for start, end, name in sorted(spans):
        label = kernel_label(name)
        own = end - (start if frontier is None else max(start, frontier))
        if own > 0:
            cat = kernel_category(name)
            exclusive[cat] = exclusive.get(cat, 0.0) + own
        if frontier is not None:
            d = start - frontier
            if d > 0:
                total_idle += d
                idle.setdefault((last, label), []).append(d)
            else:
                total_overlap -= d
        if frontier is None or end >= frontier:
            frontier, last = end, label
    n = max(n_steps, 1)
    pairs = sorted(idle.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"idle_ms_per_step": round(total_idle / n / 1000, 3),
            "overlap_ms_per_step": round(total_overlap / n / 1000, 3),
            "exclusive_ms_per_step": {k: round(v / n / 1000, 3) for k, v in sorted(exclusive.items())},
            "pairs": [{"after": a, "before": b, "idle_ms_per_step": round(sum(v) / n / 1000, 3),
                       "per_step": round(len(v) / n, 2), "mean_us": round(sum(v) / len(v), 2),
                       "median_us": round(statistics.median(v), 2), "max_us": round(max(v), 2)}
                      for (a, b), v in pairs]}


def run_interference(engine, vocab: int, log, long_len: int = 8000, n_long: int = 4, every: int = 40,
                     label: str = "", quiet_steps: int = 40, profile: bool = False, adapter_source=None) -> dict:
    """Long prompts arriving into a full decode batch. Inter-token latency (ITL: the gap between
    consecutive tokens of a decoding request) while `n_long` prompts of `long_len` tokens are
    prefilled (one every `every` steps), against two baselines without them:
      - quiet: the first `quiet_steps` steps before the long prompts arrive;
      - control: the same decoders (same prompts, fresh requests) run again without long prompts for as
        many steps, so every token is compared with a token at the same context length (the decoders'
        contexts grow by one token per step, and attention with them, over the whole loaded phase).
    The interference is p99 (with long prompts) / p50 of the control. With `adapter_source(i) -> source`,
    request i has its own adapter (name i, that source). With `profile`, one more long
    prompt afterwards: device time per kernel and host profile of steps that carry its rows."""
    from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence

    def ref(name: str, i: int):
        return AdapterRef(f"i-{name}", adapter_source(i)) if adapter_source is not None else None

    rng = np.random.default_rng(7)
    B = engine.config.max_batch_size
    prompts = [rng.integers(3, vocab, 200).tolist() for _ in range(B - 1)]
    dec_ids: set[str] = set()

    def start_decoders(tag: str) -> list:
        dec = [Sequence(f"i-dec{tag}{i}", ids, SamplingParams(max_tokens=100000, ignore_eos=True), ref(f"d{i}", i),
                        arrival=float(i)) for i, ids in enumerate(prompts)]
        dec_ids.clear()
        dec_ids.update(sq.id for sq in dec)
        for sq in dec:
            engine.submit(sq)
        for _ in range(5000):  # until every decoder runs with its prompt done
            engine.step()
            if not engine.batcher.waiting and all(not sq.prefilling for sq in engine.batcher.running) and \
                    len(engine.batcher.running) == len(dec):
                break
        return dec

    def stop(dec) -> None:
        for sq in dec:
            engine.cancel(sq.id)
        while engine.has_work():
            engine.step()

    steps_run = [0]
    # (prompt rows, seconds) of each step of the last gaps_of. With overlap, the interval between two
    # step() returns is mostly the wait for the step queued by the call before, so it is labelled with
    # that step's prompt rows; without overlap, with the step just run.
    step_times: list[tuple[int, float]] = []

    def gaps_of(steps: int, on_step=None, until=None) -> list[float]:
        last: dict[str, float] = {}
        gaps: list[float] = []
        step_times.clear()
        k = 0
        prev = time.perf_counter()
        while (k < steps if until is None else not until()) and k < 20000:
            if on_step is not None:
                on_step(k)
            queued = engine.last_step[0]  # prompt rows of the step now in flight
            outs = engine.step()
            now = time.perf_counter()
            step_times.append((queued if engine.overlap else engine.last_step[0], now - prev))
            prev = now
            for o in outs:
                if o.seq_id in dec_ids and o.new_token_ids:
                    if o.seq_id in last:
                        gaps.append(now - last[o.seq_id])
                    last[o.seq_id] = now
                if o.seq_id.startswith("i-long"):
                    if o.new_token_ids and o.seq_id not in ttft:
                        ttft[o.seq_id] = now - submitted[o.seq_id]
                    if o.finished:
                        done.add(o.seq_id)
            k += 1
        steps_run[0] = k
        return gaps

    done: set[str] = set()
    submitted: dict[str, float] = {}
    ttft: dict[str, float] = {}  # long prompts: submission to first token
    dec = start_decoders("")
    quiet = gaps_of(quiet_steps)
    longs = [Sequence(f"i-long{k}", rng.integers(3, vocab, long_len).tolist(),
                      SamplingParams(max_tokens=8, ignore_eos=True), ref(f"l{k}", B + k), arrival=1e6 + k)
             for k in range(n_long)]
    t0 = time.perf_counter()

    def submit(k: int) -> None:
        if k % every == 0 and k // every < n_long:
            submitted[longs[k // every].id] = time.perf_counter()
            engine.submit(longs[k // every])

    loaded = gaps_of(0, submit, until=lambda: len(done) >= n_long)
    loaded_steps = steps_run[0]
    loaded_split = split_steps(step_times)
    seconds = time.perf_counter() - t0
    profiles = profile_mixed(engine, vocab, long_len, rng, log, ref("p", B + n_long)) if profile else {}
    stop(dec)
    dec = start_decoders("c")  # the control: same decoders, same number of steps, no long prompts
    gaps_of(quiet_steps)
    control = gaps_of(loaded_steps)
    control_split = split_steps(step_times)
    stop(dec)
    p50, c50 = pct(quiet, 50), pct(control, 50)
    res = {"label": f"interference{label}", "adapters": adapter_source is not None, "long_prompts": n_long,
           "long_tokens": long_len, "decoders": len(dec),
           "seconds": round(seconds, 2), "loaded_steps": loaded_steps, "itl_p50_quiet_ms": round(1000 * p50, 2),
           "itl_p50_control_ms": round(1000 * c50, 2), "itl_p99_control_ms": round(1000 * pct(control, 99), 2),
           "itl_p50_ms": round(1000 * pct(loaded, 50), 2), "itl_p99_ms": round(1000 * pct(loaded, 99), 2),
           "itl_max_ms": round(1000 * max(loaded, default=0), 2), "max_step_tokens": engine.max_step_tokens,
           "decode_prefill_tokens": engine.batcher.decode_prefill_tokens,
           "long_ttft_s": round(sum(ttft.values()) / max(1, len(ttft)), 3)}
    res["itl_p99_over_p50"] = round(res["itl_p99_ms"] / res["itl_p50_quiet_ms"], 3) if p50 else None
    res["itl_p99_over_control_p50"] = round(res["itl_p99_ms"] / res["itl_p50_control_ms"], 3) if c50 else None
    res["loaded_step_ms"], res["control_step_ms"] = loaded_split, control_split
    res.update(profiles)
    log(f"{res['label']:>28}: decode ITL with long prompts p50 {res['itl_p50_ms']:.1f} p99 {res['itl_p99_ms']:.1f} "
        f"max {res['itl_max_ms']:.0f} ms over {loaded_steps} steps; without them p50 "
        f"{res['itl_p50_control_ms']:.1f} ms "
        f"(control, same steps: p99 x{res['itl_p99_over_control_p50']}), {res['itl_p50_quiet_ms']:.1f} ms before "
        f"(x{res['itl_p99_over_p50']}); {n_long} x {long_len}-token prompts (TTFT {res['long_ttft_s']:.2f} s), "
        f"step budget {engine.max_step_tokens}")
    lw, ld, cd = loaded_split["with_prompt_rows"], loaded_split["decode_only"], control_split["decode_only"]
    log(" " * 30 + f"steps with prompt rows {lw['steps']} x {lw['mean']} ms (p50 {lw['p50']}), decode-only "
        f"{ld['steps']} x {ld['mean']} ms; control {cd['steps']} x {cd['mean']} ms (p50 {cd['p50']})")
    return res


def split_steps(step_times: list[tuple[int, float]]) -> dict:
    """Wall time per step (ms: count, mean, p50, p99) of steps with and without prompt rows (the
    interval between consecutive `step()` returns, i.e. what a decoding request waits per token)."""
    out = {}
    for kind, keep in (("with_prompt_rows", lambda pf: pf > 0), ("decode_only", lambda pf: pf == 0)):
        ts = [dt for pf, dt in step_times if keep(pf)]
        out[kind] = {"steps": len(ts), "mean": round(1000 * float(np.mean(ts)), 3) if ts else None,
                     "p50": round(1000 * pct(ts, 50), 3) if ts else None,
                     "p99": round(1000 * pct(ts, 99), 3) if ts else None}
    return out


def profile_mixed(engine, vocab: int, long_len: int, rng, log, adapter=None, n: int = 8) -> dict:
    """Profiles `n` steps that carry rows of one long prompt beside the running decodes (early in the
    prompt, and again in its last eighth, where each chunk attends to a long prefix), then `n` quiet
    decode steps after it finished."""
    from lorafleet.runner.engine.sequence import SamplingParams, Sequence

    sq = Sequence("i-prof", rng.integers(3, vocab, long_len).tolist(), SamplingParams(max_tokens=2, ignore_eos=True),
                  adapter, arrival=2e6)
    engine.submit(sq)

    def prefilling() -> bool:
        return any(r is sq for r in engine.batcher.running) and sq.prefilling

    for _ in range(200):  # admitted, first chunk done
        if prefilling() and sq.num_cached > 0:
            break
        engine.step()
    out = {"mixed_step_profile": profile_steps(engine, n)}
    out["mixed_step_host"] = host_profile(engine, n)
    for _ in range(20000):  # on to the prompt's last eighth: its chunks attend to a long prefix
        if not prefilling() or sq.num_cached >= long_len * 7 // 8:
            break
        engine.step()
    if prefilling():
        first = sq.num_cached
        late = profile_steps(engine, n)
        out["mixed_step_profile_late"] = dict(late, prefix_tokens=[first, sq.num_cached])  # at start and end
    for _ in range(20000):  # until it finished
        if sq.finish_reason is not None:
            break
        engine.step()
    out["quiet_step_profile"] = profile_steps(engine, n)
    log(f"steps with prompt rows, unprofiled: {out['mixed_step_host']['wall_ms_unprofiled']:.2f} ms each; "
        "host functions by own time:\n" + out["mixed_step_host"]["cprofile_tottime"][-6000:])
    for k in ("mixed_step_profile", "mixed_step_profile_late", "quiet_step_profile"):
        if k not in out:
            continue
        log(f"{k}: {figures_line(out[k])}")
        for t in out[k]["top_kernels"][:10]:
            log(f"    {t['ms_per_step']:7.3f} ms  x{t['calls_per_step']:5.1f}  {t['kernel'][:110]}")
    return out


def host_profile(engine, n: int, top: int = 25) -> dict:
    """Wall time of the engine's next `n` steps without any profiler, then the host functions (cProfile)
    with the most own time over `n` more."""
    import cProfile
    import io
    import pstats

    t0 = time.perf_counter()
    for _ in range(n):
        engine.step()
    wall = (time.perf_counter() - t0) / n
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        engine.step()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).strip_dirs().sort_stats("tottime").print_stats(top)
    return {"wall_ms_unprofiled": round(1000 * wall, 3), "cprofile_tottime": buf.getvalue()}


def hf_peft_peers(reqs, n: int, new_tokens: int, device, log) -> dict[str, float]:
    """HF transformers + PEFT mixed-adapter generate on n requests (one batch), output tok/s with n distinct
    adapters and with one adapter for every request. One bf16 model serves both."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    cfg = LlamaConfig(**{k: v for k, v in LLAMA2_7B.items() if k not in ("model_type", "architectures")})
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the device: no fp32 copy of 7B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
            lcfg = LoraConfig(r=16, lora_alpha=16, target_modules=[f"{p}_proj" for p in TARGETS],
                              init_lora_weights=False)
            model = get_peft_model(model, lcfg, adapter_name="a0")
            for i in range(1, n):
                model.add_adapter(f"a{i}", lcfg)
    finally:
        torch.set_default_dtype(prev)
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    log(f"HF+PEFT model with {n} adapters ready ({time.perf_counter() - t0:.0f}s)")
    sample = reqs[:n]
    width = max(len(ids) for ids, _ in sample)
    ids = torch.tensor([[0] * (width - len(x)) + x for x, _ in sample], device=device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x, _ in sample], device=device)
    out = {}
    for label, names in (("identical", ["a0"] * n), ("distinct", [f"a{i}" for i in range(n)])):
        with torch.no_grad():
            model.generate(input_ids=ids[:, -8:], attention_mask=mask[:, -8:], adapter_names=names,
                           max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=mask, adapter_names=names, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
        out[label] = round(n * new_tokens / (time.perf_counter() - t1), 1)
        log(f"{'HF+PEFT ' + label:>28}: {out[label]:8.1f} tok/s  ({n} requests x {new_tokens} tokens)")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def headline(results: list[dict]) -> dict:
    """The `e2e` summary of one run, or of several runs of one card (first figure of each kind wins;
    every run's LoRA-off figure is listed next to the mixes of that run)."""
    r0 = results[0]
    out: dict = {"card": r0["card"], "date": max(r["date"] for r in results), "max_batch": r0["max_batch"],
                 "output_tok_s": {}}
    lora_off = []
    for res in results:
        by = {r["label"]: r for r in res["runs"]}
        for m in MIXES:
            if m in by and m not in out["output_tok_s"]:
                out["output_tok_s"][m] = by[m]["output_tok_s"]
                if by[m].get("floor_fraction") is not None:
                    out.setdefault("floor_fraction", {})[m] = by[m]["floor_fraction"]
                    out.setdefault("floor_tok_s", {})[m] = by[m]["floor_tok_s"]
        if "lora off" in by and by["lora off"].get("floor_fraction") is not None and "lora off" not in out.get(
                "floor_fraction", {}):
            out.setdefault("floor_fraction", {})["lora off"] = by["lora off"]["floor_fraction"]
            out.setdefault("floor_tok_s", {})["lora off"] = by["lora off"]["floor_tok_s"]
        starts = [e["ready_s"] for e in res.get("engine_start", []) if e["lora"] and e["chunked"]
                  and e["max_batch"] == r0["max_batch"]]
        if starts and "engine_start_s" not in out:
            out["engine_start_s"] = starts[0]
        for it in res.get("interference", []):
            # p99 with long prompts over the p50 of the control run (same decoders, same steps, no long
            # prompts); runs from before the control existed only have the quiet-start baseline
            ratio = it.get("itl_p99_over_control_p50", it["itl_p99_over_p50"])
            if it["label"].endswith("(chunked)"):
                out.setdefault("interference_tpot_p99_ratio", ratio)
                out.setdefault("interference_baseline", "control" if "itl_p99_over_control_p50" in it else "quiet")
            elif it["label"].endswith("(unchunked)"):
                out.setdefault("interference_unchunked_p99_ratio", ratio)
            elif it.get("decode_prefill_tokens"):
                out.setdefault("interference_p99_ratio_by_decode_prefill_tokens", {}).setdefault(
                    str(it["decode_prefill_tokens"]), ratio)
                out.setdefault("interference_p99_over_quiet_p50_by_decode_prefill_tokens", {}).setdefault(
                    str(it["decode_prefill_tokens"]), it["itl_p99_over_p50"])
        if "lora off" in by:
            lora_off.append({"lora_off": by["lora off"]["output_tok_s"], "with": [m for m in MIXES if m in by]})
        if "hf_peft_output_tok_s" in res and "hf_peft_output_tok_s" not in out:
            out["hf_peft_output_tok_s"] = {k: v for k, v in res["hf_peft_output_tok_s"].items() if k != "sample"}
        if "uniform (cold start)" in by and "tpot_p99_ms" not in out:
            warm = by.get("uniform (warm, same engine)")
            out["tpot_p99_ms"] = {"warm": warm["tpot_p99_ms"] if warm else None,
                                  "cold": by["uniform (cold start)"]["tpot_p99_ms"]}
    if lora_off:
        out["lora_off_output_tok_s"] = lora_off[0]["lora_off"]
        if len(lora_off) > 1:
            out["lora_off_by_run"] = lora_off
    return out


MIXES = ("distinct", "uniform", "skewed", "identical")


def plot_mixes(results: list[dict], path: Path) -> None:
    """Output tok/s per adapter mix (Punica Fig. 11 style): one bar series per result file, its
    same-run LoRA-off figure as a dashed line, HF transformers + PEFT bars where measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / (len(results) + 1)
    colors = ["tab:blue", "tab:cyan", "tab:green"]
    for k, res in enumerate(results):
        by: dict = {}
        for r in res["runs"]:
            by.setdefault(r["label"], r)  # merged files: the first run of a kind, as in their summary
        xs = [i + k * width for i, m in enumerate(MIXES) if m in by]
        label = f"lorafleet, {res['requests']} requests"
        bars = ax.bar(xs, [by[m]["output_tok_s"] for m in MIXES if m in by], width, label=label, color=colors[k % 3])
        ax.bar_label(bars, fmt="%.0f", fontsize=6)
        if "lora off" in by:
            ax.axhline(by["lora off"]["output_tok_s"], color=colors[k % 3], ls="--", lw=1,
                       label=f"same engine, LoRA off ({res['requests']} requests)")
        hf = res.get("hf_peft_output_tok_s") or res.get("e2e", {}).get("hf_peft_output_tok_s")
        if hf:
            got = [m for m in MIXES if hf.get(m) is not None]
            hx = [i + len(results) * width for i, m in enumerate(MIXES) if m in got]
            bars = ax.bar(hx, [hf[m] for m in got], width, color="tab:red", label="HF transformers + PEFT")
            ax.bar_label(bars, fmt="%.0f", fontsize=6)
    ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(MIXES))], MIXES)
    ax.set_ylabel("output tokens/s")
    r0 = results[0]
    ax.set_title(f"Llama-2-7B shape, bf16, r=16 on 7 projections, max batch {r0['max_batch']}, {r0['card']}",
                 fontsize=8)
    ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    """`lorafleet bench e2e`'s options; every option's help ends with its default (cli.HelpFormatter)."""
    from lorafleet.cli import HelpFormatter

    p = argparse.ArgumentParser(prog="lorafleet bench e2e", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--requests", type=cli_args.positive_int, default=1000, help="requests of each mix run")
    p.add_argument("--max-batch", type=cli_args.positive_int, default=32, help="the engine's max batch size")
    p.add_argument("--mixes", nargs="*", default=["distinct", "uniform", "skewed", "identical"],
                   help="adapter popularity mixes to run (default: distinct uniform skewed identical; the flag alone: "
                        "none)")
    p.add_argument("--population", type=cli_args.positive_int, default=256, help="distinct adapter weight sets")
    p.add_argument("--rank", type=cli_args.lora_rank, default=16,
                   help=f"LoRA rank of every adapter (1-{cli_args.MAX_LORA_RANK})")
    p.add_argument("--sweep", type=cli_args.positive_int, nargs="*", default=[64, 128, 256],
                   help="extra max batch sizes for the distinct mix (default: 64 128 256; the flag alone: none)")
    p.add_argument("--no-lora-off", action="store_true", help="skip the peer run of the same engine with LoRA off")
    p.add_argument("--hf-requests", type=int, default=32,
                   help="requests of the HF+PEFT sample (default: %(default)s; 0: skip)")
    p.add_argument("--hf-tokens", type=int, default=16, help="new tokens per request of the HF+PEFT sample")
    p.add_argument("--cold", action="store_true",
                   help="also run the uniform mix from adapters on disk with empty GPU and host tiers, then warm")
    p.add_argument("--cold-requests", type=int, default=None, help="requests of the cold and warm runs "
                   "(default: --requests)")
    p.add_argument("--profile", action="store_true", help="per-step GPU time breakdown: decode steps at full batch and steps with "
                   "prompt rows while the batch fills (each max batch of --sweep too)")
    p.add_argument("--profile-context", type=cli_args.positive_int, default=None, metavar="TOKENS",
                   help="--profile: each profiled request's prompt in tokens (its own, repeated), so the decode steps "
                        "are profiled at about this context (default: each request's first 128 tokens; the "
                        "ShareGPT-like mixes average ~370 tokens over their decode steps)")
    p.add_argument("--interference", action="store_true",
                   help="8k-token prompts into a full decode batch, chunked (the engine's step budget) and unchunked")
    p.add_argument("--interference-adapters", choices=["distinct", "none"], default="distinct",
                   help="with --interference: every request with its own adapter (default), or the base model only")
    p.add_argument("--decode-prefill-tokens", type=int, nargs="*", default=[], metavar="N",
                   help="with --interference: also run it with at most N prompt rows per step that carries decodes "
                        "(EngineConfig.decode_prefill_tokens), once per N (default: none)")
    p.add_argument("--interference-caps-only", action="store_true",
                   help="with --interference: only the --decode-prefill-tokens runs (no runs at the engine's step "
                        "budget or unchunked; for A/B runs of one setting)")
    p.add_argument("--step-tokens", type=cli_args.positive_int, default=None, help="chunked prefill: token rows per step "
                   "(default: the engine's)")
    cli_args.add_batch_invariant_argument(p)
    from lorafleet.bench.prefix import WORKLOADS

    p.add_argument("--prefill", type=int, nargs="?", const=2048, default=None, metavar="TOKENS",
                   help="also the prefill benchmark: 64 prompts of TOKENS tokens (2048 if TOKENS is left out) with LoRA off, on one "
                        "adapter and on 64 distinct adapters, prompt tokens/s (default: not run)")
    p.add_argument("--prefix-workloads", nargs="*", default=[], choices=WORKLOADS, metavar="WL",
                   help=f"the prefix cache's workloads ({', '.join(WORKLOADS)}), each with the cache off and on "
                        "(bench/prefix.py); default: none")
    p.add_argument("--prefix-adapters", type=int, default=32, help="adapters of the prefix workloads")
    p.add_argument("--quantization", choices=["fp8"], default=None, help="FP8 projection weights (default: bf16)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="FP8 K/V pages (default: bf16)")
    p.add_argument("--system-tokens", type=int, default=1024, help="system prompt per adapter, in tokens")
    p.add_argument("--conversations", type=int, default=64, help="multi-turn: conversations of four turns")
    p.add_argument("--prefix-rate", type=float, default=0.0, metavar="R",
                   help="system-prompt and sharegpt: Poisson arrivals at R requests/s, so TTFT is the prefill's "
                        "rather than the wait for a batch place (default: 0, every request at t = 0)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b",
                   help="model shape from the families' registry (tiny also runs on the CPU)")
    p.add_argument("--tp", type=cli_args.positive_int, nargs="+", default=[1], metavar="G",
                   help="tensor-parallel group sizes to run one after another (any other value than 1, or a shape "
                        "other than llama2-7b, runs the synthetic-model path: every rank draws its own weights; "
                        "default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, adapters and requests")
    p.add_argument("--out", type=cli_args.output_file, default=Path("bench_e2e.json"),
                   help="results as JSON (default: bench_e2e.json)")
    p.add_argument("--plot", type=cli_args.output_file, default=None,
                   help="also draw the mixes' throughput as a PNG (default: none)")
    p.add_argument("--plot-from", type=cli_args.results_file, nargs="+", default=None, metavar="JSON",
                   help="only draw --plot from result files of earlier runs (no GPU needed)")
    p.add_argument("--merge", type=cli_args.results_file, nargs="+", default=None, metavar="JSON",
                   help="only merge result files of runs on one card into --out, with their e2e summary")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.interference_caps_only and not (args.interference and args.decode_prefill_tokens):
        p.error("--interference-caps-only needs --interference and --decode-prefill-tokens N...")
    if args.merge:
        parts = [json.loads(f.read_text()) for f in args.merge]
        for f, part in zip(args.merge, parts):
            missing = [k for k in ("card", "date", "requests", "max_batch") if k not in part]
            if missing or not all(isinstance(r, dict) and "label" in r for r in part["runs"]):
                p.error(f"{f} is not a result file of bench e2e (no {', '.join(missing) or 'labelled runs'})")
        for key in ("card", "requests", "max_batch"):
            seen = {r[key] for r in parts}
            if len(seen) != 1:
                p.error(f"--merge needs runs with one {key}, got {sorted(seen)}")
        merged = {"card": parts[0]["card"], "date": max(r["date"] for r in parts), "max_batch": parts[0]["max_batch"],
                  "requests": parts[0]["requests"], "merged_from": [str(f) for f in args.merge],
                  "runs": [dict(r, run_file=str(f)) for f, res in zip(args.merge, parts) for r in res["runs"]],
                  "e2e": headline(parts)}
        rates = {str(f): res["floor_rates"] for f, res in zip(args.merge, parts) if "floor_rates" in res}
        if rates:  # each part's floors are at its own run's rates
            merged["floor_rates"] = rates
        args.out.write_text(json.dumps(merged, indent=1))
        print(json.dumps(merged["e2e"], indent=1))
        return 0
    if args.plot_from:
        if not args.plot:
            p.error("--plot-from needs --plot PNG")
        plot_mixes([json.loads(f.read_text()) for f in args.plot_from], args.plot)
        print(f"wrote {args.plot}")
        return 0
    if args.shape == "tiny" or (torch.cuda.is_available() and (args.tp != [1] or args.shape != "llama2-7b")):
        return run_tp(args)  # the tiny shape (the CPU tests of this path) runs anywhere
    if not torch.cuda.is_available():
        print("bench e2e needs a CUDA GPU (only --shape tiny runs on the CPU)", file=sys.stderr)
        return 2

    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine

    def log(msg):
        print(msg, flush=True)

    dev = torch.device("cuda")
    t_start = time.perf_counter()
    rates = card_rates(dev)  # before the model: the copy needs 2 GiB of the card
    log(f"memory floor at {describe(rates)}")
    model = random_model(dev, torch.bfloat16, args.seed, fp8=args.quantization == "fp8")
    base = model.cfg.base_shape()
    reqs = sharegpt_requests(args.requests, args.seed, model.cfg.vocab_size)
    log(f"model ready ({time.perf_counter() - t_start:.0f}s); {args.requests} requests, mean prompt "
        f"{np.mean([len(a) for a, _ in reqs]):.0f}, mean output {np.mean([b for _, b in reqs]):.0f} tokens")
    store = random_adapters(base, args.population, args.rank, torch.bfloat16, dev, args.seed + 1)
    fm = floor_model(model.cfg, args.rank, proj_bytes=1 if args.quantization == "fp8" else None,
                     kv_bytes=1 if args.kv_cache_dtype == "fp8" else None, rates=rates)
    log(f"{len(store)} adapters in pinned memory ({time.perf_counter() - t_start:.0f}s)")

    results: dict = {"card": torch.cuda.get_device_name(0), "date": str(date.today()), "torch": torch.__version__,
                     "requests": args.requests, "max_batch": args.max_batch, "runs": [],
                     "quantization": args.quantization or "none", "kv_cache_dtype": args.kv_cache_dtype,
                     "batch_invariant": args.batch_invariant, "floor_rates": rates}
    if args.batch_invariant:  # (what floor_tok_s and floor_fraction compare against)
        results["floor_note"] = ("the floor reads the weights once per step; batch-invariant steps with prompt "
                                 "and decode rows read them twice")

    def make_engine(max_batch: int, lora: bool, from_disk: bool = False, chunked: bool = True):
        from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence

        t0 = time.perf_counter()
        cfg = EngineConfig(max_batch_size=max_batch, max_lora_rank=args.rank, lora_slots=max(64, 2 * max_batch),
                           enable_lora=lora, host_lora_cache=4096, kv_fraction=0.8, chunked_prefill=chunked,
                           max_step_tokens=args.step_tokens if chunked else None, quantization=args.quantization,
                           kv_cache_dtype=args.kv_cache_dtype, batch_invariant=args.batch_invariant,
                           requeue_evicted=True)  # offline: an evicted request resumes
        loader = None if from_disk else (lambda ref: store[int(ref.source) % len(store)])
        eng = Engine(model, cfg, adapter_loader=loader)
        built = time.perf_counter() - t0
        # warm-up outside the timed runs: kernel JIT compilation, cuBLAS handles, first adapter load
        warm = [Sequence(f"warm{i}", reqs[i][0][:64], SamplingParams(max_tokens=4, ignore_eos=True),
                         AdapterRef(f"warm{i}", str(i)) if lora and i and not from_disk else None) for i in range(3)]
        eng.run_to_completion(warm)
        torch.cuda.synchronize()
        start = round(time.perf_counter() - t0, 2)
        results.setdefault("engine_start", []).append({"max_batch": max_batch, "lora": lora, "chunked": chunked,
                                                        "construct_s": round(built, 2), "ready_s": start})
        log(f"engine ready: max batch {max_batch}, LoRA {'on' if lora else 'off'}, step budget {eng.max_step_tokens}, "
            f"KV pool {eng.blocks.total_tokens} tokens (KV pool, graph capture and warm-up {start:.1f}s, of which "
            f"construction {built:.1f}s)")
        return eng


    def save_partial() -> None:
        """Results so far (a run cut short by a time limit still leaves its finished parts)."""
        part = dict(results, runs=[{k: v for k, v in r.items() if k != "_steps"} for r in results["runs"]],
                    partial=True)
        args.out.write_text(json.dumps(part, indent=1))

    eng = make_engine(args.max_batch, True) if args.mixes or args.profile or args.prefix_workloads else None
    if args.prefix_workloads:
        from lorafleet.bench.prefix import run_workloads

        results["prefix"] = run_workloads(eng, args.prefix_workloads, reqs, model.cfg.vocab_size, log,
                                          args.prefix_adapters, args.system_tokens, args.conversations,
                                          rate=args.prefix_rate)
        for wl, r in results["prefix"].items():
            log(f"{wl}: cache on / off {r['on_over_off']}")
        save_partial()
    n = len(reqs)
    for mix in args.mixes:
        if mix == "distinct":
            idx = list(range(n))  # every request its own adapter name
        else:
            idx = assign(mix, n, max(args.population, 1), seed=args.seed)
        res = run_mix(eng, reqs, [f"{mix}-{i}" for i in idx], lambda i, idx=idx: idx[i], mix, log, fm)
        results["runs"].append(res)
        save_partial()
    prefill_prompts = None
    if args.prefill:
        rng = np.random.default_rng(args.seed + 7)
        prefill_prompts = [rng.integers(3, model.cfg.vocab_size, args.prefill).tolist() for _ in range(64)]
        eng = eng or make_engine(args.max_batch, True)
        results["prefill"] = {
            "one": prefill_rate(eng, prefill_prompts, [("pf-one", "0")] * 64, "prefill, one adapter", log,
                                profile=args.profile),
            "distinct": prefill_rate(eng, prefill_prompts, [(f"pf-{i}", str(i)) for i in range(64)],
                                     "prefill, 64 distinct adapters", log, profile=args.profile)}
        save_partial()
    if args.profile:
        results["breakdown_lora_distinct"] = profile_breakdown(eng, reqs, log, fm=fm, context=args.profile_context)
        save_partial()
        results["breakdown_lora_identical"] = profile_breakdown(eng, reqs, log, fm=fm, identical=True, mixed_steps=0,
                                                                context=args.profile_context)
        save_partial()
    if args.interference:
        eng = eng or make_engine(args.max_batch, True)
        ilora = str if args.interference_adapters == "distinct" else None  # the loader maps source i to a set
        results["interference"] = []
        if not args.interference_caps_only:
            results["interference"].append(run_interference(eng, model.cfg.vocab_size, log, label=" (chunked)",
                                                            adapter_source=ilora))
            save_partial()
        for cap in args.decode_prefill_tokens:
            eng.batcher.decode_prefill_tokens = cap
            results["interference"].append(run_interference(eng, model.cfg.vocab_size, log,
                                                             label=f" (chunked, {cap} prompt rows with decodes)",
                                                             profile=args.profile, adapter_source=ilora))
            save_partial()
        eng.batcher.decode_prefill_tokens = None
        if not args.interference_caps_only:
            del eng
            gc.collect()
            torch.cuda.empty_cache()
            eng = make_engine(args.max_batch, True, chunked=False)
            results["interference"].append(run_interference(eng, model.cfg.vocab_size, log, label=" (unchunked)",
                                                            adapter_source=ilora))
            save_partial()
    if args.cold:
        # Cold start: the uniform mix's adapters as PEFT files on disk, a fresh engine with an
        # empty device pool and host tier, read through the normal loader (disk -> pinned -> GPU).
        import tempfile

        del eng
        gc.collect()
        torch.cuda.empty_cache()
        nc = min(args.cold_requests or n, n)
        idx = assign("uniform", nc, max(args.population, 1), seed=args.seed)
        disk = Path(tempfile.mkdtemp(prefix="lorafleet-cold-"))
        for k in sorted(set(idx)):
            write_peft_adapter(disk / f"a{k}", store[k % len(store)], args.rank)
        log(f"wrote {len(set(idx))} adapters to disk for the cold start ({time.perf_counter() - t_start:.0f}s)")
        eng = make_engine(args.max_batch, True, from_disk=True)
        names = [f"cold-{i}" for i in idx]
        res = run_mix(eng, reqs[:nc], names, lambda i: disk / f"a{idx[i]}", "uniform (cold start)", log)
        results["runs"].append(res)
        save_partial()
        res = run_mix(eng, reqs[:nc], names, lambda i: disk / f"a{idx[i]}", "uniform (warm, same engine)", log)
        results["runs"].append(res)
        save_partial()
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    if not args.no_lora_off or prefill_prompts is not None:
        eng = make_engine(args.max_batch, False)
        if not args.no_lora_off:
            results["runs"].append(run_mix(eng, reqs, [None] * n, lambda i: 0, "lora off", log, fm))
            if args.profile:
                off = results["breakdown_lora_off"] = profile_breakdown(eng, reqs, log, fm=fm, lora=False,
                                                                        mixed_steps=0, context=args.profile_context)
                results["lora_exposed_ms"] = exposed = lora_exposed(results, off)
                results["lora_exposed_over_bytes"], said = exposed_report(results, exposed)
                log("LoRA per decode step, exposed (the full-batch step's wall, unprofiled, against LoRA off's "
                    f"{off.get('wall_ms_unprofiled')} ms): {said}")
        if prefill_prompts is not None:
            pf = results["prefill"]
            pf["off"] = prefill_rate(eng, prefill_prompts, [None] * 64, "prefill, LoRA off", log, profile=args.profile)
            for k in ("one", "distinct"):
                pf[f"{k}_over_off"] = round(pf[k]["prompt_tok_s"] / pf["off"]["prompt_tok_s"], 3)
            log(f"prefill with LoRA / LoRA off: one adapter {pf['one_over_off']}, 64 distinct {pf['distinct_over_off']}")
        save_partial()
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    for mb in args.sweep:
        eng = make_engine(mb, True)
        res = run_mix(eng, reqs, [f"sweep{mb}-{i}" for i in range(n)], lambda i: i, f"distinct max_batch={mb}", log,
                      fm)
        res["max_batch"] = mb
        if args.profile:
            res["breakdown"] = profile_breakdown(eng, reqs, log, fm=fm, context=args.profile_context)
        results["runs"].append(res)
        save_partial()
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    if args.hf_requests:
        del model
        gc.collect()
        torch.cuda.empty_cache()
        results["hf_peft_output_tok_s"] = {
            **hf_peft_peers(reqs, args.hf_requests, args.hf_tokens, dev, log),
            "sample": f"{args.hf_requests} requests x {args.hf_tokens} new tokens, one mixed batch"}
    all_steps = [s for r in results["runs"] for s in r.pop("_steps")]
    results["step_model"] = fit_step_model(all_steps)
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    results["e2e"] = headline([results])
    args.out.write_text(json.dumps(results, indent=1))
    print("| run | output tok/s | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | TPOT p99 (ms) |")
    print("|---|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['label']} | {r['output_tok_s']} | {r['ttft_p50_s']} | {r['ttft_p99_s']} | {r['tpot_p50_ms']} | "
              f"{r['tpot_p99_ms']} |")
    if results.get("prefix"):
        print("\n| workload | cache | output tok/s | TTFT p50 (s) | TTFT p99 (s) | prompt tokens computed | hit rate |")
        print("|---|---|---|---|---|---|---|")
        for wl, r in results["prefix"].items():
            for k in ("off", "on"):
                x = r[k]
                print(f"| {wl} | {k} | {x['output_tok_s']} | {x['ttft_p50_s']} | {x['ttft_p99_s']} | "
                      f"{x['prompt_tokens_computed']} | {x['hit_rate']} |")
    if args.plot:
        plot_mixes([results], args.plot)
    return 0


def _tp_session(job: dict, conn) -> None:
    """One engine (one tensor-parallel size, LoRA on or off) in its own process: a process holds
    one NCCL group at a time (see runner/parallel/group.py). Sends back its runs."""
    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine
    from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence

    def log(msg):
        print(msg, flush=True)

    try:
        cuda = torch.cuda.is_available()
        tp, lora, rank, population = job["tp"], job["lora"], job["rank"], job["population"]
        mcfg = registry.config_from_hf(SHAPES[job["shape"]], name=job["shape"])
        reqs = sharegpt_requests(job["requests"], job["seed"], mcfg.vocab_size)
        n = len(reqs)
        rates = card_rates(torch.device("cuda", 0) if cuda else None)  # before the engine takes the memory
        log(f"memory floor at {describe(rates)}")
        fm = floor_model(mcfg, rank, tp=tp, proj_bytes=1 if job.get("quantization") == "fp8" else None,
                         kv_bytes=1 if job.get("kv_cache_dtype") == "fp8" else None, rates=rates)

        def source(i: int) -> str:
            return f"synthetic://{i % population}?rank={rank}"

        t0 = time.perf_counter()
        cfg = EngineConfig(tp=tp, max_batch_size=job["max_batch"], max_lora_rank=rank,
                           lora_slots=max(64, 2 * job["max_batch"]), enable_lora=lora, host_lora_cache=4096,
                           kv_fraction=0.8, allow_synthetic=True, max_step_tokens=job["step_tokens"],
                           quantization=job.get("quantization"), kv_cache_dtype=job.get("kv_cache_dtype", "auto"),
                           batch_invariant=job.get("batch_invariant", False),
                           **({} if cuda else {"device": "cpu", "num_pages": 2000, "page_size": 16}))
        eng = Engine(job["path"], cfg)
        out: dict = {"runs": [], "floor_rates": rates}
        try:
            # Warm-up outside the timed runs. With LoRA, one request per weight set of the population: every
            # rank draws each set once (on the CPU, seconds per set for the large shapes), which would
            # otherwise fall into the timed runs and take the engine thread's CPU.
            warm = [Sequence(f"warm{i}", reqs[i % n][0][:64], SamplingParams(max_tokens=4, ignore_eos=True),
                             AdapterRef(f"warm{i}", source(i - 1)) if lora and i else None)
                    for i in range(1 + population if lora else 3)]
            eng.run_to_completion(warm)
            if cuda:
                torch.cuda.synchronize()
            out["engine_start_s"] = round(time.perf_counter() - t0, 1)
            log(f"{job['shape']} tp={tp} LoRA {'on' if lora else 'off'}: engine ready in {out['engine_start_s']}s "
                f"({eng.blocks.total_tokens} KV tokens per rank, step budget {eng.max_step_tokens})")
            for mix in (job["mixes"] if lora else [None]):
                if mix is None:
                    names, label, src = [None] * n, f"lora off tp={tp}", (lambda i: "")
                else:
                    idx = list(range(n)) if mix == "distinct" else assign(mix, n, population, seed=job["seed"])
                    names, label = [f"{mix}-{i}" for i in idx], f"{mix} tp={tp}"
                    src = (lambda i, idx=idx: source(idx[i]))
                res = run_mix(eng, reqs, names, src, label, log, fm)
                res.pop("_steps", None)
                res.update(tp=tp, shape=job["shape"], mix=mix)
                out["runs"].append(res)
            if job["profile"]:  # full-batch decode steps: every mix of the run, and LoRA off's (exposed time)
                if not lora:
                    out["breakdown_off"] = profile_breakdown(eng, reqs, log, fm=fm, lora=False, mixed_steps=0,
                                                             context=job.get("profile_context"))
                else:
                    out["breakdown"] = profile_breakdown(eng, reqs, log, source, fm=fm,
                                                         context=job.get("profile_context"))
                    if "identical" in job["mixes"]:
                        out["breakdown_identical"] = profile_breakdown(eng, reqs, log, source, fm=fm, identical=True,
                                                                       mixed_steps=0,
                                                                       context=job.get("profile_context"))
        finally:
            eng.close()
        conn.send(("ok", out))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


def run_tp(args) -> int:
    """The mixes and LoRA off for each tensor-parallel size in `args.tp`, on a synthetic model of
    `args.shape` (each rank draws its slices on its GPU) with synthetic://SEED adapters (a
    population of `--population` weight sets, one adapter name per request as usual). Every engine
    runs in a child process of its own."""
    import multiprocessing as mp
    import tempfile

    from lorafleet.runner.model.synthetic import write_synthetic_model

    t_start = time.perf_counter()
    hf = SHAPES[args.shape]
    path = write_synthetic_model(Path(tempfile.mkdtemp(prefix="lorafleet-synthetic-")), hf, args.seed)
    population = min(args.population, 16)
    cuda = torch.cuda.is_available()
    results: dict = {"card": torch.cuda.get_device_name(0) if cuda else "cpu", "gpus": torch.cuda.device_count(),
                     "date": str(date.today()), "torch": torch.__version__, "requests": args.requests,
                     "max_batch": args.max_batch, "shape": args.shape, "population": population, "runs": [], "tp": {},
                     "quantization": args.quantization or "none", "kv_cache_dtype": args.kv_cache_dtype,
                     "batch_invariant": args.batch_invariant}
    key = args.shape.replace("-", "_")

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=1))

    ctx = mp.get_context("spawn")
    failed = False
    for tp in args.tp:
        summary = results["tp"].setdefault(f"{key}_tp{tp}", {"output_tok_s": {}, "floor_tok_s": {}})
        for lora in ([True] if args.mixes or args.profile else []) + ([] if args.no_lora_off else [False]):
            job = {"tp": tp, "lora": lora, "rank": args.rank, "population": population, "shape": args.shape,
                   "requests": args.requests, "seed": args.seed, "max_batch": args.max_batch,
                   "step_tokens": args.step_tokens, "path": str(path), "mixes": list(args.mixes),
                   "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
                   "batch_invariant": args.batch_invariant, "profile": args.profile,
                   "profile_context": args.profile_context}
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_tp_session, args=(job, child), daemon=False)
            proc.start()
            child.close()
            try:
                status, out = parent.recv()
            except EOFError:
                status, out = "error", f"the benchmark process exited with code {proc.exitcode}"
            proc.join()
            if status != "ok":
                print(f"tp={tp} LoRA {'on' if lora else 'off'} failed: {out}", flush=True)
                summary.setdefault("errors", []).append(out)
                failed = True
                save()
                continue
            summary.setdefault("engine_start_s", out["engine_start_s"])
            summary["floor_rates"] = out["floor_rates"]  # each session measures the card it runs on
            for res in out["runs"]:
                results["runs"].append(res)
                if res["mix"] is None:
                    summary["lora_off_output_tok_s"] = res["output_tok_s"]
                    summary["floor_tok_s"]["lora off"] = res.get("floor_tok_s")
                else:
                    summary["output_tok_s"][res["mix"]] = res["output_tok_s"]
                    summary["floor_tok_s"][res["mix"]] = res.get("floor_tok_s")
            if "breakdown" in out:
                summary["breakdown_lora_distinct"] = out["breakdown"]
                summary["allreduce_ms_per_step"] = out["breakdown"]["allreduce"]
            if "breakdown_identical" in out:
                summary["breakdown_lora_identical"] = out["breakdown_identical"]
            if "breakdown_off" in out:
                summary["breakdown_lora_off"] = out["breakdown_off"]
                summary["lora_exposed_ms"] = exposed = lora_exposed(summary, out["breakdown_off"])
                summary["lora_exposed_over_bytes"], said = exposed_report(summary, exposed)
                print(f"tp={tp} LoRA per decode step, exposed (against LoRA off's "
                      f"{out['breakdown_off'].get('wall_ms_unprofiled')} ms): {said}", flush=True)
            save()
        off = summary.get("lora_off_output_tok_s")
        if off:
            summary["over_lora_off"] = {m: round(v / off, 3) for m, v in summary["output_tok_s"].items()}
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    save()
    print("| run | output tok/s | floor tok/s | TPOT p50 (ms) | TPOT p99 (ms) |")
    print("|---|---|---|---|---|")
    for r in results["runs"]:
        print(f"| {r['label']} | {r['output_tok_s']} | {r.get('floor_tok_s')} | {r['tpot_p50_ms']} | "
              f"{r['tpot_p99_ms']} |")
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""The offline peer of `bench serve`: the same requests through `Engine` in this process (torch).

All requests are submitted at t=0 and stepped to completion, as `bench e2e` does; adapters are
read from the same directory the server used. Returns throughput, TTFT and TPOT, and the
(prefill tokens, decode requests, seconds) of every step for refitting the simulator's step
model (`lorafleet simulate --fit-from`).
"""

from __future__ import annotations

import time

import numpy as np


def engine_for(model: str, config: dict):
    from lorafleet.runner.service.engine_core import build_engine

    return build_engine(model, config)


def run(engine, reqs: list[tuple[list[int], int]], adapters: list[str | None], adapter_dir, label: str) -> dict:
    """reqs: (prompt ids, output tokens); adapters: the adapter name of each (None: base)."""
    import torch

    from lorafleet.bench.e2e import drive
    from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence

    def sync():
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    # warm-up outside the timed run (kernels, first adapter load)
    warm = [Sequence(f"warm{i}", reqs[i][0][:16], SamplingParams(max_tokens=2, ignore_eos=True),
                     AdapterRef(a, str((adapter_dir / a).resolve())) if a else None)
            for i, a in enumerate(adapters[:2])]
    engine.run_to_completion(warm)
    sync()
    t0 = time.perf_counter()
    first, end, n_out = {}, {}, {}
    for i, ((ids, o), a) in enumerate(zip(reqs, adapters)):
        ref = AdapterRef(a, str((adapter_dir / a).resolve())) if a else None
        engine.submit(Sequence(f"r{i}", ids, SamplingParams(max_tokens=o, ignore_eos=True), ref, arrival=float(i)))
        n_out[f"r{i}"] = o
    steps = [(pf, nd, round(dt, 6), kv, ads) for pf, nd, dt, kv, ads in drive(engine, label, first, end)]
    sync()
    wall = time.perf_counter() - t0
    total = sum(n_out.values())
    ttft = [first[k] - t0 for k in first]
    tpot = [(end[k] - first[k]) / (n_out[k] - 1) for k in end if n_out[k] > 1]

    def p(xs, q, k=1.0):
        return round(float(np.percentile(xs, q)) * k, 3) if xs else None

    return {"label": label, "requests": len(reqs), "output_tokens": total, "seconds": round(wall, 3),
            "output_tok_s": round(total / wall, 1), "ttft_p50_s": p(ttft, 50), "ttft_p99_s": p(ttft, 99),
            "tpot_p50_ms": p(tpot, 50, 1000), "tpot_p99_ms": p(tpot, 99, 1000), "steps": steps}

"""`lorafleet simulate`: placement policies over a one-hour diurnal trace on simulated GPUs.

The simulated runners batch continuously like the engine: each step every running request
gains one token and prefills of newly placed requests are added to that step; the step time
is a model fitted on the real engine (`decode_ms = a + b * batch`, `prefill_ms = c * tokens`,
from `lorafleet bench e2e` on the card). The placement functions are the scheduler's own
(`placement.py`). A GPU counts as *in use* while it has requests or was busy within the
idle window (after that an autoscaler would drain and release it), which is what GPU-hours
measure. A runner out of KV evicts its newest request, which is re-placed (migration).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lorafleet.scheduler.placement import POLICIES, RunnerView, kv_need


@dataclass
class StepModel:
    decode_base_ms: float = 9.0
    decode_per_req_ms: float = 0.05
    prefill_per_token_ms: float = 0.02

    def step_ms(self, batch: int, prefill_tokens: int) -> float:
        return self.decode_base_ms + self.decode_per_req_ms * batch + self.prefill_per_token_ms * prefill_tokens

    @classmethod
    def from_json(cls, path: Path) -> "StepModel":
        data = json.loads(Path(path).read_text())
        data = data.get("step_model", data)
        return cls(**{k: float(v) for k, v in data.items() if k in cls.__dataclass_fields__})


def fit_step_model(steps) -> dict:
    """Least squares over measured engine steps `(prefill tokens, decode requests, seconds, ...)`
    (further fields, e.g. KV tokens and adapters, are ignored):
    step_ms = decode_base_ms + decode_per_req_ms * decode_requests + prefill_per_token_ms * prefill_tokens."""
    rows = [(st[0], st[1], st[2]) for st in steps if st[1] or st[0]]
    if len(rows) < 3:
        return {}
    X = np.array([[1.0, nd, pf] for pf, nd, _ in rows])
    y = np.array([1000.0 * dt for _, _, dt in rows])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    return {"decode_base_ms": round(float(coef[0]), 4), "decode_per_req_ms": round(float(coef[1]), 5),
            "prefill_per_token_ms": round(float(coef[2]), 6), "fitted_steps": len(rows)}


def refit(paths: list[Path]) -> StepModel:
    """The step model from benchmark JSON files: their raw steps when present (`bench serve`'s
    `offline_steps`), else their fitted `step_model` (`bench e2e`); several files are pooled."""
    steps, fitted = [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if data.get("offline_steps"):
            steps += [tuple(s) for s in data["offline_steps"]]
        elif data.get("step_model"):
            fitted.append(data["step_model"])
    if steps:
        return StepModel(**{k: v for k, v in fit_step_model(steps).items() if k in StepModel.__dataclass_fields__})
    if fitted:
        keys = StepModel.__dataclass_fields__
        return StepModel(**{k: float(np.mean([f[k] for f in fitted])) for k in keys if all(k in f for f in fitted)})
    raise SystemExit(f"no steps or step_model in {', '.join(map(str, paths))}")


@dataclass
class Req:
    id: int
    arrival: float
    prompt: int
    output: int
    adapter: int
    generated: int = 0
    first_token: float | None = None
    migrations: int = 0
    prefilled: bool = False

    @property
    def tokens(self) -> int:
        return self.prompt + self.generated


@dataclass
class Gpu:
    id: str
    max_batch: int
    kv_tokens: int
    running: list = field(default_factory=list)
    busy_until: float = 0.0
    stepping: bool = False
    last_busy: float = -1e9
    in_use_since: float | None = None
    in_use_time: float = 0.0
    full_time: float = 0.0
    idle_in_use_time: float = 0.0

    def view(self, page: int = 16) -> RunnerView:
        used = sum(-(-kv_need(r.tokens, r.output - r.generated) // page) * page for r in self.running)
        return RunnerView(self.id, True, False, len(self.running), self.max_batch, self.kv_tokens - used, self.kv_tokens)


def diurnal_trace(duration_s: float, peak_rps: float, seed: int, num_adapters: int, zipf: float = 1.5) -> list[Req]:
    """Poisson arrivals whose rate follows a day compressed into `duration_s` (low at both ends)."""
    rng = np.random.default_rng(seed)
    t, out = 0.0, []
    p = np.arange(1, num_adapters + 1, dtype=np.float64) ** -zipf
    p /= p.sum()
    while True:
        t += rng.exponential(1.0 / peak_rps)  # thinning of a homogeneous process at the peak rate
        if t >= duration_s:
            return out
        rate = peak_rps * (0.08 + 0.92 * math.sin(math.pi * t / duration_s) ** 2)
        if rng.random() < rate / peak_rps:
            prompt, output = sharegpt_lengths(rng)
            out.append(Req(len(out), t, prompt, output, int(rng.choice(num_adapters, p=p))))


def sharegpt_lengths(rng: np.random.Generator) -> tuple[int, int]:
    """Prompt and output lengths shaped like filtered ShareGPT (means ~250 and ~235 tokens)."""
    prompt = int(np.clip(rng.lognormal(mean=5.0, sigma=0.9), 4, 1024))
    output = int(np.clip(rng.lognormal(mean=5.05, sigma=0.8), 4, 1024))
    return prompt, output


def simulate(trace: list[Req], policy: str, gpus: int, max_batch: int, kv_tokens: int, model: StepModel,
             idle_window: float) -> dict:
    place = POLICIES[policy]()
    pool = [Gpu(f"gpu-{i:02d}", max_batch, kv_tokens) for i in range(gpus)]
    by_id = {g.id: g for g in pool}
    events: list = []  # (time, kind, payload)
    seq = 0
    for r in trace:
        heapq.heappush(events, (r.arrival, seq, "arrive", r))
        seq += 1
    queue: list[Req] = []
    ttft, migrations, done = [], 0, 0
    timeline: list[tuple[float, int, int]] = []  # (t, in-use GPUs, running requests)
    now = 0.0

    def mark_use(g: Gpu, t: float) -> None:
        if g.in_use_since is None:
            g.in_use_since = t

    def try_place(t: float) -> None:
        nonlocal seq
        while queue:
            r = queue[0]
            gid = place([g.view() for g in pool], kv_need(r.tokens, r.output - r.generated))
            if gid is None:
                return
            queue.pop(0)
            g = by_id[gid]
            r.prefilled = False
            g.running.append(r)
            mark_use(g, t)
            if not g.stepping:
                g.stepping = True
                heapq.heappush(events, (t, seq, "step", g))
                seq += 1

    def enqueue(r: Req) -> None:
        i = len(queue)
        while i > 0 and queue[i - 1].arrival > r.arrival:
            i -= 1
        queue.insert(i, r)

    last_sample = 0.0
    while events:
        t, _, kind, obj = heapq.heappop(events)
        # account time since `now` for every GPU
        dt = t - now
        if dt > 0:
            for g in pool:
                if g.in_use_since is not None:
                    g.in_use_time += dt
                    if len(g.running) >= g.max_batch:
                        g.full_time += dt
                    elif not g.running:
                        g.idle_in_use_time += dt
                    if not g.running and t - g.last_busy > idle_window:
                        g.in_use_since = None  # released by the autoscaler
        now = t
        if kind == "arrive":
            enqueue(obj)
            try_place(t)
        else:
            g = obj
            if not g.running:
                g.stepping = False
                g.last_busy = t
                continue
            # KV: every running request grows by one token; out of room -> evict the newest
            while sum(r.tokens + 1 for r in g.running) > g.kv_tokens and len(g.running) > 1:
                victim = max(g.running, key=lambda r: r.arrival)
                g.running.remove(victim)
                victim.migrations += 1
                migrations += 1
                enqueue(victim)
            prefill = sum(r.tokens for r in g.running if not r.prefilled)
            ms = model.step_ms(len(g.running), prefill)
            end = t + ms / 1000.0
            for r in list(g.running):
                r.prefilled = True
                r.generated += 1
                if r.first_token is None:
                    r.first_token = end
                    ttft.append(end - r.arrival)
                if r.generated >= r.output:
                    g.running.remove(r)
                    done += 1
            g.last_busy = end
            heapq.heappush(events, (end, seq, "step", g))
            seq += 1
            try_place(end)
        if now - last_sample >= 10.0:
            timeline.append((round(now, 1), sum(1 for g in pool if g.in_use_since is not None),
                             sum(len(g.running) for g in pool)))
            last_sample = now
    total_in_use = sum(g.in_use_time for g in pool)
    return {
        "policy": policy,
        "requests": len(trace),
        "completed": done,
        "gpu_hours": round(total_in_use / 3600.0, 3),
        "frac_time_at_max_batch": round(sum(g.full_time for g in pool) / max(total_in_use, 1e-9), 4),
        "frac_time_idle": round(sum(g.idle_in_use_time for g in pool) / max(total_in_use, 1e-9), 4),
        "migrations": migrations,
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 4) if ttft else None,
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 4) if ttft else None,
        "per_gpu_hours": {g.id: round(g.in_use_time / 3600.0, 3) for g in pool},
        "timeline": timeline,
    }


def plot(results: list[dict], trace: list[Req], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1 + len(results), 1, figsize=(9, 2.2 * (1 + len(results))), sharex=True)
    arr = np.array([r.arrival for r in trace])
    bins = np.arange(0, arr.max() + 60, 60)
    axes[0].hist(arr / 60, bins=bins / 60, color="gray")
    axes[0].set_ylabel("arrivals/min")
    for ax, res in zip(axes[1:], results):
        tl = np.array(res["timeline"])
        ax.plot(tl[:, 0] / 60, tl[:, 1], label="GPUs in use")
        ax.plot(tl[:, 0] / 60, tl[:, 2] / 32, label="running / 32")
        ax.set_ylabel(res["policy"])
        ax.set_ylim(0, 17)
        ax.legend(loc="upper right", fontsize=7)
    axes[-1].set_xlabel("minutes")
    fig.suptitle("GPUs in use under each placement policy (16 GPUs, diurnal trace, Zipf-1.5 adapters)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=16)
    p.add_argument("--duration", type=float, default=3600.0, help="trace length in seconds")
    p.add_argument("--peak-rps", type=float, default=30.0, help="arrival rate at the busiest moment")
    p.add_argument("--adapters", type=int, default=1000, help="adapter population (Zipf-1.5 popularity)")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--kv-tokens", type=int, default=48000, help="KV capacity of one GPU in tokens")
    p.add_argument("--idle-window", type=float, default=60.0, help="seconds idle before a GPU is released")
    p.add_argument("--step-model", type=Path, default=None,
                   help="JSON with decode_base_ms, decode_per_req_ms, prefill_per_token_ms (from bench e2e)")
    p.add_argument("--fit-from", type=Path, nargs="+", default=None, metavar="JSON",
                   help="refit the step model from `bench serve` / `bench e2e` result files (overrides --step-model)")
    p.add_argument("--policies", nargs="+", default=["busiest", "least-loaded", "round-robin"], choices=list(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write full results as JSON")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG like Punica's Fig. 13")


def run(args: argparse.Namespace) -> int:
    if args.fit_from:
        model = refit(args.fit_from)
        print(f"step model refitted from {len(args.fit_from)} file(s): {vars(model)}", file=sys.stderr)
    else:
        model = StepModel.from_json(args.step_model) if args.step_model else StepModel()
    trace = diurnal_trace(args.duration, args.peak_rps, args.seed, args.adapters)
    results = []
    for pol in args.policies:
        res = simulate([Req(r.id, r.arrival, r.prompt, r.output, r.adapter) for r in trace], pol, args.gpus,
                       args.max_batch, args.kv_tokens, model, args.idle_window)
        results.append(res)
        print(f"{pol:>13}: {res['completed']}/{res['requests']} done, {res['gpu_hours']:.2f} GPU-h, "
              f"at max batch {100 * res['frac_time_at_max_batch']:.1f}%, idle {100 * res['frac_time_idle']:.1f}%, "
              f"migrations {res['migrations']}, TTFT p99 {res['ttft_p99_s']} s", file=sys.stderr)
    def plain(v):
        return str(v) if isinstance(v, Path) else [plain(x) for x in v] if isinstance(v, list) else v

    summary = {"config": {k: plain(v) for k, v in vars(args).items()
                          if not k.startswith("_") and k not in ("log_level", "command")},
               "step_model": vars(model), "results": results}
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot(results, trace, args.plot)
    print("| policy | GPU-hours | time at max batch | time idle (in use) | migrations | TTFT p50 (s) | TTFT p99 (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['policy']} | {r['gpu_hours']:.2f} | {100 * r['frac_time_at_max_batch']:.1f}% | "
              f"{100 * r['frac_time_idle']:.1f}% | {r['migrations']} | {r['ttft_p50_s']} | {r['ttft_p99_s']} |")
    return 0

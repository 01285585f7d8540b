"""`lorafleet simulate`: placement policies over a one-hour diurnal trace on simulated GPUs.

The simulated runners batch continuously like the engine: each step every running request
gains one token and prefills of newly placed requests are added to that step; the step time
is a model fitted on the real engine (`decode_ms = a + b * batch`, `prefill_ms = c * tokens`,
from `lorafleet bench e2e` on the card). The placement functions are the scheduler's own
(`placement.py`). A GPU counts as *in use* while it has requests or was busy within the
idle window (after that an autoscaler would drain and release it), which is what GPU-hours
measure. A runner out of KV evicts its newest request, which is re-placed (migration).

Prefix cache: each GPU keeps pages as a runner does (`PageCache`): the full pages of its running
requests stay, the pages of requests that left stay cached in the room the running requests
leave, least recently used out first; a placed request computes only the tokens after its
longest cached run of pages. The placement policy sees the scheduler's own `PrefixIndex`
(`prefix_index.py`), fed as the scheduler feeds it (at placement and when a request ends), never
the GPUs' caches; a GPU released by the autoscaler comes back with an empty cache. Workloads:
`sharegpt` (independent prompts, nothing shared) and `chat` (each adapter has a system prompt;
conversations of several turns, each turn resending the history, the next turn arriving a think
time after the previous answer ended; `--system-prompt 0` leaves only the conversations). Policies
are `placement.POLICIES` names; `busiest@T` is busiest with `prefix_tokens_per_slot=T`; the
suffix `:no-cache` runs a policy on runners without a prefix cache (as before the cache existed),
so one run compares today's policy, prefix-ignoring and prefix-aware placement:

    lorafleet simulate --workload chat --policies busiest-no-prefix:no-cache busiest-no-prefix busiest
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import math
import sys
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lorafleet.common import cli_args
from lorafleet.common.cli_args import non_negative_float, non_negative_int, positive_float, positive_int
from lorafleet.scheduler.placement import POLICIES, RunnerView, busiest_fit, kv_need
from lorafleet.scheduler.prefix_index import MAX_PAGES, PrefixIndex

PAGE = 16  # tokens per KV page
NO_CACHE = ":no-cache"  # policy suffix: runners without a prefix cache
# Arrivals the trace draws at the peak rate (--duration x --peak-rps) and adapters it draws from: beyond these the
# trace alone takes hours or all the memory (--peak-rps 1e308 never ended), so they are refused at once.
MAX_ARRIVALS = 10_000_000
MAX_ADAPTERS = 10_000_000


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
        if not isinstance(data, dict):
            raise ValueError("its step_model is not an object")
        model = {}
        for k, v in data.items():
            if k in cls.__dataclass_fields__:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                    raise ValueError(f"{k} must be a finite number of at least 0, got {v!r}")
                model[k] = float(v)
        return cls(**model)


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
class Conversation:
    """A chat: its adapter, its turns' (user tokens, output tokens), the think time before each next turn."""

    id: int
    adapter: int
    system_prompt: int
    turns: list[tuple[int, int]]
    think_s: list[float]


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
    segs: tuple = ()  # the prompt's content as (segment id, tokens): equal ids, equal tokens; () = its own
    conv: Conversation | None = None
    turn: int = 0
    cached: int = 0  # tokens its GPU held cached when it was placed there
    reported: int | None = None  # cached tokens at its first placement (the API's cached_tokens)
    held: list = field(default_factory=list)  # keys of the cached pages it holds on its GPU
    _keys: tuple = (-1, [])

    @property
    def tokens(self) -> int:
        return self.prompt + self.generated

    def keys(self, n_tokens: int) -> list:
        """Keys of the full pages of its first `n_tokens` tokens (prompt, then its output): (the segment holding
        the page's last token, the page's end) names a page's whole prefix."""
        if self._keys[0] == n_tokens:
            return self._keys[1]
        segs = self.segs or ((("p", self.id), self.prompt),)
        segs = segs + ((("a", self.id), self.output),)
        keys, end, x, stop = [], 0, PAGE, n_tokens
        for sid, length in segs:
            end += length
            while x <= end and x <= stop:
                keys.append((sid, x))
                x += PAGE
            if x > stop:
                break
        self._keys = (n_tokens, keys)
        return keys


class PageCache:
    """One GPU's prefix cache as a runner keeps it (runner/engine/block_manager.py): the full pages that running
    requests hold stay; the others stay cached, least recently used first out, in the pages left free."""

    def __init__(self):
        self.held: Counter = Counter()  # key -> running requests holding that page
        self.lru: OrderedDict = OrderedDict()  # cached pages nobody holds, oldest first

    def match(self, keys: list) -> int:
        """How many leading pages of `keys` it holds."""
        n = 0
        for k in keys:
            if k not in self.held and k not in self.lru:
                break
            n += 1
        return n

    def hold(self, keys: list) -> None:
        for k in keys:
            self.lru.pop(k, None)
            self.held[k] += 1

    def release(self, held: list, computed: list) -> None:
        """A request leaves: it held `held` and computed the pages `computed` (a page table is freed from its
        end, so its first pages stay cached longest)."""
        for k in held:
            self.held[k] -= 1
            if not self.held[k]:
                del self.held[k]
        for k in reversed(computed):
            if k not in self.held:
                self.lru[k] = None
                self.lru.move_to_end(k)

    def trim(self, pages: int) -> None:
        """Keep at most `pages` pages, held ones included: the least recently used unheld ones go first."""
        while self.lru and len(self.held) + len(self.lru) > pages:
            self.lru.popitem(last=False)

    def clear(self) -> None:
        self.held.clear()
        self.lru.clear()


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
    cache: PageCache = field(default_factory=PageCache)

    def view(self, page: int = PAGE, prefix_tokens: int = 0) -> RunnerView:
        used = sum(-(-kv_need(r.tokens, r.output - r.generated) // page) * page for r in self.running)
        return RunnerView(self.id, True, False, len(self.running), self.max_batch, self.kv_tokens - used, self.kv_tokens,
                          prefix_tokens=prefix_tokens)

    def trim_cache(self) -> None:
        """Cached pages nobody holds live in the pages its running requests leave free."""
        private = sum(-(-r.tokens // PAGE) - len(r.held) for r in self.running)
        self.cache.trim(self.kv_tokens // PAGE - private)


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


def chat_trace(duration_s: float, peak_rps: float, seed: int, num_adapters: int, system_prompt: int, turns: int,
               think_s: float, max_context: int, zipf: float = 1.5) -> list[Req]:
    """First turns of conversations starting at `peak_rps / turns` per second at the peak (so about `peak_rps`
    requests per second), each under a Zipf-popular adapter whose system prompt opens every turn; each turn
    adds ShareGPT-like user and output lengths, ending the conversation where the context would overflow."""
    rng = np.random.default_rng(seed)
    conv_rate = peak_rps / turns
    t, out = 0.0, []
    p = np.arange(1, num_adapters + 1, dtype=np.float64) ** -zipf
    p /= p.sum()
    while True:
        t += rng.exponential(1.0 / conv_rate)
        if t >= duration_s:
            return out
        rate = conv_rate * (0.08 + 0.92 * math.sin(math.pi * t / duration_s) ** 2)
        if rng.random() >= rate / conv_rate:
            continue
        lengths, used = [], system_prompt
        for _ in range(turns):
            user, output = sharegpt_lengths(rng)
            if used + user + output > max_context:
                break
            lengths.append((user, output))
            used += user + output
        if not lengths:
            continue
        conv = Conversation(len(out), int(rng.choice(num_adapters, p=p)), system_prompt, lengths,
                            [float(rng.exponential(think_s)) for _ in lengths])
        out.append(turn_request(conv, 0, t, None))


def turn_request(conv: Conversation, turn: int, arrival: float, prev: Req | None) -> Req:
    """Turn `turn` of a conversation: the system prompt, every earlier turn and its answer, the new user text."""
    user, output = conv.turns[turn]
    if prev is None:
        segs = ((("sys", conv.adapter), conv.system_prompt),)
    else:
        segs = prev.segs + ((("a", prev.id), prev.output),)
    segs = segs + ((("u", conv.id, turn), user),)
    return Req((conv.id, turn), arrival, sum(n for _, n in segs), output, conv.adapter, segs=segs, conv=conv,
               turn=turn)


def sharegpt_lengths(rng: np.random.Generator) -> tuple[int, int]:
    """Prompt and output lengths shaped like filtered ShareGPT (means ~250 and ~235 tokens)."""
    prompt = int(np.clip(rng.lognormal(mean=5.0, sigma=0.9), 4, 1024))
    output = int(np.clip(rng.lognormal(mean=5.05, sigma=0.8), 4, 1024))
    return prompt, output


def make_policy(name: str):
    """A placement function: a `placement.POLICIES` name, or `busiest@T` (busiest with T prefix tokens per place)."""
    if "@" in name:
        base, per_slot = name.split("@", 1)
        if base != "busiest" or not per_slot.isdigit():
            raise SystemExit(f"policy {name!r}: only busiest@TOKENS takes a value")
        return functools.partial(busiest_fit, prefix_tokens_per_slot=int(per_slot))
    if name not in POLICIES:
        raise SystemExit(f"policy {name!r}: choose from {', '.join(POLICIES)} or busiest@TOKENS, each optionally "
                         f"{NO_CACHE}")
    return POLICIES[name]()


def simulate(trace: list[Req], policy: str, gpus: int, max_batch: int, kv_tokens: int, model: StepModel,
             idle_window: float, prefix_cache: bool = True) -> dict:
    """Run `trace` under `policy` (a `make_policy` name; with the suffix `:no-cache` the runners keep no prefix
    cache, as `prefix_cache=False` does)."""
    name, no_cache = policy.removesuffix(NO_CACHE), policy.endswith(NO_CACHE)
    place = make_policy(name)
    prefix_cache = prefix_cache and not no_cache
    pool = [Gpu(f"gpu-{i:02d}", max_batch, kv_tokens) for i in range(gpus)]
    by_id = {g.id: g for g in pool}
    index = PrefixIndex()  # what the scheduler believes each GPU holds (each GPU's `cache` is the truth)
    events: list = []  # (time, kind, payload)
    seq = 0
    for r in trace:
        heapq.heappush(events, (r.arrival, seq, "arrive", r))
        seq += 1
    queue: list[Req] = []
    ttft, migrations, done, requests = [], 0, 0, len(trace)
    unplaced = cut = 0  # ended: a prompt no GPU's KV holds / a lone request at its GPU's KV limit (as cluster.py)
    queries = hits = prefill_computed = 0
    timeline: list[tuple[float, int, int]] = []  # (t, in-use GPUs, running requests)
    now = 0.0

    def mark_use(g: Gpu, t: float) -> None:
        if g.in_use_since is None:
            g.in_use_since = t

    def remember(g: Gpu, keys: list) -> None:  # as Cluster._remember does
        if prefix_cache:
            index.record(g.id, keys[:MAX_PAGES], kv_tokens // PAGE)

    def try_place(t: float) -> None:
        nonlocal seq, queries, hits, unplaced
        while queue:
            r = queue[0]
            if r.tokens + 1 > kv_tokens:  # it has outgrown every GPU: it ends (the scheduler's Cluster._outgrown)
                queue.pop(0)
                unplaced += 1
                continue
            keys = r.keys(r.tokens - 1)
            views = [g.view(prefix_tokens=index.match(g.id, keys[:MAX_PAGES]) * PAGE) for g in pool]
            # (its need capped at a GPU's KV, never below its tokens + 1, as Cluster.dispatch caps it)
            need = max(min(kv_need(r.tokens, r.output - r.generated), kv_tokens), r.tokens + 1)
            gid = place(views, need, r.tokens)
            if gid is None:
                return
            queue.pop(0)
            g = by_id[gid]
            r.prefilled = False
            r.cached = g.cache.match(keys) * PAGE if prefix_cache else 0
            if r.reported is None:
                r.reported = r.cached
                queries += r.prompt
                hits += r.cached
            g.running.append(r)
            if prefix_cache:
                r.held = keys
                g.cache.hold(keys)
                g.trim_cache()
            remember(g, keys)
            mark_use(g, t)
            if not g.stepping:
                g.stepping = True
                heapq.heappush(events, (t, seq, "step", g))
                seq += 1

    def leave(g: Gpu, r: Req, computed: list) -> None:
        g.running.remove(r)
        if prefix_cache:
            g.cache.release(r.held, computed)
            r.held = []

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
                        g.in_use_since = None  # released by the autoscaler: it comes back with an empty cache
                        g.cache.clear()
                        index.forget(g.id)
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
                leave(g, victim, victim.held)
                victim.migrations += 1
                migrations += 1
                enqueue(victim)
            lone = g.running[0]
            if lone.tokens + 1 > g.kv_tokens:  # alone and out of KV: it ends at its length limit, as the engine ends it
                lone.output = lone.generated
                cut += 1
            prefill = sum(r.tokens - r.cached for r in g.running if not r.prefilled)
            prefill_computed += prefill
            ms = model.step_ms(len(g.running), prefill)
            end = t + ms / 1000.0
            for r in list(g.running):
                if r.generated < r.output:
                    r.prefilled = True
                    r.generated += 1
                if r.first_token is None:
                    r.first_token = end
                    ttft.append(end - r.arrival)
                if r.generated >= r.output:
                    keys = r.keys(r.tokens - 1)  # its answer's pages too: the next turn resends them
                    leave(g, r, keys)
                    remember(g, keys)
                    done += 1
                    c = r.conv
                    if c is not None and r.turn + 1 < len(c.turns):
                        nxt = turn_request(c, r.turn + 1, end + c.think_s[r.turn], r)
                        requests += 1
                        heapq.heappush(events, (nxt.arrival, seq, "arrive", nxt))
                        seq += 1
            if prefix_cache:
                g.trim_cache()
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
        "prefix_cache": prefix_cache,
        "requests": requests,
        "completed": done,
        "ended_unplaced": unplaced,
        "ended_at_kv_limit": cut,
        "gpu_hours": round(total_in_use / 3600.0, 3),
        "frac_time_at_max_batch": round(sum(g.full_time for g in pool) / max(total_in_use, 1e-9), 4),
        "frac_time_idle": round(sum(g.idle_in_use_time for g in pool) / max(total_in_use, 1e-9), 4),
        "migrations": migrations,
        "prompt_tokens": queries,
        "cached_tokens": hits,
        "hit_rate": round(hits / max(queries, 1), 4),
        "prefill_tokens_computed": prefill_computed,
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
    p.add_argument("--gpus", type=positive_int, default=16, help="simulated GPUs in the cluster, one runner each")
    p.add_argument("--duration", type=positive_float, default=3600.0, help="trace length in seconds")
    p.add_argument("--peak-rps", type=positive_float, default=30.0, help="arrival rate at the busiest moment")
    p.add_argument("--adapters", type=positive_int, default=1000, help="adapter population (Zipf-1.5 popularity)")
    p.add_argument("--max-batch", type=positive_int, default=32, help="max batch size of each simulated runner")
    p.add_argument("--kv-tokens", type=positive_int, default=48000, help="KV capacity of one GPU in tokens")
    p.add_argument("--idle-window", type=non_negative_float, default=60.0, help="seconds idle before a GPU is released")
    p.add_argument("--step-model", type=cli_args.json_file, default=None,
                   help="JSON with decode_base_ms, decode_per_req_ms, prefill_per_token_ms (from bench e2e; "
                        f"default: {StepModel.decode_base_ms}, {StepModel.decode_per_req_ms}, "
                        f"{StepModel.prefill_per_token_ms})")
    p.add_argument("--fit-from", type=cli_args.json_file, nargs="+", default=None, metavar="JSON",
                   help="refit the step model from `bench serve` / `bench e2e` result files (overrides --step-model)")
    p.add_argument("--policies", nargs="+", default=["busiest", "least-loaded", "round-robin"], metavar="POLICY",
                   help=f"placement policies: {', '.join(POLICIES)}, or busiest@TOKENS (prefix tokens worth one "
                        f"batch place); each may end in {NO_CACHE} (its runners keep no prefix cache)")
    p.add_argument("--workload", choices=["sharegpt", "chat"], default="sharegpt",
                   help="sharegpt: independent prompts; chat: per-adapter system prompts and multi-turn conversations")
    p.add_argument("--system-prompt", type=non_negative_int, default=1024,
                   help="chat: system prompt tokens of every adapter")
    p.add_argument("--turns", type=positive_int, default=4, help="chat: turns per conversation")
    p.add_argument("--think-time", type=non_negative_float, default=15.0,
                   help="chat: mean seconds between an answer and the next turn")
    p.add_argument("--max-context", type=positive_int, default=4096,
                   help="chat: a conversation ends before it would overflow this")
    p.add_argument("--no-prefix-cache", action="store_true", help="runners keep no prefix cache")
    p.add_argument("--seed", type=int, default=0, help="seed of the trace: arrivals, lengths and adapters")
    p.add_argument("--out", type=cli_args.output_file, default=None,
                   help="write full results as JSON (default: not written)")
    p.add_argument("--plot", type=cli_args.output_file, default=None,
                   help="write a PNG like Punica's Fig. 13 (default: none)")


def make_trace(args: argparse.Namespace) -> list[Req]:
    if args.workload == "chat":
        return chat_trace(args.duration, args.peak_rps, args.seed, args.adapters, args.system_prompt, args.turns,
                          args.think_time, args.max_context)
    return diurnal_trace(args.duration, args.peak_rps, args.seed, args.adapters)


def run(args: argparse.Namespace) -> int:
    if args.duration * args.peak_rps > MAX_ARRIVALS:
        raise SystemExit(f"lorafleet simulate: error: --duration {args.duration:g} x --peak-rps {args.peak_rps:g} is "
                         f"more than {MAX_ARRIVALS:,} arrivals to draw; shorten --duration or lower --peak-rps")
    if args.adapters > MAX_ADAPTERS:
        raise SystemExit(f"lorafleet simulate: error: --adapters {args.adapters} is more than {MAX_ADAPTERS:,}")
    for pol in args.policies:
        make_policy(pol.removesuffix(NO_CACHE))
    if args.fit_from:
        try:
            model = refit(args.fit_from)
        except (ValueError, TypeError, KeyError, IndexError) as exc:  # steps or fits of another shape
            raise SystemExit(f"lorafleet simulate: error: --fit-from: the files' steps or step_model cannot be read "
                             f"({type(exc).__name__}: {exc})") from None
        print(f"step model refitted from {len(args.fit_from)} file(s): {vars(model)}", file=sys.stderr)
    else:
        try:
            model = StepModel.from_json(args.step_model) if args.step_model else StepModel()
        except ValueError as exc:
            raise SystemExit(f"lorafleet simulate: error: --step-model {args.step_model}: {exc}") from None
    results = []
    for pol in args.policies:
        trace = make_trace(args)  # fresh requests per policy (the same draws)
        if not trace:
            raise SystemExit("lorafleet simulate: error: the trace has no requests; lengthen --duration or raise "
                             "--peak-rps" + (" (chat: a first turn must fit --max-context after --system-prompt)"
                                             if args.workload == "chat" else ""))
        shortest = min(r.prompt for r in trace)
        if shortest + 1 > args.kv_tokens:
            raise SystemExit(f"lorafleet simulate: error: every prompt is longer than one GPU's KV holds "
                             f"(--kv-tokens {args.kv_tokens}; the shortest prompt has {shortest} tokens)")
        res = simulate(trace, pol, args.gpus, args.max_batch, args.kv_tokens, model, args.idle_window,
                       prefix_cache=not args.no_prefix_cache)
        results.append(res)
        print(f"{pol:>13}: {res['completed']}/{res['requests']} done, {res['gpu_hours']:.2f} GPU-h, "
              f"at max batch {100 * res['frac_time_at_max_batch']:.1f}%, idle {100 * res['frac_time_idle']:.1f}%, "
              f"migrations {res['migrations']}, hit rate {100 * res['hit_rate']:.1f}%, TTFT p99 {res['ttft_p99_s']} s"
              + (f"; {res['ended_unplaced']} ended unplaced (a prompt longer than one GPU's KV)"
                 if res["ended_unplaced"] else "")
              + (f"; {res['ended_at_kv_limit']} ended at their GPU's KV limit" if res["ended_at_kv_limit"] else ""),
              file=sys.stderr)
    def plain(v):
        return str(v) if isinstance(v, Path) else [plain(x) for x in v] if isinstance(v, list) else v

    summary = {"config": {k: plain(v) for k, v in vars(args).items()
                          if not k.startswith("_") and k not in ("log_level", "command")},
               "step_model": vars(model), "results": results}
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot(results, make_trace(args), args.plot)
    print("| policy | GPU-hours | time at max batch | time idle (in use) | migrations | prompt tokens | computed | "
          "hit rate | TTFT p50 (s) | TTFT p99 (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['policy']} | {r['gpu_hours']:.2f} | {100 * r['frac_time_at_max_batch']:.1f}% | "
              f"{100 * r['frac_time_idle']:.1f}% | {r['migrations']} | {r['prompt_tokens']:,} | "
              f"{r['prefill_tokens_computed']:,} | {100 * r['hit_rate']:.1f}% | {r['ttft_p50_s']} | {r['ttft_p99_s']} |")
    return 0

"""An OpenAI-API load client (no torch): send requests on a schedule, time every streamed chunk.

    reqs = [LoadRequest(model, prompt_ids, max_tokens), ...]
    results = await run_load(url, reqs, rate=None | requests_per_s, seed=0, max_concurrency=None)
    summary(results, wall_s, slo) -> throughput, TTFT, TPOT, ITL p50/p99, goodput

Requests go to `POST /v1/completions` with token-id prompts, `ignore_eos` (lorafleet's
pass-through extension) and `stream_options.include_usage`, so output lengths are exact and
counted by the server. `rate=None` sends all at t=0; otherwise arrivals are Poisson at `rate`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np


@dataclass(frozen=True)
class LoadRequest:
    model: str
    prompt_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None  # sent as the request's cache_salt: its prefix pages are its own


@dataclass
class Result:
    ok: bool = False
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: prompt tokens a runner's prefix cache held
    start: float = 0.0  # perf_counter when sent
    ttft: float | None = None  # s from send to the first text chunk
    e2e: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each text chunk
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def arrival_times(n: int, rate: float | None, seed: int) -> list[float]:
    if not rate:
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, size=n)).tolist()


async def one(session: aiohttp.ClientSession, url: str, req: LoadRequest, headers: dict) -> Result:
    body = {"model": req.model, "prompt": req.prompt_ids, "max_tokens": req.max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if req.cache_salt:
        body["cache_salt"] = req.cache_salt
    res = Result(start=time.perf_counter())
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            times = res.chunk_times
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    res.ok = res.error is None
                    break
                if b'"finish_reason":null' in line:
                    times.append(time.perf_counter())
                elif b'"usage"' in line:
                    ev = json.loads(line[6:])
                    if not ev.get("choices") and ev.get("usage"):
                        use = ev["usage"]
                        res.output_tokens, res.prompt_tokens = use["completion_tokens"], use["prompt_tokens"]
                        res.cached_tokens = int((use.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                elif line.startswith(b'data: {"error"'):
                    res.error = json.loads(line[6:])["error"]["message"]
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    if res.chunk_times:
        res.ttft = res.chunk_times[0] - res.start
    res.e2e = end - res.start
    return res


async def run_load(url: str, reqs: list[LoadRequest], rate: float | None = None, seed: int = 0,
                   max_concurrency: int | None = None, headers: dict | None = None,
                   timeout_s: float = 3600.0) -> tuple[list[Result], float]:
    """Send every request on its schedule; (results in request order, wall seconds)."""
    arrivals = arrival_times(len(reqs), rate, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        t0 = time.perf_counter()

        async def scheduled(i: int) -> Result:
            delay = t0 + arrivals[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                return await one(session, url, reqs[i], headers or {})
            async with sem:
                return await one(session, url, reqs[i], headers or {})

        results = await asyncio.gather(*(scheduled(i) for i in range(len(reqs))))
        return list(results), time.perf_counter() - t0


def pct(xs, q) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def summary(results: list[Result], wall: float, slo_ttft_s: float | None = None,
            slo_tpot_ms: float | None = None) -> dict:
    """Throughput and latency figures of one run (seconds, except TPOT and ITL in ms)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]

    def good(r: Result) -> bool:
        return ((slo_ttft_s is None or (r.ttft is not None and r.ttft <= slo_ttft_s))
                and (slo_tpot_ms is None or r.tpot is None or 1000 * r.tpot <= slo_tpot_ms))

    r3 = lambda v, k=1.0: None if v is None else round(v * k, 3)  # noqa: E731
    out = {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "seconds": round(wall, 3), "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / wall, 1) if wall > 0 else None,
        "request_rate_done": round(len(ok) / wall, 3) if wall > 0 else None,
        "ttft_p50_s": r3(pct(ttft, 50)), "ttft_p99_s": r3(pct(ttft, 99)),
        "tpot_p50_ms": r3(pct(tpot, 50), 1000), "tpot_p99_ms": r3(pct(tpot, 99), 1000),
        "itl_p50_ms": r3(pct(itl, 50), 1000), "itl_p99_ms": r3(pct(itl, 99), 1000),
    }
    if slo_ttft_s is not None or slo_tpot_ms is not None:
        g = [r for r in ok if good(r)]
        out["goodput_req_s"] = round(len(g) / wall, 3) if wall > 0 else None
        out["goodput_tok_s"] = round(sum(r.output_tokens for r in g) / wall, 1) if wall > 0 else None
        out["slo"] = {"ttft_s": slo_ttft_s, "tpot_ms": slo_tpot_ms}
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    out.update(prompt_tokens=prompt, prompt_tokens_cached=cached, prompt_tokens_computed=prompt - cached,
               hit_rate=round(cached / prompt, 3) if prompt else 0.0)
    errors = sorted({r.error for r in results if r.error})
    if errors:
        out["errors"] = errors[:5]
    return out

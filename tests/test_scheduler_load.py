"""Bounded load test on loopback: 512 concurrent streams through the scheduler to scripted runners,
three rounds; every stream completes without error and the process's memory stays flat."""

from __future__ import annotations

import asyncio
import gc
import json
import time

import aiohttp
import pytest

from api_helpers import Live
from fake_runner import FakeRunner
from lorafleet.scheduler.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(240)

STREAMS = 512
TOKENS = 16


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def one_stream(session: aiohttp.ClientSession, url: str, i: int) -> int:
    body = {"model": ("base", "pirate", "shouty")[i % 3], "prompt": f"request {i}", "max_tokens": TOKENS,
            "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        done, usage = False, None
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                done = True
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            usage = ev.get("usage") or usage
        assert done and usage is not None
        return usage["completion_tokens"]


async def round_of_streams(url: str) -> list[int]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await asyncio.gather(*(one_stream(session, url, i) for i in range(STREAMS)))


async def test_512_concurrent_streams_no_errors_flat_memory(demo_model):
    runners = [FakeRunner(f"fake-{i}", max_batch_size=STREAMS, total_kv=1_000_000, delay=0.12) for i in range(4)]
    async with Live(Tokenizer(demo_model), runners, max_model_len=512) as live:
        service = live.service
        peak = {"in_flight": 0}

        async def watch():
            while True:
                peak["in_flight"] = max(peak["in_flight"], len(service.in_flight))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        rss, times = [], []
        for _ in range(3):
            t0 = time.monotonic()
            got = await round_of_streams(live.url)
            times.append(time.monotonic() - t0)
            assert got == [TOKENS] * STREAMS
            for _ in range(100):  # cancellations of finished runner streams settle
                if not service.in_flight and not any(r.assigned for r in service.cluster.runners.values()):
                    break
                await asyncio.sleep(0.05)
            gc.collect()
            rss.append(rss_mb())
        watcher.cancel()
        assert peak["in_flight"] == STREAMS, peak  # all of them were open at once
        assert not service.in_flight and not service.cluster.queue
        assert not service.disconnects._watched
        assert service.metrics.unhandled_errors._value.get() == 0
        ok = service.metrics.http_requests.labels(route="/v1/completions", code="200")._value.get()
        assert ok == 3 * STREAMS
        # flat: the later rounds hold no more memory than the first one left behind (small slack)
        assert rss[2] - rss[0] < 20, (rss, times)

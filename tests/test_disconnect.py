"""A client that goes away cancels its work, streaming or not, queued or running — with aiohttp's
production setting (handlers are not cancelled on disconnect), so the scheduler must notice."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from api_helpers import Live
from fake_runner import FakeRunner

pytestmark = pytest.mark.timeout(120)


async def until(cond, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def abandon(url: str, body: dict, after: float) -> None:
    """Send a request and close the connection after `after` seconds without reading the answer."""
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(f"{url}/v1/completions", json=body))
        await asyncio.sleep(after)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("stream", [False, True])
async def test_running_request_of_a_gone_client_stops_generating(tok, stream):
    fr = FakeRunner(delay=0.02)
    async with Live(tok, [fr]) as live:
        body = {"model": "base", "prompt": "count", "max_tokens": 200, "stream": stream}
        await abandon(live.url, body, after=0.5)
        await until(lambda: fr.cancelled, timeout=3.0)  # the runner's stream was closed: generation stopped
        await until(lambda: not live.service.in_flight)
        assert len(fr.seen) == 1 and not fr.active
        text = (live.service.metrics.http_requests.labels(route="/v1/completions", code="499")._value.get())
        assert text == 1
        seq = live.service.metrics.sequences.labels(finish_reason="cancelled")._value.get()
        assert seq == 1


async def test_queued_request_of_a_gone_client_leaves_the_queue(tok):
    fr = FakeRunner(max_batch_size=1, delay=0.02)
    async with Live(tok, [fr]) as live:
        async with aiohttp.ClientSession() as s:
            busy = asyncio.create_task(s.post(f"{live.url}/v1/completions",
                                              json={"model": "base", "prompt": "a", "max_tokens": 60}))
            await until(lambda: fr.active)
            await abandon(live.url, {"model": "base", "prompt": "b", "max_tokens": 60}, after=0.3)
            await until(lambda: not live.service.cluster.queue)
            resp = await busy
            assert resp.status == 200
        assert len(fr.seen) == 1  # the abandoned request never reached a runner
        await until(lambda: not live.service.in_flight)

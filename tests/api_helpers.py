"""A scheduler over scripted runners, in-process: through aiohttp's test client, or `live` on a
real loopback port with aiohttp's production setting (handlers are not cancelled when a client
disconnects, as under `web.run_app`)."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from lorafleet.scheduler.discovery import RunnerDirectory, RunnerEndpoint
from lorafleet.scheduler.registry import AdapterEntry, AdapterRegistry
from lorafleet.scheduler.server import SchedulerService, create_app

TOKEN = "s3cret"


def default_registry() -> AdapterRegistry:
    return AdapterRegistry([AdapterEntry("pirate", "/nowhere/pirate"), AdapterEntry("shouty", "/nowhere/shouty")])


async def start_runners(runners) -> tuple[list[TestServer], list[RunnerEndpoint]]:
    servers, eps = [], []
    for fr in runners:
        ts = TestServer(fr.app())
        await ts.start_server()
        servers.append(ts)
        eps.append(RunnerEndpoint(fr.rid, str(ts.make_url("")).rstrip("/")))
    return servers, eps


def make_service(tok, eps, registry=None, **kw) -> SchedulerService:
    return SchedulerService(tok, "base", registry or default_registry(), RunnerDirectory(eps),
                            max_model_len=kw.pop("max_model_len", 256), admin_token=kw.pop("admin_token", TOKEN),
                            poll_interval=kw.pop("poll_interval", 0.05), **kw)


async def wait_healthy(service, expect: bool) -> None:
    for _ in range(200):
        if not expect or service.cluster.any_healthy():
            return
        await asyncio.sleep(0.02)


async def start(tok, runners, registry=None, **kw):
    """(test client, service, runner servers) — the scheduler behind aiohttp's TestClient."""
    servers, eps = await start_runners(runners)
    service = make_service(tok, eps, registry, **kw)
    client = TestClient(TestServer(create_app(service)))
    await client.start_server()
    await wait_healthy(service, bool(runners))
    return client, service, servers


async def stop(client, servers):
    await client.close()
    for s in servers:
        await s.close()


class Live:
    """The scheduler on 127.0.0.1 with `handler_cancellation=False` (what `web.run_app` uses)."""

    def __init__(self, tok, runners, registry=None, **kw):
        self.tok, self.runners, self.registry, self.kw = tok, runners, registry, kw

    async def __aenter__(self):
        self.servers, eps = await start_runners(self.runners)
        self.service = make_service(self.tok, eps, self.registry, **self.kw)
        self.app_runner = web.AppRunner(create_app(self.service), handler_cancellation=False)
        await self.app_runner.setup()
        site = web.TCPSite(self.app_runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        await wait_healthy(self.service, bool(self.runners))
        return self

    async def __aexit__(self, *exc):
        await self.app_runner.cleanup()
        for s in self.servers:
            await s.close()

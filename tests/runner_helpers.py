"""An in-process runner front (real engine core child process) and a stream reader for its protocol."""

from __future__ import annotations

import asyncio
import json
import os
from contextlib import asynccontextmanager

from aiohttp.test_utils import TestClient, TestServer

from lorafleet.runner.service.engine_client import EngineClient
from lorafleet.runner.service.server import RunnerService, create_app


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@asynccontextmanager
async def runner_front(model, token: str | None = None, **config):
    cfg = {"page_size": 4, "num_pages": 256, "max_batch_size": 8, "max_lora_rank": 16, "device": "cpu", **config}
    service = RunnerService(EngineClient(str(model), cfg, log_level="WARNING"), "runner-test", grace_seconds=5)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with TestClient(TestServer(create_app(service, token)), headers=headers) as c:
        for _ in range(600):
            r = await c.get("/readyz")
            if r.status == 200 or service.engine.error:
                break
            await asyncio.sleep(0.05)
        c.service = service
        yield c


class Stream:
    """GET /v1/stream; `events()` collects entries per request until each is finished."""

    def __init__(self, client, sid="s1"):
        self.client, self.sid = client, sid
        self.resp = None
        self.lines: list[dict] = []

    async def open(self):
        self.resp = await self.client.get("/v1/stream", params={"id": self.sid})
        assert self.resp.status == 200, await self.resp.text()
        hello = json.loads(await self.resp.content.readline())
        assert hello["hello"]["stream"] == self.sid
        return self

    async def submit(self, body: dict, status=202):
        r = await self.client.post("/v1/generate", json={**body, "stream": self.sid})
        assert r.status == status, await r.text()
        return r

    async def until_finished(self, rids: set[str], timeout=60.0) -> dict[str, dict]:
        """{rid: {"tokens": [...], "finish": reason, "error": str|None, "cached": prompt tokens found in the prefix
        cache (with the first token) | None}} once every rid finished."""
        out = {rid: {"tokens": [], "finish": None, "error": None, "cached": None} for rid in rids}

        async def read():
            while any(v["finish"] is None for v in out.values()):
                line = await self.resp.content.readline()
                assert line, "stream closed early"
                if not line.strip():
                    continue
                msg = json.loads(line)
                self.lines.append(msg)
                for rid, ids, fin, err, *cached in msg["o"]:
                    if rid in out:
                        out[rid]["tokens"] += ids
                        if cached:
                            out[rid]["cached"] = cached[0]
                        if fin:
                            out[rid]["finish"], out[rid]["error"] = fin, err

        await asyncio.wait_for(read(), timeout)
        return out

    async def first_tokens(self, rid: str, timeout=30.0) -> None:
        async def read():
            while True:
                line = await self.resp.content.readline()
                assert line
                if line.strip() and any(e[0] == rid and e[1] for e in json.loads(line)["o"]):
                    return

        await asyncio.wait_for(read(), timeout)

    def close(self):
        self.resp.close()


def core_pid(service) -> int:
    return service.engine.pid


os.environ.setdefault("OMP_NUM_THREADS", "1")

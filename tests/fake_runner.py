"""A scripted runner (same HTTP protocol as `lorafleet runner`) for scheduler API tests."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web


class FakeRunner:
    def __init__(self, rid="fake-0", max_batch_size=8, total_kv=4096, delay=0.0, first=1000, refuse=None):
        self.rid, self.max_batch_size, self.total_kv, self.delay, self.first = rid, max_batch_size, total_kv, delay, first
        self.refuse = dict(refuse or {})  # adapter name -> reason: answered like a runner that refuses it
        self.active: dict[str, list[int]] = {}
        self.seen: list[dict] = []
        self.cancelled: list[str] = []

    def tokens(self, body):
        n = body["sampling"]["max_tokens"]
        start = len(body["prompt_token_ids"])
        return [self.first + (start + i) % 500 for i in range(n)]

    async def generate(self, request):
        body = await request.json()
        self.seen.append(body)
        rid = body["request_id"]
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        adapter = (body.get("adapter") or {}).get("name")
        if adapter in self.refuse:
            final = {"finish_reason": "error", "output_token_ids": [], "error": f"adapter {adapter!r}: {self.refuse[adapter]}"}
            await resp.write(json.dumps(final).encode() + b"\n")
            return resp
        out = []
        self.active[rid] = out
        try:
            for t in self.tokens(body):
                if self.delay:
                    await asyncio.sleep(self.delay)
                out.append(t)
                await resp.write(json.dumps({"token_ids": [t]}).encode() + b"\n")
            await resp.write(json.dumps({"finish_reason": "length", "output_token_ids": out}).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.cancelled.append(rid)
            raise
        finally:
            self.active.pop(rid, None)
        return resp

    async def state(self, request):
        return web.json_response({
            "id": self.rid, "ready": True, "batch_size": len(self.active), "max_batch_size": self.max_batch_size,
            "waiting": 0, "free_kv_tokens": self.total_kv, "total_kv_tokens": self.total_kv, "idle_seconds": 1.0,
            "running_adapters": {}, "waiting_adapters": {}, "resident_adapters": [], "adapter_pool": {},
            "page_size": 16,
        })

    async def cancel(self, request):
        return web.json_response({"cancelled": True})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/generate", self.generate)
        app.router.add_get("/state", self.state)
        app.router.add_post("/v1/cancel/{rid}", self.cancel)
        return app

"""A scripted runner speaking the real runner protocol (docs/api.md), without a model or torch.

Used by the scheduler's API tests and by `lorafleet bench relay`. Request `rid` with prompt
length P generates ids `first + (P + i) % 500`, i = 0.., up to its max_tokens (or, as the engine, up to one of
its stop_token_ids once min_tokens are out: finish reason "stop"). Every `step_s`
seconds (0: as fast as the stream's writer drains) every active request gets one token, and
each stream gets one line for the whole step, as from a real engine.

    python -m lorafleet.bench.fake_runner --runners 4 --port-file ports.json [--step-ms 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
from pathlib import Path

from aiohttp import web

from lorafleet.runner.service.stream import RunnerStream, hello_line


def _scripted(tok: int, k: int) -> list:
    """A scripted log-probability entry for token `tok` with k alternatives (the next ids, each less likely)."""
    lp = -0.25 * (tok % 7)
    return [lp, [[tok + j, lp - j] for j in range(k)]]


class FakeRunner:
    """`refuse` maps adapter names to a reason: requests for them end at once with the error a
    runner sends for an adapter it cannot load."""

    def __init__(self, rid="fake-0", max_batch_size=8, total_kv=4096, delay=0.0, first=1000, step_s=None,
                 refuse=None):
        self.rid, self.max_batch_size, self.total_kv, self.first = rid, max_batch_size, total_kv, first
        self.refuse = dict(refuse or {})
        self.step_s = delay if step_s is None else step_s
        self.active: dict[str, dict] = {}  # runner request id -> {"stream", "todo", "out"}
        self.streams: dict[str, RunnerStream] = {}
        self.seen: list[dict] = []
        self.cancelled: list[str] = []
        self.steps = 0
        self._wake = asyncio.Event()
        self._stepper: asyncio.Task | None = None

    def tokens(self, body):
        n = body["sampling"]["max_tokens"]
        start = len(body["prompt_token_ids"])
        return [self.first + (start + i) % 500 for i in range(n)]

    async def stream(self, request):
        sid = request.query.get("id") or secrets.token_hex(8)
        st = RunnerStream(sid)
        self.streams[sid] = st
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        try:
            await resp.write(hello_line(self.rid, sid, {"page_size": 16}))
            while (data := await st.next_chunk()) is not None:
                await resp.write(data)
        except (ConnectionResetError, ConnectionError):
            pass
        finally:
            self.streams.pop(sid, None)
            for rid, a in list(self.active.items()):
                if a["stream"] is st:
                    del self.active[rid]
                    self.cancelled.append(rid)
        return resp

    async def generate(self, request):
        body = await request.json()
        self.seen.append(body)
        st = self.streams.get(body.get("stream") or "")
        if st is None:
            return web.json_response({"error": "unknown stream"}, status=404)
        rid = body["request_id"]
        adapter = (body.get("adapter") or {}).get("name")
        if adapter in self.refuse:
            st.deliver([[rid, [], "error", f"adapter {adapter!r}: {self.refuse[adapter]}"]])
            return web.json_response({"request_id": rid, "accepted": True}, status=202)
        self.active[rid] = {"stream": st, "todo": self.tokens(body), "out": 0, "lp": body["sampling"].get("logprobs"),
                            "plp": body["sampling"].get("prompt_logprobs"), "prompt": body["prompt_token_ids"],
                            "stop_ids": set(body["sampling"].get("stop_token_ids") or ()),
                            "min_tokens": body["sampling"].get("min_tokens", 0)}
        self._wake.set()
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.get_running_loop().create_task(self._steps())
        return web.json_response({"request_id": rid, "accepted": True}, status=202)

    async def _steps(self) -> None:
        while True:
            if not self.active:
                self._wake.clear()
                await self._wake.wait()
                continue
            per_stream: dict[int, tuple[RunnerStream, list]] = {}
            for rid, a in list(self.active.items()):
                tok = a["todo"][a["out"]]
                a["out"] += 1
                stop = tok in a["stop_ids"] and a["out"] > a["min_tokens"]  # (as the engine, past min_tokens)
                done = stop or a["out"] >= len(a["todo"])
                if done:
                    del self.active[rid]
                g = per_stream.setdefault(id(a["stream"]), (a["stream"], []))
                g[1].append([rid, [tok], ("stop" if stop else "length") if done else None, None])
                if a.get("lp") is not None:  # scripted log-probabilities: the token, then the next ids, less likely
                    g[1][-1] += [None, [_scripted(tok, a["lp"])]]
                if a.get("plp") is not None:  # its prompt's, all with its first token
                    g[1][-1] += [None] * (6 - len(g[1][-1])) + [[_scripted(t, a["plp"]) for t in a["prompt"][1:]]]
                    a["plp"] = None
            for st, entries in per_stream.values():
                st.deliver(entries)
            self.steps += 1
            await asyncio.sleep(self.step_s)

    async def state(self, request):
        return web.json_response({
            "id": self.rid, "ready": True, "batch_size": len(self.active), "max_batch_size": self.max_batch_size,
            "waiting": 0, "free_kv_tokens": self.total_kv, "total_kv_tokens": self.total_kv, "idle_seconds": 1.0,
            "running_adapters": {}, "waiting_adapters": {}, "resident_adapters": [], "adapter_pool": {},
            "page_size": 16, "engine": {"pid": None, "alive": True},
        })

    async def cancel(self, request):
        rid = request.match_info["rid"]
        a = self.active.pop(rid, None)
        if a is not None:
            self.cancelled.append(rid)
            a["stream"].deliver([[rid, [], "cancelled", None]])
        return web.json_response({"request_id": rid, "cancelled": a is not None})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/stream", self.stream)
        app.router.add_post("/v1/generate", self.generate)
        app.router.add_get("/state", self.state)
        app.router.add_post("/v1/cancel/{rid}", self.cancel)

        async def close_streams(app):
            for st in list(self.streams.values()):
                st.close()
            if self._stepper is not None:
                self._stepper.cancel()

        app.on_shutdown.append(close_streams)
        return app


async def serve(n: int, max_batch: int, step_s: float, port_file: Path, host: str = "127.0.0.1") -> None:
    runners = [FakeRunner(f"fake-{i}", max_batch_size=max_batch, total_kv=1 << 22, step_s=step_s) for i in range(n)]
    sites = []
    for fr in runners:
        ar = web.AppRunner(fr.app(), access_log=None)
        await ar.setup()
        site = web.TCPSite(ar, host, 0)
        await site.start()
        sites.append((ar, site))
    ports = [s._server.sockets[0].getsockname()[1] for _, s in sites]
    port_file.write_text(json.dumps({"urls": [f"http://{host}:{p}" for p in ports]}))
    try:
        await asyncio.Event().wait()
    finally:
        for ar, _ in sites:
            await ar.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lorafleet.bench.fake_runner")
    p.add_argument("--runners", type=int, default=4)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=0.0, help="time between steps (0: as fast as drained)")
    p.add_argument("--port-file", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        asyncio.run(serve(args.runners, args.max_batch, args.step_ms / 1000.0, args.port_file))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Runner -> scheduler stream protocols compared on CPU: the receiving side's CPU per token.

A server process plays runners whose steps give every request one token; the receiving process
(this one, standing in for the scheduler) reads and parses with aiohttp + json as the scheduler
does. "per-request": one NDJSON stream per request, one line per request per step (the previous
protocol). "multiplexed": one stream per runner, one line per step for all its requests (the
current one). Prints receiver CPU microseconds per token for each.

    python scripts/stream_protocols.py [--requests 256] [--steps 200] [--runners 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web


def cpu() -> float:
    t = os.times()
    return t.user + t.system


async def serve(port_file: str, steps: int) -> None:
    async def per_request(request):
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(steps):
            await resp.write(json.dumps({"token_ids": [1000 + i]}).encode() + b"\n")
            await asyncio.sleep(0.002)
        await resp.write(b'{"finish_reason": "length"}\n')
        return resp

    async def multiplexed(request):
        n = int(request.query["n"])
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(steps):
            line = json.dumps({"o": [[f"r{k}", [1000 + i], "length" if i == steps - 1 else None, None]
                                     for k in range(n)]}, separators=(",", ":"))
            await resp.write(line.encode() + b"\n")
            await asyncio.sleep(0.002)
        return resp

    app = web.Application()
    app.router.add_get("/per-request", per_request)
    app.router.add_get("/multiplexed", multiplexed)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    with open(port_file, "w") as f:
        f.write(str(site._server.sockets[0].getsockname()[1]))
    await asyncio.Event().wait()


async def receive(port: int, mode: str, requests: int, runners: int) -> tuple[int, float]:
    tokens = 0
    async with ClientSession(connector=TCPConnector(limit=0), timeout=ClientTimeout(total=None)) as s:
        url = f"http://127.0.0.1:{port}"

        async def one_request():
            nonlocal tokens
            async with s.get(f"{url}/per-request") as r:
                async for line in r.content:
                    ev = json.loads(line)
                    if "token_ids" in ev:
                        tokens += len(ev["token_ids"])

        async def one_runner(n):
            nonlocal tokens
            async with s.get(f"{url}/multiplexed", params={"n": str(n)}) as r:
                async for line in r.content:
                    for rid, ids, fin, err, *_ in json.loads(line)["o"]:
                        tokens += len(ids)

        c0 = cpu()
        if mode == "per-request":
            await asyncio.gather(*(one_request() for _ in range(requests)))
        else:
            await asyncio.gather(*(one_runner(requests // runners) for _ in range(runners)))
        return tokens, cpu() - c0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--runners", type=int, default=4)
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.steps))
        return 0
    port_file = f"/tmp/stream-protocols-{os.getpid()}"
    srv = subprocess.Popen([sys.executable, __file__, "--serve", port_file, "--steps", str(args.steps)])
    try:
        while not os.path.exists(port_file) or not open(port_file).read():
            time.sleep(0.05)
        port = int(open(port_file).read())
        for mode in ("per-request", "multiplexed"):
            tokens, c = asyncio.run(receive(port, mode, args.requests, args.runners))
            print(f"{mode:>12}: {tokens} tokens, receiver {c:.2f} CPU-s, {1e6 * c / tokens:.2f} us per token")
    finally:
        srv.terminate()
        srv.wait()
        os.unlink(port_file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

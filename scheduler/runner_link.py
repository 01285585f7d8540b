"""The scheduler's end of the runner protocol (docs/api.md): one multiplexed stream per runner.

    link = RunnerLink(session, url, on_entries)
    reason = await link.run()          # opens GET /v1/stream?id=S, calls on_entries(entries) once per
                                       # line (one line = one engine step of all our requests there);
                                       # returns why the stream ended
    await link.submit(body)            # POST /v1/generate with body["stream"] = S -> (status, text)
    link.cancel(request_id)            # POST /v1/cancel/{id}, in the background

`entries` are `[request_id, [new ids], finish_reason | null, error | null]` lists. The first
line of the stream is `{"hello": {...}}`; `link.stream_id` is set from then on. Empty lines are
heartbeats. The session carries the runner credential (LORAFLEET_RUNNER_TOKEN) as a default header.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Callable

import aiohttp

_loads = json.loads


def merge(steps: list[list]) -> list[list]:
    """The entries of consecutive steps as one step: each request's ids concatenated, its end kept.

    A scheduler that reads several steps at once hands each request all its new tokens in one
    call, so its client gets them in one SSE chunk (the catch-up costs one write, not one per step)."""
    out: dict[str, list] = {}
    for entries in steps:
        for rid, ids, fin, err, *extra in entries:  # extra: cached_tokens, logprobs, prompt_logprobs (stream.py)
            e = out.get(rid)
            if e is None:
                out[rid] = e = [rid, [], None, None]
            e[1] += ids
            if fin is not None:
                e[2], e[3] = fin, err
            if extra:
                e.extend([None] * (4 + len(extra) - len(e)))
                if e[4] is None:
                    e[4] = extra[0]  # the first runner's count
                for k in (5, 6):  # lists: one entry per token, concatenated in order
                    if len(extra) > k - 4 and extra[k - 4]:
                        e[k] = (e[k] or []) + extra[k - 4]
    return list(out.values())


class RunnerLink:
    def __init__(self, session: aiohttp.ClientSession, url: str, on_entries: Callable[[list], None],
                 read_timeout: float = 60.0):
        self.session, self.url, self.on_entries = session, url, on_entries
        self.read_timeout = read_timeout
        self.stream_id: str | None = None
        self.on_open: Callable[[], None] | None = None

    async def run(self) -> str:
        """Read the stream until it ends; the reason it ended (never raises for runner trouble)."""
        sid = secrets.token_hex(8)
        timeout = aiohttp.ClientTimeout(total=None, connect=5, sock_connect=5, sock_read=self.read_timeout)
        try:
            async with self.session.get(f"{self.url}/v1/stream", params={"id": sid}, timeout=timeout) as resp:
                if resp.status != 200:
                    return f"stream refused: HTTP {resp.status}: {(await resp.text())[:200]}"
                first = await resp.content.readline()
                if not first.startswith(b'{"hello"'):
                    return "stream did not start with hello"
                self.stream_id = sid
                if self.on_open is not None:
                    self.on_open()
                rest = b""
                on_entries = self.on_entries
                async for data in resp.content.iter_any():
                    if rest:
                        data = rest + data
                    end = data.rfind(b"\n")
                    if end < 0:
                        rest = data
                        continue
                    rest = data[end + 1 :]
                    lines = [ln for ln in data[:end].split(b"\n") if len(ln) > 2]
                    if len(lines) == 1:
                        entries = _loads(lines[0]).get("o")
                        if entries:
                            on_entries(entries)
                    elif lines:  # we fell behind: several steps at once, one entry per request
                        on_entries(merge([_loads(ln).get("o") or [] for ln in lines]))
                return "stream ended"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            return f"stream failed: {type(exc).__name__}: {exc}"
        finally:
            self.stream_id = None

    async def submit(self, body: dict) -> tuple[int, str]:
        """POST the request on our stream; (HTTP status, body text). Raises aiohttp/OS errors."""
        body["stream"] = self.stream_id
        async with self.session.post(f"{self.url}/v1/generate", json=body,
                                     timeout=aiohttp.ClientTimeout(total=30)) as resp:
            return resp.status, await resp.text()

    def cancel(self, request_id: str) -> None:
        asyncio.get_running_loop().create_task(self._cancel(request_id))

    async def _cancel(self, request_id: str) -> None:
        try:
            async with self.session.post(f"{self.url}/v1/cancel/{request_id}", timeout=aiohttp.ClientTimeout(total=2)):
                pass
        except Exception:
            pass  # the runner is gone or busy: its stream closing cancels the request anyway

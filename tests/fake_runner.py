"""The scripted runner of the scheduler tests (it lives in the package: `lorafleet bench relay` uses it too),
and `CachingFakeRunner`, the same with a prefix cache as the runner protocol reports one."""

from __future__ import annotations

import json

from aiohttp import web

from lorafleet.bench.fake_runner import FakeRunner  # noqa: F401


class CachingFakeRunner(FakeRunner):
    """A FakeRunner with a prefix cache of whole 16-token pages keyed by (adapter, cache salt, tokens), as a real
    runner keeps it: a request's first token carries a fifth element, the prompt tokens it found cached (every
    full page of a prompt seen before with the same adapter and salt, at most all but its last token); `/state`
    reports `prefix_cache` with the counters, which `restart()` sets back to 0 under a new engine pid.
    `report_cached=False` leaves the fifth element out (an older runner)."""

    PAGE = 16

    def __init__(self, *args, enabled: bool = True, report_cached: bool = True, **kw):
        super().__init__(*args, **kw)
        self.enabled, self.report_cached = enabled, report_cached
        self.pages: set[tuple] = set()
        self.cached: dict[str, int] = {}  # runner request id -> cached tokens, until its first token
        self.queries = self.hits = 0
        self.pid = 4242

    def restart(self) -> None:
        self.pages.clear()
        self.queries = self.hits = 0
        self.pid += 1

    def _keys(self, body: dict) -> list[tuple]:
        ids = body["prompt_token_ids"]
        root = ((body.get("adapter") or {}).get("name"), body.get("cache_salt"))
        return [(root, tuple(ids[: (p + 1) * self.PAGE])) for p in range((len(ids) - 1) // self.PAGE)]

    async def generate(self, request):
        body = await request.json()
        keys = self._keys(body) if self.enabled else []
        hit = 0
        while hit < len(keys) and keys[hit] in self.pages:
            hit += 1
        self.pages.update(keys)
        self.cached[body["request_id"]] = hit * self.PAGE
        if self.enabled:
            self.queries += len(body["prompt_token_ids"])
            self.hits += hit * self.PAGE
        st = self.streams.get(body.get("stream") or "")
        if st is not None and "deliver" not in vars(st):  # every entry of this stream passes `entry` first
            plain = st.deliver
            st.deliver = lambda entries: plain([self.entry(e) for e in entries])
        return await super().generate(request)  # reads the body again (aiohttp keeps it)

    def entry(self, e: list) -> list:
        """A stream entry as this runner sends it: the one with a request's first token gains its cached
        tokens."""
        cached = self.cached.pop(e[0], None) if e[1] else None
        return e + [cached] if cached is not None and self.report_cached else e

    async def state(self, request):
        st = json.loads((await super().state(request)).body)
        st["engine"]["pid"] = self.pid
        st["prefix_cache"] = {"enabled": self.enabled, "queries": self.queries, "hits": self.hits, "evictions": 0,
                              "cached_pages": len(self.pages)}
        return web.json_response(st)

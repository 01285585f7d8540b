"""The scheduler's view of its runners, the queue (FCFS within a priority), placement, migration and failover.

Every request is placed by the placement policy (default `placement.busiest_fit`) or waits in
arrival order. Each runner has one multiplexed stream (`runner_link.py`); a request is
submitted on it and its tokens come back in the runner's per-step lines. A runner's `evicted`
finish re-queues the request with prompt + generated ids (it keeps its arrival, so it goes back
to the head of the line); `aborted` (the runner's engine died), a stream that breaks, a refused
connection or failed health checks mark the runner unhealthy and re-queue its requests the
same way.

Prefix cache: the placement policy sees, per runner, how much of the request's prefix the runner
likely holds (`prefix_index.py`: recorded when a request is placed and when it ends there; a
runner that fails, leaves or restarts is forgotten; runners whose cache is off get no credit).
Each request keeps the cached-token count its first runner reported with its first token. The
runners' prefix cache counters (`/state`) are summed into pool totals by their increments, so a
runner that restarts (its counters begin again) never makes the totals go down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable

import aiohttp

from lorafleet import env
from lorafleet.scheduler.discovery import RunnerDirectory, RunnerEndpoint
from lorafleet.scheduler.placement import RunnerView, busiest_fit, default_queue, kv_need
from lorafleet.scheduler.prefix_index import PrefixIndex, request_keys
from lorafleet.scheduler.request import Request
from lorafleet.scheduler.runner_link import RunnerLink

log = logging.getLogger(__name__)

MAX_FAILURES = 5  # runner failures one request survives
MAX_MIGRATIONS = 64  # evictions one request survives
RUNNER_REFUSED = "runner refused the request: "  # the error of a request a runner's own validation answered with 400


class RunnerHandle:
    def __init__(self, ep: RunnerEndpoint):
        self.id, self.url = ep.id, ep.url.rstrip("/")
        self.healthy = False
        self.draining = False  # set by the admin API
        self.remote_draining = False  # the runner itself is shutting down
        self.state: dict = {}
        self.assigned: dict[str, Request] = {}  # scheduler request id -> request
        self.by_rid: dict[str, Request] = {}  # runner request id -> request
        self.submits: set[asyncio.Task] = set()
        self.failures = 0
        self.poller: asyncio.Task | None = None
        self.link: RunnerLink | None = None
        self.link_task: asyncio.Task | None = None
        self.gone = False
        self.busy_since: float | None = None  # monotonic time the batch became non-empty
        self.busy_total = 0.0

    @property
    def page_size(self) -> int:
        return int(self.state.get("page_size") or 16)

    @property
    def caches_prefixes(self) -> bool:
        """Its prefix cache is on (a runner that does not say so has none)."""
        pc = self.state.get("prefix_cache")
        return isinstance(pc, dict) and bool(pc.get("enabled"))

    @property
    def cache_pages(self) -> int:
        """KV pages it has: what its prefix cache can hold at most."""
        return int(self.state.get("total_kv_tokens") or 0) // self.page_size

    @property
    def connected(self) -> bool:
        return self.link is not None and self.link.stream_id is not None

    def busy_seconds(self) -> float:
        """Time this runner had at least one request placed on it (what "GPUs busy" integrates)."""
        extra = time.monotonic() - self.busy_since if self.busy_since is not None else 0.0
        return self.busy_total + extra

    def used_tokens(self) -> int:
        """Conservative KV use of the requests placed here (whole pages, with their reserve)."""
        ps = self.page_size
        return sum(-(-kv_need(r.num_tokens, r.remaining) // ps) * ps for r in self.assigned.values())

    def view(self, queue: int | None = 0, prefix_tokens: int = 0) -> RunnerView:
        """queue: its queue allowance (None: placement.default_queue of its max batch); prefix_tokens: of the
        request being placed, the leading tokens it likely holds cached."""
        total = int(self.state.get("total_kv_tokens") or 0)
        max_batch = int(self.state.get("max_batch_size") or 0)
        return RunnerView(
            id=self.id,
            healthy=self.healthy and self.connected,
            draining=self.draining or self.remote_draining,
            batch_size=len(self.assigned),
            max_batch_size=max_batch,
            free_kv_tokens=total - self.used_tokens(),
            total_kv_tokens=total,
            prefill_backlog=self.prefill_backlog(),
            queue=default_queue(max_batch) if queue is None else queue,
            prefix_tokens=prefix_tokens,
        )

    def prefill_backlog(self) -> int:
        """Prompt tokens of requests placed here that have not produced a token here yet."""
        return sum(r.num_tokens for r in self.assigned.values() if r.awaiting_first_token)

    def public_state(self) -> dict:
        v = self.view()
        return {
            "id": self.id, "url": self.url, "healthy": self.healthy, "draining": v.draining,
            "batch_size": v.batch_size, "max_batch_size": v.max_batch_size,
            "free_kv_tokens": v.free_kv_tokens, "total_kv_tokens": v.total_kv_tokens,
            "prefill_backlog": v.prefill_backlog,
            "idle_seconds": float(self.state.get("idle_seconds") or 0.0) if not self.assigned else 0.0,
            "busy_seconds": round(self.busy_seconds(), 3),
            "adapters": list(self.state.get("resident_adapters") or []),
            "running_adapters": dict(self.state.get("running_adapters") or {}),
            "waiting_adapters": dict(self.state.get("waiting_adapters") or {}),
            "adapter_pool": dict(self.state.get("adapter_pool") or {}),
        }


class Cluster:
    def __init__(
        self,
        directory: RunnerDirectory,
        *,
        poll_interval: float = 0.5,
        fail_after: int = 2,
        placement: Callable = busiest_fit,
        metrics=None,
        runner_token: str | None = None,
        runner_queue: int | None = None,
    ):
        self.directory = directory
        self.poll_interval, self.fail_after = poll_interval, fail_after
        self.placement = placement
        self.metrics = metrics
        self.runner_token = runner_token
        self.runner_queue = runner_queue  # None: placement.default_queue(max batch) per runner
        self.runners: dict[str, RunnerHandle] = {}
        self.queue: list[Request] = []
        self.prefix_index = PrefixIndex()
        self.prefix_totals = {"queries": 0, "hits": 0}  # pool totals of the runners' prefix cache counters
        self._prefix_seen: dict[str, tuple] = {}  # runner id -> (engine pid, queries, hits) last read
        self.session: aiohttp.ClientSession | None = None
        self._changed = asyncio.Event()
        self._dispatcher: asyncio.Task | None = None
        self.on_state_change: list[Callable[[], None]] = []

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.runner_token}"} if self.runner_token else None
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_connect=5), headers=headers,
            connector=aiohttp.TCPConnector(limit=0))
        self.directory.subscribe(self._join, self._leave)
        self._dispatcher = asyncio.create_task(self._dispatch_loop())

    async def stop(self) -> None:
        if self._dispatcher:
            self._dispatcher.cancel()
        for r in list(self.runners.values()):
            self._stop_runner_tasks(r)
        await asyncio.sleep(0)
        if self.session:
            await self.session.close()

    def _join(self, ep: RunnerEndpoint) -> None:
        r = RunnerHandle(ep)
        self.runners[r.id] = r
        loop = asyncio.get_event_loop()
        r.poller = loop.create_task(self._poll(r))
        r.link_task = loop.create_task(self._link_loop(r))
        log.info("runner %s joined at %s", r.id, r.url)

    def _leave(self, ep: RunnerEndpoint) -> None:
        r = self.runners.pop(ep.id, None)
        if r is None:
            return
        r.gone = True
        log.info("runner %s left; re-placing %d request(s)", r.id, len(r.assigned))
        self.prefix_index.forget(r.id)
        self._stop_runner_tasks(r)
        self._requeue_all(r, "runner left")

    def _stop_runner_tasks(self, r: RunnerHandle) -> None:
        for t in (r.poller, r.link_task, *r.submits):
            if t is not None:
                t.cancel()

    # -- views ---------------------------------------------------------------------------------------
    def views(self, req: Request | None = None) -> list[RunnerView]:
        """The runners as placement sees them; with `req`, how much of its prefix each likely holds."""
        if req is None:
            return [r.view(self.runner_queue) for r in self.runners.values()]
        out = []
        for r in self.runners.values():
            cached = 0
            if r.caches_prefixes:
                ps = r.page_size
                cached = min(self.prefix_index.match(r.id, request_keys(req, ps)) * ps, req.num_tokens - 1)
            out.append(r.view(self.runner_queue, cached))
        return out

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.runners.values())

    def max_total_kv(self, placeable: bool = False) -> int:
        """The largest KV cache of the healthy runners (`placeable`: of those that take new requests, not draining)."""
        return max((v.total_kv_tokens for v in (r.view() for r in self.runners.values() if r.healthy)
                    if not (placeable and v.draining)), default=0)

    def admin_state(self) -> dict:
        return {
            "runners": [self.runners[k].public_state() for k in sorted(self.runners)],
            "queue_length": len(self.queue),
        }

    def set_draining(self, runner_id: str, draining: bool) -> RunnerHandle | None:
        r = self.runners.get(runner_id)
        if r is not None:
            r.draining = draining
            self._kick()
        return r

    # -- requests ------------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        req.queued_at = time.monotonic()
        self._enqueue(req)

    def cancel(self, req: Request) -> None:
        """Client gone or stop string hit: drop it from the queue or its runner."""
        if req in self.queue:
            self.queue.remove(req)
            self._kick()
        r = self.runners.get(req.runner_id or "")
        if r is not None and r.assigned.get(req.id) is req:
            rid = req.rid
            if len(req.generated) > req.placed_at_generated >= 0:  # its prompt was computed there
                self._remember(r, req)
            self._unassign(r, req)
            if not req.done:
                req.finish("cancelled")
            if r.link is not None and rid:
                r.link.cancel(rid)

    def _enqueue(self, req: Request) -> None:
        # By priority, then FCFS by arrival: a migrated request keeps its place ahead of later arrivals.
        i = len(self.queue)
        while i > 0 and self.queue[i - 1].key > req.key:
            i -= 1
        self.queue.insert(i, req)
        self._kick()

    def _kick(self) -> None:
        self._changed.set()
        for fn in self.on_state_change:
            fn()

    async def _dispatch_loop(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            self.dispatch()

    def dispatch(self) -> None:
        """Place queued requests in arrival order; stop at the first that fits nowhere. A request's KV need is
        capped at the largest runner that takes requests, so one that could run there alone (ending at its length
        limit when it outgrows it) waits only until that runner has room, never forever; one that has outgrown every
        healthy runner ends (`_outgrown`)."""
        healthy, room = self.max_total_kv(), self.max_total_kv(placeable=True)  # (placing changes no runner's size)
        while self.queue:
            req = self.queue[0]
            if req.done:
                self.queue.pop(0)
                continue
            if healthy and self._outgrown(req, healthy):  # (the largest runner left since it was queued)
                self.queue.pop(0)
                continue
            need = kv_need(req.num_tokens, req.remaining)
            if room:  # never below its tokens + 1: a runner must hold what it has
                need = max(min(need, room), req.num_tokens + 1)
            rid = self.placement(self.views(req), need, req.num_tokens)
            if rid is None:
                return
            self.queue.pop(0)
            runner = self.runners[rid]
            req.runner_id = rid
            req.placed_at_generated = len(req.generated)
            if not runner.assigned:
                runner.busy_since = time.monotonic()
            runner.assigned[req.id] = req
            self._remember(runner, req)
            if self.metrics is not None and req.queued_at is not None:
                self.metrics.queue_wait.observe(time.monotonic() - req.queued_at)
            t = asyncio.get_event_loop().create_task(self._run_on(runner, req))
            runner.submits.add(t)
            t.add_done_callback(runner.submits.discard)

    def _remember(self, runner: RunnerHandle, req: Request) -> None:
        """The runner computes (or computed) the K/V of the request's tokens: note its leading pages."""
        if runner.caches_prefixes:
            self.prefix_index.record(runner.id, request_keys(req, runner.page_size), runner.cache_pages)

    def _unassign(self, runner: RunnerHandle, req: Request) -> None:
        if runner.assigned.pop(req.id, None) is not None and not runner.assigned and runner.busy_since is not None:
            runner.busy_total += time.monotonic() - runner.busy_since
            runner.busy_since = None
        if req.rid is not None and runner.by_rid.get(req.rid) is req:
            del runner.by_rid[req.rid]
        req.runner_id = None
        self._kick()

    async def _run_on(self, runner: RunnerHandle, req: Request) -> None:
        """Submit a placed request on the runner's stream; its tokens arrive in `_on_entries`."""
        body = req.runner_body(runner.link.stream_id if runner.connected else "")
        runner.by_rid[req.rid] = req
        try:
            status, text = await runner.link.submit(body)
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self._runner_failed(runner, f"submit failed: {type(exc).__name__}: {exc}")
            return
        if runner.assigned.get(req.id) is not req:
            if status == 202:  # cancelled while the submit was on its way: cancel it there too
                runner.link.cancel(body["request_id"])
            return
        if status == 202:
            return
        self._unassign(runner, req)
        if status >= 500 or status == 404:  # not ready, or our stream is gone there: try elsewhere
            self._runner_failed(runner, f"runner refused a submit: HTTP {status}: {text[:200]}")
            self._requeue(runner, req, f"HTTP {status}", migration=False)
        elif status == 400:  # the request itself, by the runner's checks: the client's error (server.py _failure)
            try:
                text = str(json.loads(text)["error"])
            except (ValueError, TypeError, KeyError):
                pass
            req.finish("error", RUNNER_REFUSED + text[:300])
        else:  # 401, 409, 413 ...: a fault between this server and the runner, not the client's
            req.finish("error", f"the runner answered the submit with HTTP {status}: {text[:300]}")

    def _on_entries(self, runner: RunnerHandle, entries: list) -> None:
        """One line of a runner's stream: new tokens and ends of any of our requests there."""
        by_rid = runner.by_rid
        for e in entries:
            req = by_rid.get(e[0])
            if req is None:
                continue  # cancelled here already, or a request that left this runner
            if len(e) > 4 and req.cached_tokens is None and isinstance(e[4], int):
                req.cached_tokens = max(0, min(e[4], len(req.prompt_ids)))  # its first runner's count stays
            if len(e) > 6 and isinstance(e[6], list):  # its prompt's log-probabilities: before its tokens
                req.add_prompt_logprobs(e[6])
            if e[1]:
                req.add_tokens(e[1], e[5] if len(e) > 5 and isinstance(e[5], list) else None, e[2] == "stop")
            if e[2] is not None:
                self._finished(runner, req, e[2], e[3])

    def _finished(self, runner: RunnerHandle, req: Request, reason: str, error: str | None) -> None:
        if reason in ("stop", "length"):
            self._remember(runner, req)  # with its generated tokens: the next turn of a chat resends them
        self._unassign(runner, req)
        if reason == "evicted":
            self._requeue(runner, req, "evicted (runner out of KV cache)", migration=True)
        elif reason in ("stop", "length", "cancelled"):
            req.finish(reason)
        elif reason == "aborted":  # the runner's engine died: it is unhealthy; this request goes elsewhere
            self._requeue(runner, req, error or "runner engine failed", migration=False)
            self._runner_failed(runner, error or "engine aborted")
        else:
            req.finish("error", error or f"runner finished with {reason!r}")

    def _requeue(self, runner: RunnerHandle, req: Request, why: str, migration: bool) -> None:
        """Put a request back in line (it keeps its arrival) with prompt + generated ids, bounded."""
        if req.done:
            return
        if migration:
            req.migrations += 1
            count, limit, metric = req.migrations, MAX_MIGRATIONS, "migrations"
        else:
            req.failures += 1
            count, limit, metric = req.failures, MAX_FAILURES, "replacements"
        if self.metrics is not None:
            getattr(self.metrics, metric).inc()
        if count > limit:
            req.finish("error", f"{why}, {count} times; giving up")
            return
        room = self.max_total_kv()
        if room and self._outgrown(req, room):
            return
        log.log(logging.INFO if migration else logging.WARNING,
                "request %s left runner %s (%s); re-placing with %d generated tokens",
                req.id, runner.id, why, len(req.generated))
        self._enqueue(req)

    def _outgrown(self, req: Request, room: int) -> bool:
        """Whether the request has grown past `room`, the largest KV cache of the runners that could take it back;
        if so it is finished: with tokens generated as at its length limit, a prompt alone as an error."""
        if req.num_tokens + 1 <= room:
            return False
        log.info("request %s ends: with %d tokens it has outgrown every runner's KV cache (%d tokens)",
                 req.id, req.num_tokens, room)
        if req.generated:
            req.finish("length")
        else:
            req.finish("error", f"the prompt has {req.num_tokens} tokens; no runner left has that much KV cache "
                                f"({room} tokens)")
        return True

    def _requeue_all(self, runner: RunnerHandle, why: str) -> None:
        for req in list(runner.assigned.values()):
            self._unassign(runner, req)
            self._requeue(runner, req, why, migration=False)
        runner.by_rid.clear()

    # -- health ----------------------------------------------------------------------------------------
    def _runner_failed(self, runner: RunnerHandle, why: str) -> None:
        """Unhealthy until its health checks pass again; its requests go elsewhere; its stream is dropped."""
        if runner.healthy:
            log.warning("runner %s is unhealthy: %s", runner.id, why)
        runner.healthy = False
        self.prefix_index.forget(runner.id)  # it may come back with an empty cache
        self._requeue_all(runner, why)
        self._kick()

    async def _link_loop(self, runner: RunnerHandle) -> None:
        """Keep one stream open to a healthy runner; a stream that ends fails its requests over."""
        runner.link = RunnerLink(self.session, runner.url, lambda es: self._on_entries(runner, es),
                                 read_timeout=float(env.request_timeout_s()))
        runner.link.on_open = self._kick
        while True:
            while not runner.healthy:
                await asyncio.sleep(self.poll_interval / 4)
            why = await runner.link.run()
            if runner.assigned or runner.healthy:
                self._runner_failed(runner, why)
            await asyncio.sleep(self.poll_interval)

    async def _poll(self, runner: RunnerHandle) -> None:
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.poll_interval * 4))
        while True:
            try:
                async with self.session.get(f"{runner.url}/state", timeout=timeout) as resp:
                    state = await resp.json()
                ok = resp.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as exc:
                # (a timeout's text is empty: its name then, so that the log and a request that gives up say why)
                ok, state = False, {"error": f"health check failed: {str(exc) or type(exc).__name__}"}
            if ok and state.get("engine", {}).get("alive") is False:
                ok = False
                runner.failures = self.fail_after  # its engine is gone: no point in waiting
            if ok:
                was = runner.healthy
                runner.state = state
                self._count_prefix_cache(runner, state)
                runner.failures = 0
                runner.remote_draining = bool(state.get("draining"))
                runner.healthy = bool(state.get("ready", True)) or runner.remote_draining
                if runner.healthy and not was:
                    log.info("runner %s is healthy (%s KV tokens)", runner.id, state.get("total_kv_tokens"))
                self._kick()
            else:
                runner.failures += 1
                if runner.failures >= self.fail_after:
                    if runner.healthy or runner.assigned:
                        self._runner_failed(runner, state.get("error", "health check failed"))
            await asyncio.sleep(self.poll_interval)

    def _count_prefix_cache(self, runner: RunnerHandle, state: dict) -> None:
        """Add the increments of the runner's prefix cache counters to the pool totals. Counters that went
        down, or a new engine process, mean the runner restarted: they count again from 0 (and its cache,
        empty now, is forgotten)."""
        pc = state.get("prefix_cache")
        if not isinstance(pc, dict):
            return
        try:
            queries, hits = int(pc.get("queries") or 0), int(pc.get("hits") or 0)
        except (TypeError, ValueError):
            return
        pid = (state.get("engine") or {}).get("pid")
        seen_pid, seen_q, seen_h = self._prefix_seen.get(runner.id, (pid, 0, 0))
        if pid != seen_pid or queries < seen_q or hits < seen_h:
            seen_q = seen_h = 0
            self.prefix_index.forget(runner.id)
        self.prefix_totals["queries"] += queries - seen_q
        self.prefix_totals["hits"] += hits - seen_h
        self._prefix_seen[runner.id] = (pid, queries, hits)

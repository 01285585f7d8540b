"""The scheduler's view of its runners, the FCFS queue, placement, migration and failover.

Every request is placed by `placement.busiest_fit` or waits in arrival order. A runner's
`evicted` event re-queues the request with prompt + generated ids (it keeps its arrival,
so it goes back to the head of the line); a runner that dies, errors a stream or fails
health checks is marked unhealthy and its requests are re-queued the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable

import aiohttp

from lorafleet.scheduler.discovery import RunnerDirectory, RunnerEndpoint
from lorafleet.scheduler.placement import RunnerView, busiest_fit, kv_need
from lorafleet.scheduler.request import Request

log = logging.getLogger(__name__)

MAX_FAILURES = 5  # runner failures one request survives
MAX_MIGRATIONS = 64  # evictions one request survives


class RunnerFailure(Exception):
    pass


class RunnerHandle:
    def __init__(self, ep: RunnerEndpoint):
        self.id, self.url = ep.id, ep.url.rstrip("/")
        self.healthy = False
        self.draining = False  # set by the admin API
        self.remote_draining = False  # the runner itself is shutting down
        self.state: dict = {}
        self.assigned: dict[str, Request] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.failures = 0
        self.poller: asyncio.Task | None = None
        self.gone = False

    @property
    def page_size(self) -> int:
        return int(self.state.get("page_size") or 16)

    def used_tokens(self) -> int:
        """Conservative KV use of the requests placed here (whole pages, with their reserve)."""
        ps = self.page_size
        return sum(-(-kv_need(r.num_tokens, r.remaining) // ps) * ps for r in self.assigned.values())

    def view(self) -> RunnerView:
        total = int(self.state.get("total_kv_tokens") or 0)
        return RunnerView(
            id=self.id,
            healthy=self.healthy,
            draining=self.draining or self.remote_draining,
            batch_size=len(self.assigned),
            max_batch_size=int(self.state.get("max_batch_size") or 0),
            free_kv_tokens=total - self.used_tokens(),
            total_kv_tokens=total,
            prefill_backlog=self.prefill_backlog(),
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
    ):
        self.directory = directory
        self.poll_interval, self.fail_after = poll_interval, fail_after
        self.placement = placement
        self.metrics = metrics
        self.runners: dict[str, RunnerHandle] = {}
        self.queue: list[Request] = []
        self.session: aiohttp.ClientSession | None = None
        self._changed = asyncio.Event()
        self._dispatcher: asyncio.Task | None = None
        self.on_state_change: list[Callable[[], None]] = []

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        # No connection cap: one stream per placed request, and aiohttp's default of 100 would
        # queue requests beyond it inside the client while their runner has room.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None, connect=5, sock_connect=5))
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
        r.poller = asyncio.get_event_loop().create_task(self._poll(r))
        log.info("runner %s joined at %s", r.id, r.url)

    def _leave(self, ep: RunnerEndpoint) -> None:
        r = self.runners.pop(ep.id, None)
        if r is None:
            return
        r.gone = True
        log.info("runner %s left; re-placing %d request(s)", r.id, len(r.assigned))
        self._stop_runner_tasks(r)
        self._kick()

    def _stop_runner_tasks(self, r: RunnerHandle) -> None:
        if r.poller:
            r.poller.cancel()
        for t in list(r.tasks.values()):
            t.cancel()

    # -- views ---------------------------------------------------------------------------------------
    def views(self) -> list[RunnerView]:
        return [r.view() for r in self.runners.values()]

    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.runners.values())

    def max_total_kv(self) -> int:
        return max((r.view().total_kv_tokens for r in self.runners.values() if r.healthy), default=0)

    def admin_state(self) -> dict:
        return {
            "runners": [self.runners[k].public_state() for k in sorted(self.runners)],
            "queue_length": len(self.queue),
        }

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
        if r is not None and req.id in r.tasks:
            r.tasks[req.id].cancel()

    def _enqueue(self, req: Request) -> None:
        # FCFS by arrival: a migrated request keeps its place ahead of later arrivals.
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
        """Place queued requests in arrival order; stop at the first that fits nowhere."""
        while self.queue:
            req = self.queue[0]
            if req.done:
                self.queue.pop(0)
                continue
            rid = self.placement(self.views(), kv_need(req.num_tokens, req.remaining), req.num_tokens)
            if rid is None:
                return
            self.queue.pop(0)
            runner = self.runners[rid]
            req.runner_id = rid
            req.placed_at_generated = len(req.generated)
            runner.assigned[req.id] = req
            if self.metrics is not None and req.queued_at is not None:
                self.metrics.queue_wait.observe(time.monotonic() - req.queued_at)
            runner.tasks[req.id] = asyncio.get_event_loop().create_task(self._run_on(runner, req))

    def _unassign(self, runner: RunnerHandle, req: Request) -> None:
        runner.assigned.pop(req.id, None)
        runner.tasks.pop(req.id, None)
        req.runner_id = None
        self._kick()

    async def _run_on(self, runner: RunnerHandle, req: Request) -> None:
        body = req.runner_body()
        final = None
        try:
            async with self.session.post(f"{runner.url}/v1/generate", json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    if resp.status >= 500:
                        raise RunnerFailure(f"HTTP {resp.status}: {text[:200]}")
                    final = {"finish_reason": "error", "error": f"runner refused the request: {text[:300]}"}
                else:
                    async for line in resp.content:
                        if not line.strip():
                            continue
                        ev = json.loads(line)
                        if "token_ids" in ev:
                            self._tokens(req, ev["token_ids"])
                        else:
                            final = ev
                            break
            if final is None:
                raise RunnerFailure("stream ended without a final event")
        except asyncio.CancelledError:
            # cancelled by the client, a stop string, or because the runner failed
            self._unassign(runner, req)
            if not req.done and (runner.gone or not runner.healthy):
                self._requeue_after_failure(runner, req, "runner became unhealthy")
            elif not req.done:
                req.finish("cancelled")
            asyncio.create_task(self._send_cancel(runner, body["request_id"]))
            return
        except (aiohttp.ClientError, RunnerFailure, json.JSONDecodeError, asyncio.TimeoutError, OSError) as exc:
            self._unassign(runner, req)
            self._mark_unhealthy(runner, f"{type(exc).__name__}: {exc}")
            self._requeue_after_failure(runner, req, str(exc))
            return
        self._unassign(runner, req)
        reason = final.get("finish_reason")
        if reason == "evicted":
            self._requeue(runner, req, "evicted (runner out of KV cache)", migration=True)
        elif reason in ("stop", "length"):
            req.finish(reason)
        elif reason == "cancelled":
            req.finish("cancelled")
        else:
            req.finish("error", final.get("error") or f"runner finished with {reason!r}")

    def _tokens(self, req: Request, ids: list[int]) -> None:
        if req.done or not ids:
            return
        ids = ids[: max(req.remaining, 0)]
        if req.first_token_time is None:
            req.first_token_time = time.time()
        req.generated.extend(ids)
        req.events.put_nowait(("tokens", ids))

    def _requeue_after_failure(self, runner: RunnerHandle, req: Request, why: str) -> None:
        self._requeue(runner, req, why, migration=False)

    def _requeue(self, runner: RunnerHandle, req: Request, why: str, migration: bool) -> None:
        """Put a request back in line (it keeps its arrival) with prompt + generated ids, bounded."""
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
        log.log(logging.INFO if migration else logging.WARNING,
                "request %s left runner %s (%s); re-placing with %d generated tokens",
                req.id, runner.id, why, len(req.generated))
        self._enqueue(req)

    async def _send_cancel(self, runner: RunnerHandle, runner_request_id: str) -> None:
        try:
            async with self.session.post(f"{runner.url}/v1/cancel/{runner_request_id}",
                                         timeout=aiohttp.ClientTimeout(total=2)):
                pass
        except Exception:
            pass

    # -- health ----------------------------------------------------------------------------------------
    def _mark_unhealthy(self, runner: RunnerHandle, why: str) -> None:
        if runner.healthy:
            log.warning("runner %s is unhealthy: %s", runner.id, why)
        runner.healthy = False
        for t in list(runner.tasks.values()):
            t.cancel()
        self._kick()

    async def _poll(self, runner: RunnerHandle) -> None:
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.poll_interval * 4))
        while True:
            try:
                async with self.session.get(f"{runner.url}/state", timeout=timeout) as resp:
                    state = await resp.json()
                ok = resp.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, OSError) as exc:
                ok, state = False, {"error": str(exc)}
            if ok:
                was = runner.healthy
                runner.state = state
                runner.failures = 0
                runner.remote_draining = bool(state.get("draining"))
                runner.healthy = bool(state.get("ready", True)) or runner.remote_draining
                if runner.healthy and not was:
                    log.info("runner %s is healthy (%s KV tokens)", runner.id, state.get("total_kv_tokens"))
                self._kick()
            else:
                runner.failures += 1
                if runner.failures >= self.fail_after:
                    self._mark_unhealthy(runner, state.get("error", "health check failed"))
            await asyncio.sleep(self.poll_interval)

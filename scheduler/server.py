"""`lorafleet scheduler`: the OpenAI-compatible front end over a set of runners (no torch).

Tokenizes, places every request on a runner (cluster.py), streams text back with
incremental detokenization and stop strings, and serves the admin API the operator reads.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web
from prometheus_client import generate_latest

from lorafleet import env
from lorafleet.scheduler import openai_api as oa
from lorafleet.scheduler.cluster import Cluster
from lorafleet.scheduler.detokenizer import IncrementalDetokenizer
from lorafleet.scheduler.discovery import RunnerDirectory, RunnerEndpoint
from lorafleet.scheduler.metrics import SchedulerMetrics
from lorafleet.scheduler.placement import POLICIES
from lorafleet.scheduler.openai_api import ApiError
from lorafleet.scheduler.registry import AdapterRegistry
from lorafleet.scheduler.request import Request
from lorafleet.scheduler.sinks import CollectSink, StreamSink
from lorafleet.scheduler.tokenizer import ChatTemplateError, Tokenizer

log = logging.getLogger(__name__)

MAX_BODY = 8 * 1024 * 1024
INLINE_TOKENIZE_CHARS = 4096  # prompts up to this size are tokenized on the event loop


def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


class SchedulerService:
    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        registry: AdapterRegistry,
        directory: RunnerDirectory,
        *,
        max_model_len: int = 4096,
        max_queue: int = 1024,
        queue_timeout: float = 120.0,
        admin_token: str | None = None,
        poll_interval: float = 0.5,
        grace_seconds: float = 30.0,
        placement: str = "busiest",
        runner_token: str | None = None,
    ):
        self.tok, self.model_name = tokenizer, model_name
        self.registry, self.directory = registry, directory
        self.max_model_len, self.max_queue, self.queue_timeout = max_model_len, max_queue, queue_timeout
        self.admin_token = admin_token
        self.grace_seconds = grace_seconds
        self.metrics = SchedulerMetrics()
        self.placement = placement
        self.cluster = Cluster(directory, poll_interval=poll_interval, metrics=self.metrics,
                               placement=POLICIES[placement](), runner_token=runner_token)
        self.tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        self.metrics.attach_cluster(self.cluster)
        self.accepting = True
        self.in_flight: set[Request] = set()
        self.created = int(time.time())
        self.background: list[asyncio.Task] = []

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        await self.cluster.start()
        self.background.append(asyncio.create_task(self._expire_queue()))

    async def stop(self, app: web.Application) -> None:
        self.accepting = False
        deadline = time.monotonic() + self.grace_seconds
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for req in list(self.in_flight):
            self.cluster.cancel(req)
        for t in self.background:
            t.cancel()
        await self.cluster.stop()
        self.tokenize_pool.shutdown(wait=False)

    async def _expire_queue(self) -> None:
        """Requests queued while no runner at all is healthy fail after queue_timeout (503)."""
        while True:
            await asyncio.sleep(1.0)
            if self.cluster.any_healthy():
                continue
            now = time.monotonic()
            for req in list(self.cluster.queue):
                if req.queued_at is not None and now - req.queued_at > self.queue_timeout:
                    self.cluster.queue.remove(req)
                    req.finish("error", "no runner became available in time")

    # -- helpers ----------------------------------------------------------------------------------------
    def _check_capacity(self, count: int) -> None:
        if not self.accepting:
            raise ApiError(503, "the server is shutting down", type_="server_error", code="shutting_down",
                           headers={"Retry-After": "5"})
        if not self.cluster.any_healthy():
            raise ApiError(503, "no runner is available to serve requests", type_="server_error",
                           code="no_runner", headers={"Retry-After": "5"})
        if len(self.cluster.queue) + count > self.max_queue:
            raise ApiError(429, f"the request queue is full ({self.max_queue} waiting)", type_="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "2"})

    def _resolve_model(self, name: str):
        if name == self.model_name:
            return None
        entry = self.registry.get(name)
        if entry is None:
            raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return entry

    async def _read_json(self, request: web.Request) -> dict:
        try:
            body = await request.json(loads=json.loads)
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"request body exceeds {MAX_BODY} bytes", code="body_too_large") from None
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise ApiError(400, "request body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_json")
        return body

    def _make_requests(self, params: oa.GenParams, adapter, prompts: list[list[int]], chat: bool) -> list[Request]:
        reqs = []
        max_kv = self.cluster.max_total_kv()
        for p_ids in prompts:
            if len(p_ids) >= self.max_model_len:
                raise ApiError(413, f"prompt has {len(p_ids)} tokens; the model's context is {self.max_model_len}",
                               param="messages" if chat else "prompt", code="prompt_too_long")
            if max_kv and len(p_ids) + 1 > max_kv:
                raise ApiError(413, f"prompt has {len(p_ids)} tokens; no runner has that much KV cache ({max_kv})",
                               param="messages" if chat else "prompt", code="prompt_too_long")
            max_tokens = params.max_tokens or (self.max_model_len - len(p_ids))
            if len(p_ids) + max_tokens > self.max_model_len:
                raise oa.bad("max_tokens", f"prompt ({len(p_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                                           f"model's context of {self.max_model_len} tokens")
            for k in range(params.n):
                seed = params.seed + k if params.seed is not None else None
                if seed is None and params.temperature > 0:
                    import secrets

                    seed = secrets.randbits(48)
                reqs.append(Request(
                    id=oa.new_id(chat)[-12:] + f"-{len(reqs)}", model=params.model, adapter=adapter,
                    index=len(reqs),
                    prompt_ids=list(p_ids), max_tokens=max_tokens,
                    sampling={"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                              "seed": seed, "stop_token_ids": list(params.stop_token_ids),
                              "ignore_eos": params.ignore_eos},
                ))
        return reqs

    # -- OpenAI endpoints --------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _tokenize(self, fn, size: int):
        """Small inputs inline (a thread hop costs more than they do); large ones on a worker thread,
        so one long prompt never holds up the tokens of every other stream."""
        if size <= INLINE_TOKENIZE_CHARS:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await self._read_json(request)
            params = oa.parse_common(body, chat, self.max_model_len)
            adapter = self._resolve_model(params.model)
            if chat:
                messages = oa.parse_messages(body)
                size = sum(len(str(m.get("content") or "")) for m in messages)
                try:
                    prompts = [await self._tokenize(lambda: self.tok.encode_chat(messages), size)]
                except ChatTemplateError as exc:
                    raise oa.bad("messages", str(exc)) from None
            else:
                raw = oa.parse_prompts(body, self.tok.vocab_size)
                size = sum(len(p) for p in raw if isinstance(p, str))
                prompts = await self._tokenize(
                    lambda: [self.tok.encode(p) if isinstance(p, str) else p for p in raw], size)
                if any(not p for p in prompts):
                    raise oa.bad("prompt", "prompt must not be empty")
            reqs = self._make_requests(params, adapter, prompts, chat)
            self._check_capacity(len(reqs))
        except ApiError as err:
            self.metrics.requests.labels(status=str(err.status)).inc()
            return error_response(err)
        detoks = [IncrementalDetokenizer(self.tok, r.prompt_ids, params.stop) for r in reqs]
        rid = oa.new_id(chat)
        if params.stream:
            enc = oa.ChunkEncoder(rid, params.model, chat)
            sink = StreamSink(detoks, enc, chat, self._stop_string, lambda: self._client_gone(reqs))
        else:
            sink = CollectSink(detoks, self._stop_string)
        for r in reqs:
            r.sink = sink
            self.metrics.prompt_tokens.inc(len(r.prompt_ids))
            self.in_flight.add(r)
            self.cluster.submit(r)
        try:
            if params.stream:
                return await self._stream(request, rid, params, reqs, chat, sink, enc)
            return await self._collect(rid, params, reqs, chat, sink)
        finally:
            for r in reqs:
                if not r.done:
                    self.cluster.cancel(r)
                    r.finish("cancelled")
                self.in_flight.discard(r)
                self.metrics.observe_finished(r, r.finish_reason or "cancelled")

    def _stop_string(self, req: Request) -> None:
        """A stop string was hit: the request ends here and is cancelled on its runner."""
        req.finish("stop")
        self.cluster.cancel(req)

    def _client_gone(self, reqs: list[Request]) -> None:
        log.debug("client went away; cancelling %d request(s)", len(reqs))
        for r in reqs:
            if not r.done:
                self.cluster.cancel(r)
                r.finish("cancelled")

    async def _collect(self, rid: str, params: oa.GenParams, reqs: list[Request], chat: bool,
                       sink: CollectSink) -> web.Response:
        await sink.finished
        for reason, error in sink.ends:
            if reason not in ("stop", "length"):
                err = ApiError(500, f"generation failed: {error or reason}", code="generation_failed")
                if error and "adapter" in error:
                    err = ApiError(500, error, param="model", code="adapter_failed")
                return error_response(err)
        choices = [oa.choice(i, "".join(sink.parts[i]), sink.ends[i][0], chat) for i in range(len(reqs))]
        use = oa.usage(sum(len(r.prompt_ids) for r in reqs[:: params.n]), sum(len(r.generated) for r in reqs))
        return web.json_response(oa.completion_body(rid, params.model, chat, choices, use))

    async def _stream(self, request: web.Request, rid: str, params: oa.GenParams, reqs: list[Request], chat: bool,
                      sink: StreamSink, enc: oa.ChunkEncoder) -> web.StreamResponse:
        """SSE: the first write goes through aiohttp (headers); then the sink writes each chunk itself
        as tokens arrive (`sinks.py`); this coroutine only steps in for a slow reader and the end."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunked = resp.headers.get("Transfer-Encoding") == "chunked"  # aiohttp frames HTTP/1.1 bodies
        try:
            if chat:
                await resp.write(b"".join(enc.chunk(i, "", None, role=True) for i in range(len(reqs))))
                sink.attach(request.transport, chunked)
            while not sink.finished or sink.buf:
                await sink.wait()
                data = sink.take()
                if data:
                    await resp.write(data)
                if not sink.finished:
                    sink.attach(request.transport, chunked)
            if sink.gone:
                return resp
            sink.transport = None
            tail = []
            if params.include_usage:
                use = oa.usage(sum(len(r.prompt_ids) for r in reqs[:: params.n]), sum(len(r.generated) for r in reqs))
                tail.append(enc.event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                       "created": enc.created, "model": params.model, "choices": [], "usage": use}))
            tail.append(b"data: [DONE]\n\n")
            await resp.write(b"".join(tail))
            await resp.write_eof()
        except ConnectionResetError:
            log.debug("client of %s went away; cancelling its requests", rid)
        return resp

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "lorafleet",
                 "root": self.model_name, "parent": None}]
        for e in self.registry.entries():
            data.append({"id": e.name, "object": "model", "created": int(e.created), "owned_by": "lorafleet",
                         "root": e.name, "parent": self.model_name})
        return web.json_response({"object": "list", "data": data})

    # -- health and admin ---------------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(self, request: web.Request) -> web.Response:
        ready = self.accepting and self.cluster.any_healthy()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    def _authorize(self, request: web.Request) -> None:
        if not self.admin_token:
            raise ApiError(403, "admin API disabled: set LORAFLEET_ADMIN_TOKEN on the scheduler",
                           type_="permission_error", code="admin_disabled")
        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.admin_token}".encode()):
            raise ApiError(401, "missing or wrong bearer token", type_="authentication_error", code="unauthorized")

    async def admin_state(self, request: web.Request) -> web.Response:
        try:
            self._authorize(request)
        except ApiError as err:
            return error_response(err)
        return web.json_response(self.cluster.admin_state())

    async def admin_drain(self, request: web.Request) -> web.Response:
        try:
            self._authorize(request)
        except ApiError as err:
            return error_response(err)
        rid = request.match_info["runner_id"]
        r = self.cluster.set_draining(rid, request.path.endswith("/drain"))
        if r is None:
            return error_response(ApiError(404, f"no runner {rid!r}", code="runner_not_found"))
        log.info("runner %s %s", rid, "draining" if r.draining else "back in service")
        return web.json_response({"id": rid, "draining": r.draining, "batch_size": len(r.assigned),
                                  "empty": not r.assigned})

    async def admin_validate(self, request: web.Request) -> web.Response:
        try:
            self._authorize(request)
            body = await self._read_json(request)
        except ApiError as err:
            return error_response(err)
        runners = [r for r in self.cluster.runners.values() if r.healthy]
        if not runners:
            return web.json_response({"ok": False, "error": "no healthy runner to validate on", "retry": True},
                                     status=503)
        r = max(runners, key=lambda x: x.id)
        try:
            async with self.cluster.session.post(f"{r.url}/v1/adapters/validate", json=body) as resp:
                return web.json_response(await resp.json(), status=resp.status)
        except Exception as exc:
            return web.json_response({"ok": False, "error": f"runner {r.id}: {exc}", "retry": True}, status=503)


SERVICE_KEY = web.AppKey("service", SchedulerService)


def create_app(service: SchedulerService) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/v1/completions", service.completions)
    app.router.add_post("/v1/chat/completions", service.chat_completions)
    app.router.add_get("/v1/models", service.models)
    app.router.add_get("/healthz", service.healthz)
    app.router.add_get("/readyz", service.readyz)
    app.router.add_get("/metrics", service.metrics_handler)
    app.router.add_get("/admin/state", service.admin_state)
    app.router.add_post("/admin/runners/{runner_id}/drain", service.admin_drain)
    app.router.add_post("/admin/runners/{runner_id}/undrain", service.admin_drain)
    app.router.add_post("/admin/adapters/validate", service.admin_validate)
    app.on_startup.append(service.start)
    app.on_shutdown.append(service.stop)
    app[SERVICE_KEY] = service
    return app


def model_limits(model_dir: Path) -> int:
    cfg = model_dir / "config.json"
    if cfg.is_file():
        try:
            return int(json.loads(cfg.read_text()).get("max_position_embeddings", 4096))
        except (json.JSONDecodeError, ValueError):
            pass
    return 4096


def model_display_name(model_dir: Path) -> str:
    """The base model's API name: config.json's `_name_or_path` (last part) or the folder name."""
    cfg = model_dir / "config.json"
    if cfg.is_file():
        try:
            name = json.loads(cfg.read_text()).get("_name_or_path")
            if isinstance(name, str) and name.strip("/"):
                return name.rstrip("/").rsplit("/", 1)[-1]
        except json.JSONDecodeError:
            pass
    return model_dir.stem if model_dir.is_file() else model_dir.name


def parse_runner(spec: str, i: int) -> RunnerEndpoint:
    """`id=url` or `url` (id runner-i)."""
    if "=" in spec:
        rid, url = spec.split("=", 1)
        return RunnerEndpoint(rid, url)
    return RunnerEndpoint(f"runner-{i}", spec)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="base model directory (tokenizer + config) or source URI")
    p.add_argument("--model-name", default=None, help="name of the base model in the API (default: folder name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--adapters", type=Path, default=None, help="directory with one adapter per subfolder")
    p.add_argument("--runner", action="append", default=[], help="runner endpoint, `id=url` or `url` (repeat)")
    p.add_argument("--max-queue", type=int, default=1024, help="queued requests before 429")
    p.add_argument("--queue-timeout", type=float, default=120.0, help="seconds a request may wait with no runner")
    p.add_argument("--kube", action="store_true", help="learn adapters and runners from the Kubernetes API")
    p.add_argument("--namespace", default=None, help="with --kube: the pool's namespace")
    p.add_argument("--pool", default=None, help="with --kube: the ServingPool name")
    add_placement_argument(p)


def add_placement_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placement", choices=sorted(POLICIES), default="busiest",
                   help="busiest: the fitting runner with the largest batch (Punica; default); least-loaded: the "
                        "smallest batch; round-robin")


def build_service(args: argparse.Namespace) -> SchedulerService:
    model = args.model
    if "://" in model:
        from lorafleet.common.sources import fetch_model

        model = str(fetch_model(model, cache_dir=env.cache_dir() / "models", tokenizer_only=True))
    model_dir = Path(model)
    registry = AdapterRegistry.from_directory(args.adapters) if args.adapters else AdapterRegistry()
    directory = RunnerDirectory([parse_runner(s, i) for i, s in enumerate(args.runner)])
    return SchedulerService(
        Tokenizer(model_dir), args.model_name or model_display_name(model_dir), registry, directory,
        max_model_len=model_limits(model_dir), max_queue=args.max_queue, queue_timeout=args.queue_timeout,
        admin_token=env.admin_token(), placement=args.placement, runner_token=env.runner_token(),
    )


def run(args: argparse.Namespace) -> int:
    service = build_service(args)
    app = create_app(service)
    if args.kube:
        if not (args.namespace and args.pool):
            raise SystemExit("--kube needs --namespace and --pool")

        async def feeds(app):
            from lorafleet.scheduler.kube import run_kube_feeds

            app["kube"] = asyncio.create_task(run_kube_feeds(service.registry, service.directory,
                                                             namespace=args.namespace, pool=args.pool))

        app.on_startup.append(feeds)
    log.info("scheduler for %s on http://%s:%d", service.model_name, args.host, args.port)
    web.run_app(app, host=args.host, port=args.port, print=None, shutdown_timeout=service.grace_seconds + 5)
    return 0

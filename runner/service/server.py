"""`lorafleet runner`: the HTTP front of one runner (see docs/api.md for the protocol).

The front is asyncio only; the engine runs in its own process, the engine core
(`engine_core.py`), which owns the device. The two talk over one socketpair (`channel.py`).
The front never imports torch.

    GET  /v1/stream?id=S        one long-lived NDJSON stream per scheduler: every engine step's new
                                tokens of all that scheduler's requests in one line (`stream.py`)
    POST /v1/generate           submit one request on stream S (202; its tokens arrive on S)
    POST /v1/cancel/{id}        cancel (also done for every request of a stream that closes)
    GET  /state, POST /v1/adapters/validate, GET /healthz, /readyz, /metrics

With LORAFLEET_RUNNER_TOKEN set, every route except GET /healthz, /readyz and /metrics needs
`Authorization: Bearer <token>`. An engine core that dies (a failed step, SIGKILL, any exit)
makes /healthz answer 500 with the reason and ends every in-flight request with
finish_reason "aborted", which the scheduler re-places on another runner. An engine that
cannot be built at start (a missing or unsupported model, unreadable weights) is different:
`lorafleet runner` logs the reason, answers /healthz and /readyz with it for
START_FAILURE_LINGER_S, then exits with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import json
import logging
import os
import secrets
import socket
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lorafleet import env
from lorafleet.common import cli_args
from lorafleet.common.cpus import available_cpus
from lorafleet.common.peft_config import AdapterError, BaseShape
from lorafleet.runner.service.engine_client import EngineClient
from lorafleet.runner.engine.sequence import SamplingError, SamplingParams, parse_token_ids, sampling_from_dict
from lorafleet.runner.service.stream import RunnerStream, hello_line

log = logging.getLogger(__name__)

MAX_BODY = 16 * 1024 * 1024
OPEN_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})  # GET without the runner credential
EMPTY_STATE = {"batch_size": 0, "max_batch_size": 0, "waiting": 0, "free_kv_tokens": 0, "total_kv_tokens": 0,
               "idle_seconds": 0.0, "running_adapters": {}, "waiting_adapters": {}, "resident_adapters": [],
               "adapter_pool": {}}


class BadRequest(ValueError):
    pass


MAX_SALT = 256


def parse_generate(body: dict) -> tuple[str, list[int], SamplingParams, dict | None, float | None]:
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    rid = body.get("request_id")
    if not isinstance(rid, str) or not rid:
        raise BadRequest("request_id must be a non-empty string")
    try:
        ids = parse_token_ids(body.get("prompt_token_ids"))
    except SamplingError as exc:
        raise BadRequest(str(exc)) from None
    s = body.get("sampling") or {}
    if not isinstance(s, dict):
        raise BadRequest("sampling must be an object")
    try:
        params = sampling_from_dict(s)
    except SamplingError as exc:
        raise BadRequest(f"sampling: {exc}") from None
    adapter = body.get("adapter")
    if adapter is not None:
        if not isinstance(adapter, dict) or not isinstance(adapter.get("name"), str) or not isinstance(
            adapter.get("source"), str
        ):
            raise BadRequest("adapter must be null or an object with string name and source")
        for key in ("sha256", "version"):
            if adapter.get(key) is not None and not isinstance(adapter[key], str):
                raise BadRequest(f"adapter.{key} must be a string or null")
    if params.prior_output_tokens > len(ids):
        raise BadRequest("sampling: prior_output_tokens exceeds the prompt's length")
    arrival = body.get("arrival")
    if arrival is not None and not isinstance(arrival, (int, float)):
        raise BadRequest("arrival must be a number")
    priority = body.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**31) <= priority < 2**31:
        raise BadRequest("priority must be an integer (32-bit)")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or len(salt) > MAX_SALT):
        raise BadRequest(f"cache_salt must be a string of at most {MAX_SALT} characters")
    return rid, ids, params, adapter, arrival


def bearer_middleware(token: str):
    """401 unless `Authorization: Bearer <token>` (constant-time compare); probes stay open."""
    want = f"Bearer {token}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.method == "GET" and request.path in OPEN_ROUTES:
            return await handler(request)
        got = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(got, want):
            return web.json_response({"error": "missing or wrong runner credential"}, status=401)
        return await handler(request)

    return check


class StateCollector:
    """Prometheus metrics read from the engine's last snapshot at scrape time."""

    def __init__(self, runner: "RunnerService"):
        self.r = runner

    def collect(self):
        st = self.r.state()
        g = GaugeMetricFamily
        yield g("lorafleet_runner_batch_size", "Requests in the running batch", value=st["batch_size"])
        yield g("lorafleet_runner_waiting_requests", "Requests waiting to join the batch", value=st["waiting"])
        yield g("lorafleet_runner_kv_free_tokens", "Free KV cache tokens", value=st["free_kv_tokens"])
        yield g("lorafleet_runner_kv_total_tokens", "KV cache tokens", value=st["total_kv_tokens"])
        yield g("lorafleet_runner_engine_up", "1 while the engine core process is alive", value=1.0 if self.r.engine.alive else 0.0)
        pool = st.get("adapter_pool") or {}
        yield g("lorafleet_runner_adapter_slots", "Adapter slots in the device pool", value=pool.get("gpu_slots", 0))
        yield g("lorafleet_runner_adapter_slots_used", "Adapter slots in use", value=pool.get("gpu_used", 0))
        yield g("lorafleet_runner_adapter_pool_bytes", "Bytes of the device adapter pool", value=pool.get("gpu_bytes", 0))
        yield g("lorafleet_runner_adapter_host_cached", "Adapters in the host tier", value=pool.get("host_cached", 0))
        resident = len(st.get("resident_adapters") or [])
        yield g("lorafleet_runner_adapters_resident", "Adapters in the device pool, loaded", value=resident)
        yield g("lorafleet_runner_adapters_loading", "Adapters being loaded into the device pool",
                value=max(0, pool.get("gpu_used", 0) - resident))
        for key in ("loads", "evictions", "failures"):
            yield CounterMetricFamily(f"lorafleet_runner_adapter_{key}", f"Adapter {key}", value=pool.get(key, 0))
        yield CounterMetricFamily("lorafleet_runner_generated_tokens", "Generated tokens", value=self.r.tokens_out)
        c = CounterMetricFamily("lorafleet_runner_requests", "Finished requests", labels=["finish_reason"])
        for reason, n in sorted(self.r.finished.items()):
            c.add_metric([reason], n)
        yield c
        # The names and labels the Gateway API Inference Extension reads from vLLM model servers.
        yield g("vllm:num_requests_running", "Running requests", value=st["batch_size"])
        yield g("vllm:num_requests_waiting", "Waiting requests", value=st["waiting"])
        total = max(st["total_kv_tokens"], 1)
        yield g("vllm:kv_cache_usage_perc", "KV cache usage (0-1)", value=1 - st["free_kv_tokens"] / total)
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(pool.get("gpu_slots", 0)), ",".join(sorted(st["running_adapters"])),
                         ",".join(sorted(st["waiting_adapters"]))], time.time())
        yield info
        pc = st.get("prefix_cache") or {}
        yield CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=pc.get("queries", 0))
        yield CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=pc.get("hits", 0))
        yield g("lorafleet_runner_prefix_cache_pages", "KV pages held by the prefix cache", value=pc.get("cached_pages", 0))


VALIDATIONS_AT_ONCE = 2
START_FAILURE_LINGER_S = 2.0  # an engine that could not start: its reason stays readable on /readyz this long
START_FAILURE_STATUS = 2  # the exit status then (as for a model the command refuses)


def _graceful_exit() -> None:
    raise web.GracefulExit()  # as run_app's SIGTERM handler: stops the app, runs on_shutdown


class RunnerService:
    """The front: streams, submits and cancels to the engine core; health from the core's fate."""

    def __init__(self, engine: EngineClient, runner_id: str, grace_seconds: float = 30.0,
                 exit_on_start_failure: bool = False):
        """`exit_on_start_failure`: when the engine core exits before it is ready, stop the app (after
        START_FAILURE_LINGER_S) and leave `exit_status` set, instead of answering unhealthy until stopped."""
        self.engine = engine
        self.id = runner_id
        self.grace_seconds = grace_seconds
        self.exit_on_start_failure = exit_on_start_failure
        self.exit_status = 0
        self.draining = False
        self.tokens_out = 0
        self.finished: dict[str, int] = {}
        self.streams: dict[str, RunnerStream] = {}
        self.pending: dict[str, RunnerStream] = {}  # waiting for their adapter to be fetched
        self.cancelled_pending: set[str] = set()
        self.adapter_dirs: dict[tuple, str] = {}  # (name, source, sha256) -> local folder
        # validations read whole adapters into memory: two at a time, whatever the operator asks at once
        self.validations = asyncio.Semaphore(VALIDATIONS_AT_ONCE)
        self.registry = CollectorRegistry()
        self.registry.register(StateCollector(self))
        self.engine.on_step.append(self._count)
        self._start_task: asyncio.Task | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        # The model loads in the background: /healthz answers at once, /readyz once it is loaded.
        self._start_task = asyncio.create_task(self._start_engine())

    async def _start_engine(self) -> None:
        failure = None  # an exception of the start itself (not the model's refusal): logged with its traceback
        try:
            started = await self.engine.start()
        except Exception as exc:
            failure = exc
            self.engine.error = f"engine core did not start: {type(exc).__name__}: {exc}"
            started = False
        if started:  # what happens to the core from now on is reported on /healthz, never an exit
            if self.engine.ready:
                log.info("runner %s ready (engine core pid %s)", self.id, self.engine.pid)
            return
        if self.draining:  # stopped while loading
            return
        if not self.exit_on_start_failure:
            log.error("runner %s could not start: %s", self.id, self.engine.error, exc_info=failure)
            return
        self.exit_status = START_FAILURE_STATUS
        log.error("runner %s could not start: %s; exiting with status %d", self.id, self.engine.error,
                  self.exit_status, exc_info=failure)
        await asyncio.sleep(START_FAILURE_LINGER_S)
        if not self.draining:
            asyncio.get_running_loop().call_soon(_graceful_exit)

    async def stop(self, app: web.Application) -> None:
        """SIGTERM / Ctrl-C: stop taking work, let in-flight requests finish (up to the grace time),
        cancel the rest, close the streams, stop the engine core (it is always reaped)."""
        self.draining = True
        deadline = time.monotonic() + self.grace_seconds
        while (self.engine.owners or self.pending) and self.engine.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self.engine.owners):
            self.engine.cancel(rid)
        for rid in list(self.pending):
            self.cancelled_pending.add(rid)
        t0 = time.monotonic()
        while self.engine.owners and self.engine.alive and time.monotonic() - t0 < 2.0:
            await asyncio.sleep(0.02)
        await self.engine.stop(timeout=10.0)
        for st in list(self.streams.values()):
            st.close()
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()

    def _count(self, entries: list[list]) -> None:
        n = 0
        for e in entries:
            n += len(e[1])
            if e[2] is not None:
                self.finished[e[2]] = self.finished.get(e[2], 0) + 1
        self.tokens_out += n

    @property
    def ready(self) -> bool:
        return self.engine.ready and not self.draining

    def state(self) -> dict:
        snap = dict(self.engine.snapshot or EMPTY_STATE)
        info = self.engine.info
        snap.update(id=self.id, ready=self.ready, draining=self.draining,
                    engine={"pid": self.engine.pid, "alive": self.engine.alive})
        if info:
            snap.update(page_size=info["page_size"], max_model_len=info["max_model_len"], model=info["model"])
        if self.engine.error:
            snap["error"] = self.engine.error
        return snap

    # -- streams and requests -------------------------------------------------------------------
    async def stream(self, request: web.Request) -> web.StreamResponse:
        if not self.ready:
            return web.json_response({"error": self.engine.error or "runner is not ready"}, status=503)
        sid = request.query.get("id") or secrets.token_hex(8)
        if sid in self.streams:
            return web.json_response({"error": f"stream {sid} is already open"}, status=409)
        st = RunnerStream(sid)
        self.streams[sid] = st
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
            await resp.write(hello_line(self.id, sid, {"page_size": self.engine.info.get("page_size")}))
            while True:
                data = await st.next_chunk()
                if data is None:
                    break
                await resp.write(data)
        except (ConnectionResetError, ConnectionError):
            log.info("stream %s went away", sid)
        finally:
            del self.streams[sid]
            st.closed = True
            mine = self.engine.in_flight(st) + [rid for rid, s in self.pending.items() if s is st]
            for rid in mine:  # its scheduler is gone: free the pages of its requests now
                self.cancelled_pending.add(rid) if rid in self.pending else self.engine.cancel(rid)
            if mine:
                log.info("stream %s closed; cancelled %d request(s)", sid, len(mine))
        return resp

    async def generate(self, request: web.Request) -> web.Response:
        if not self.ready:
            return web.json_response({"error": self.engine.error or "runner is not ready"}, status=503)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "body is not valid JSON"}, status=400)
        try:
            rid, ids, params, adapter, arrival = parse_generate(body)
            vocab = self.engine.info.get("vocab_size")
            if vocab and max(ids) >= vocab:
                raise BadRequest(f"prompt_token_ids must be below the vocabulary size {vocab}")
            if any(t >= vocab for t in params.stop_token_ids) if vocab else False:
                raise BadRequest(f"stop_token_ids must be below the vocabulary size {vocab}")
        except BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)
        st = self.streams.get(body.get("stream") or "")
        if st is None:
            return web.json_response({"error": "unknown stream: open GET /v1/stream?id=... first and name it in "
                                               "the request's `stream` field"}, status=404)
        if rid in self.engine.owners or rid in self.pending:
            return web.json_response({"error": f"request {rid} is already running"}, status=409)
        wire = {"id": rid, "prompt_ids": ids, "sampling": dataclasses.asdict(params), "adapter": None,
                "arrival": float(arrival) if arrival is not None else time.time(), "cache_salt": body.get("cache_salt"),
                "priority": body.get("priority", 0)}
        if adapter is not None:
            key = (adapter["name"], adapter["source"], adapter.get("sha256"))
            local = self.adapter_dirs.get(key)
            wire["adapter"] = {"name": key[0], "source": local, "sha256": key[2], "version": adapter.get("version")}
            if local is None:  # fetch (or check) it off the event loop; the request waits, not the POST
                self.pending[rid] = st
                asyncio.create_task(self._fetch_then_submit(key, wire, st))
                return web.json_response({"request_id": rid, "accepted": True}, status=202)
        self.engine.submit(wire, st)
        return web.json_response({"request_id": rid, "accepted": True}, status=202)

    async def _fetch_then_submit(self, key: tuple, wire: dict, st: RunnerStream) -> None:
        from lorafleet.runner.service.adapter_fetch import local_adapter_dir

        rid = wire["id"]
        try:
            local = await asyncio.get_running_loop().run_in_executor(None, local_adapter_dir, *key)
        except AdapterError as exc:
            self.pending.pop(rid, None)
            self.cancelled_pending.discard(rid)
            st.deliver([[rid, [], "error", str(exc)]])
            return
        self.adapter_dirs[key] = str(local)
        self.pending.pop(rid, None)
        if rid in self.cancelled_pending or st.closed or not self.engine.alive:
            self.cancelled_pending.discard(rid)
            st.deliver([[rid, [], "cancelled" if self.engine.alive else "aborted", self.engine.error]])
            return
        wire["adapter"] = {**wire["adapter"], "source": str(local)}
        self.engine.submit(wire, st)

    async def cancel(self, request: web.Request) -> web.Response:
        rid = request.match_info["request_id"]
        known = rid in self.engine.owners or rid in self.pending
        if rid in self.pending:
            self.cancelled_pending.add(rid)
        elif known:
            self.engine.cancel(rid)
        return web.json_response({"request_id": rid, "cancelled": known})

    async def get_state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def healthz(self, request: web.Request) -> web.Response:
        if self.engine.error and not (self.draining and not self.engine.alive):
            return web.json_response({"ok": False, "error": self.engine.error}, status=500)
        return web.json_response({"ok": True})

    async def readyz(self, request: web.Request) -> web.Response:
        body = {"ready": self.ready}
        if self.engine.error:
            body["error"] = self.engine.error
        return web.json_response(body, status=200 if self.ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def validate(self, request: web.Request) -> web.Response:
        import torch

        from lorafleet.runner.lora.adapter import load_adapter
        from lorafleet.runner.service.adapter_fetch import local_adapter_dir

        info = self.engine.info
        if not info:
            return web.json_response({"ok": False, "error": "runner is not ready"}, status=503)
        try:
            body = await request.json()
            name, source = body["name"], body["source"]
            if not isinstance(name, str) or not isinstance(source, str) or not name.strip() or not source.strip():
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            return web.json_response({"ok": False, "error": "body must be {name, source, sha256?} with a non-empty "
                                      "name and source"}, status=400)

        def check():
            """What loading checks, by loading it: the files and shapes (inspect_adapter), then every weight finite in
            the serving dtype (a NaN, or a value that overflows there). Reads the whole file."""
            local = local_adapter_dir(name, source, body.get("sha256"))
            dtype = getattr(torch, info.get("adapter_dtype", "float32"))
            return load_adapter(name, local, BaseShape(**info["base_shape"]), info["max_lora_rank"], dtype).spec

        try:
            async with self.validations:
                spec = await asyncio.get_running_loop().run_in_executor(None, check)
        except AdapterError as exc:
            return web.json_response({"ok": False, "error": str(exc)})
        return web.json_response({"ok": True, "rank": spec.max_rank, "target_modules": list(spec.target_modules),
                                  "size_bytes": spec.size_bytes, "base_model": spec.base_model})


SERVICE_KEY = web.AppKey("service", RunnerService)


def create_app(service: RunnerService, token: str | None = None) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY, middlewares=[bearer_middleware(token)] if token else [])
    app.router.add_get("/v1/stream", service.stream)
    app.router.add_post("/v1/generate", service.generate)
    app.router.add_post("/v1/cancel/{request_id}", service.cancel)
    app.router.add_post("/v1/adapters/validate", service.validate)
    app.router.add_get("/state", service.get_state)
    app.router.add_get("/healthz", service.healthz)
    app.router.add_get("/readyz", service.readyz)
    app.router.add_get("/metrics", service.metrics)
    app.on_startup.append(service.start)
    app.on_shutdown.append(service.stop)
    app[SERVICE_KEY] = service
    return app


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch-size", type=cli_args.positive_int, default=32, help="requests per batch (Punica uses 32)")
    p.add_argument("--page-size", type=cli_args.positive_int, default=16, help="tokens per KV page")
    p.add_argument("--kv-pages", type=cli_args.positive_int, default=None, help="KV pages (default: from memory)")
    p.add_argument("--kv-fraction", type=cli_args.fraction, default=0.85, help="GPU: share of free memory for the KV cache")
    p.add_argument("--kv-cache-gb", type=cli_args.positive_float, default=1.0, help="CPU: KV cache size in GiB")
    p.add_argument("--max-lora-rank", type=cli_args.lora_rank, default=64,
                   help=f"largest adapter rank accepted (1-{cli_args.MAX_LORA_RANK})")
    p.add_argument("--lora-slots", type=cli_args.positive_int, default=None,
                   help="adapters resident on the device at once (default: 8 on the CPU, 64 on a GPU)")
    p.add_argument("--max-model-len", type=cli_args.positive_int, default=None, help="context length (default: the model's)")
    p.add_argument("--dtype", default="auto", choices=cli_args.DTYPES,
                   help="auto (float32 on the CPU, bfloat16 on CUDA), float32, bfloat16 or float16")
    p.add_argument("--device", default="auto", type=cli_args.device, help="auto (CUDA when available), cpu, cuda or cuda:N")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every step eagerly on CUDA (no decode or piecewise CUDA graphs)")
    p.add_argument("--admit-batch", type=cli_args.positive_int, default=None,
                   help="while requests run, admit new ones once this many batch places are free (or after "
                        "--admit-wait-steps steps) so prompts share prefill steps (default: max batch / 8 on "
                        "CUDA, 1 on CPU)")
    p.add_argument("--admit-wait-steps", type=cli_args.non_negative_int, default=8,
                   help="longest wait of admission batching, in steps")
    p.add_argument("--max-step-tokens", type=cli_args.positive_int, default=None,
                   help="chunked prefill: token rows per step, decodes included (default: 2048 on CUDA, 512 on the "
                        "CPU)")
    p.add_argument("--decode-prefill-tokens", type=cli_args.positive_int, default=None,
                   help="chunked prefill: prompt rows a step that carries decodes may add (smaller: decoding "
                        "requests are delayed less by long prompts, whose first token comes later; default: "
                        "the step budget alone)")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill whole prompts in one step (the old behaviour; long prompts stall decodes)")
    p.add_argument("--tp", type=cli_args.positive_int, default=1,
                   help="tensor parallelism: drive this many GPUs of the node as one engine (from --device on)")
    add_prefix_cache_argument(p)
    cli_args.add_batch_invariant_argument(p)
    add_precision_arguments(p)


PREFIX_CACHE_HELP = ("do not keep KV pages for later requests (the prefix cache is on by default: full pages of a "
                     "prompt are reused by requests with the same prefix, adapter and cache salt)")


def add_prefix_cache_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-prefix-cache", action="store_true", help=PREFIX_CACHE_HELP)


def add_precision_arguments(p: argparse.ArgumentParser) -> None:
    """--quantization and --kv-cache-dtype (serve, runner, generate, bench)."""
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="fp8: projection weights in FP8 (e4m3, a scale per output row, quantized at load; products on "
                        "FP8 tensor cores with activations quantized per token, weight-only on the CPU). Default: as "
                        "the checkpoint stores them (a pre-quantized FP8 checkpoint runs in FP8)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="K/V pages in the model's dtype (auto, the default) or FP8 e4m3 (half the bytes of bf16)")


def engine_config(args: argparse.Namespace):
    from lorafleet.runner.config import EngineConfig

    return EngineConfig(
        max_batch_size=args.max_batch_size, page_size=args.page_size, num_pages=args.kv_pages,
        kv_fraction=args.kv_fraction, kv_cache_gb=args.kv_cache_gb, max_lora_rank=args.max_lora_rank,
        lora_slots=args.lora_slots, max_model_len=args.max_model_len, dtype=args.dtype, device=args.device,
        cuda_graphs=not args.no_cuda_graphs, admit_batch=args.admit_batch, admit_wait_steps=args.admit_wait_steps,
        max_step_tokens=args.max_step_tokens, chunked_prefill=False if args.no_chunked_prefill else None, tp=args.tp,
        decode_prefill_tokens=args.decode_prefill_tokens, prefix_cache=not args.no_prefix_cache,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, batch_invariant=args.batch_invariant,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF model directory, .gguf file or model source URI")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=cli_args.port, default=8001, help="port to listen on")
    p.add_argument("--threads", type=cli_args.positive_int, default=None, metavar="N",
                   help="torch threads of the engine (CPU work) (default: the CPUs this process may use, within its "
                        "cgroup's CPU limit)")
    p.add_argument("--id", default=None, help="stable runner id (default: env LORAFLEET_RUNNER_ID or host:port)")
    p.add_argument("--grace-seconds", type=cli_args.non_negative_float, default=30.0,
                   help="on SIGTERM, time to finish in-flight requests")
    add_engine_arguments(p)


def engine_config_dict(args: argparse.Namespace) -> dict:
    """The EngineConfig fields as plain JSON for the engine core's init message."""
    d = dataclasses.asdict(engine_config(args))
    d.pop("extra", None)
    # not an EngineConfig field: the engine core sets torch's threads from it before loading
    d["threads"] = args.threads if getattr(args, "threads", None) else available_cpus()
    return d


def service_from_args(args: argparse.Namespace, model: str, port: int | None = None) -> RunnerService:
    """`port`: the port actually bound (differs from args.port when that is 0), for the default runner id."""
    runner_id = args.id or env.runner_id() or f"{socket.gethostname()}:{args.port if port is None else port}"
    client = EngineClient(model, engine_config_dict(args), log_level=str(args.log_level))
    return RunnerService(client, runner_id, args.grace_seconds, exit_on_start_failure=True)


def run(args: argparse.Namespace) -> int:
    from lorafleet.scheduler.listen import ListenError, bind

    # Before fetching or loading the model, so a busy port is reported at once. Until the app runs, connections
    # wait in the listen backlog (health probes time out rather than being refused: the same "not ready").
    try:
        sock = bind(args.host, args.port)
    except ListenError as exc:
        log.error("%s", exc)
        return 2
    model = args.model
    if "://" in model:
        from lorafleet.common.sources import fetch_model

        model = str(fetch_model(model, cache_dir=env.cache_dir() / "models"))
    service = service_from_args(args, model, port=sock.getsockname()[1])
    app = create_app(service, env.runner_token())
    log.info("runner %s listening on %s:%d (pid %d)", service.id, args.host, sock.getsockname()[1], os.getpid())
    web.run_app(app, sock=sock, print=None, handle_signals=True, access_log=None,
                shutdown_timeout=args.grace_seconds + 5)
    return service.exit_status

"""`lorafleet runner`: the engine behind HTTP (see docs/api.md for the protocol).

POST /v1/generate streams NDJSON token events of one request; closing the stream cancels
it. The engine runs on its own thread (`EngineLoop`), so the event loop stays responsive.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lorafleet import env
from lorafleet.common.peft_config import AdapterError
from lorafleet.runner.sequence import (
    AdapterRef,
    SamplingError,
    SamplingParams,
    Sequence,
    parse_token_ids,
    sampling_from_dict,
)

log = logging.getLogger(__name__)

MAX_BODY = 16 * 1024 * 1024


class BadRequest(ValueError):
    pass


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
    arrival = body.get("arrival")
    if arrival is not None and not isinstance(arrival, (int, float)):
        raise BadRequest("arrival must be a number")
    return rid, ids, params, adapter, arrival


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
        pool = st.get("adapter_pool") or {}
        yield g("lorafleet_runner_adapter_slots", "Adapter slots in the device pool", value=pool.get("gpu_slots", 0))
        yield g("lorafleet_runner_adapter_slots_used", "Adapter slots in use", value=pool.get("gpu_used", 0))
        yield g("lorafleet_runner_adapter_pool_bytes", "Bytes of the device adapter pool", value=pool.get("gpu_bytes", 0))
        yield g("lorafleet_runner_adapter_host_cached", "Adapters in the host tier", value=pool.get("host_cached", 0))
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


class RunnerService:
    def __init__(self, engine_factory, runner_id: str, grace_seconds: float = 30.0):
        self.engine_factory = engine_factory
        self.id = runner_id
        self.grace_seconds = grace_seconds
        self.engine = None
        self.loop_ = None
        self.load_error: str | None = None
        self.draining = False
        self.tokens_out = 0
        self.finished: dict[str, int] = {}
        self.registry = CollectorRegistry()
        self.registry.register(StateCollector(self))

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, app: web.Application) -> None:
        from lorafleet.runner.loop import EngineLoop

        loop = asyncio.get_running_loop()
        try:
            self.engine = await loop.run_in_executor(None, self.engine_factory)
        except Exception as exc:
            log.exception("model load failed")
            self.load_error = f"{type(exc).__name__}: {exc}"
            return
        self.loop_ = EngineLoop(self.engine, loop)
        self.loop_.on_outputs.append(self._count)
        self.loop_.start()
        log.info("runner %s ready", self.id)

    async def stop(self, app: web.Application) -> None:
        self.draining = True
        if self.loop_ is None:
            return
        deadline = time.monotonic() + self.grace_seconds
        while self.loop_.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for seq_id in list(self.loop_._queues):
            self.loop_.cancel(seq_id)
        await asyncio.sleep(0.2)
        await asyncio.get_running_loop().run_in_executor(None, self.loop_.stop)

    def _count(self, outputs) -> None:
        for o in outputs:
            self.tokens_out += len(o.new_token_ids)
            if o.finished:
                self.finished[o.finish_reason] = self.finished.get(o.finish_reason, 0) + 1

    @property
    def ready(self) -> bool:
        return self.loop_ is not None and self.loop_.alive and not self.draining

    def state(self) -> dict:
        snap = dict(self.loop_.snapshot) if self.loop_ else {
            "batch_size": 0, "max_batch_size": 0, "waiting": 0, "free_kv_tokens": 0, "total_kv_tokens": 0,
            "idle_seconds": 0.0, "running_adapters": {}, "waiting_adapters": {}, "resident_adapters": [],
            "adapter_pool": {},
        }
        snap.update(id=self.id, ready=self.ready, draining=self.draining)
        if self.engine is not None:
            snap["page_size"] = self.engine.config.page_size
            snap["max_model_len"] = self.engine.max_model_len
            snap["model"] = self.engine.model_config.name
        if self.load_error:
            snap["error"] = self.load_error
        return snap

    # -- handlers -----------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        if not self.ready:
            return web.json_response({"error": self.load_error or "runner is not ready"}, status=503)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "body is not valid JSON"}, status=400)
        try:
            rid, ids, params, adapter, arrival = parse_generate(body)
        except BadRequest as exc:
            return web.json_response({"error": str(exc)}, status=400)
        if rid in self.loop_._queues:
            return web.json_response({"error": f"request {rid} is already running"}, status=409)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        ref = None
        if adapter is not None:
            from lorafleet.runner.adapter_fetch import local_adapter_dir

            try:
                local = await asyncio.get_running_loop().run_in_executor(
                    None, local_adapter_dir, adapter["name"], adapter["source"], adapter.get("sha256"))
            except AdapterError as exc:
                await resp.write(json.dumps({"finish_reason": "error", "error": str(exc), "output_token_ids": []}).encode() + b"\n")
                return resp
            ref = AdapterRef(adapter["name"], str(local), adapter.get("sha256"))
        try:
            seq = Sequence(rid, ids, params, ref, arrival=float(arrival) if arrival is not None else time.time())
        except SamplingError as exc:
            await resp.write(json.dumps({"finish_reason": "error", "error": str(exc), "output_token_ids": []}).encode() + b"\n")
            return resp
        q = self.loop_.submit(seq)
        finished = False
        try:
            while True:
                out = await q.get()
                if out.new_token_ids:
                    await resp.write(json.dumps({"token_ids": out.new_token_ids}).encode() + b"\n")
                if out.finished:
                    final = {"finish_reason": out.finish_reason, "output_token_ids": out.output_ids or []}
                    if out.error:
                        final["error"] = out.error
                    await resp.write(json.dumps(final).encode() + b"\n")
                    finished = True
                    break
        except ConnectionResetError:
            log.debug("client of %s went away", rid)
        finally:
            if not finished:
                self.loop_.cancel(rid)  # client went away: free the request's pages now
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        rid = request.match_info["request_id"]
        known = self.loop_ is not None and rid in self.loop_._queues
        if known:
            self.loop_.cancel(rid)
        return web.json_response({"request_id": rid, "cancelled": known})

    async def get_state(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def healthz(self, request: web.Request) -> web.Response:
        if self.load_error:
            return web.json_response({"ok": False, "error": self.load_error}, status=500)
        if self.loop_ is not None and not self.loop_.alive:
            return web.json_response({"ok": False, "error": "engine thread stopped"}, status=500)
        return web.json_response({"ok": True})

    async def readyz(self, request: web.Request) -> web.Response:
        return web.json_response({"ready": self.ready}, status=200 if self.ready else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def validate(self, request: web.Request) -> web.Response:
        from lorafleet.common.peft_config import inspect_adapter
        from lorafleet.runner.adapter_fetch import local_adapter_dir

        if self.engine is None:
            return web.json_response({"ok": False, "error": "runner is not ready"}, status=503)
        try:
            body = await request.json()
            name, source = body["name"], body["source"]
            if not isinstance(name, str) or not isinstance(source, str):
                raise TypeError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            return web.json_response({"ok": False, "error": "body must be {name, source, sha256?}"}, status=400)

        def check():
            local = local_adapter_dir(name, source, body.get("sha256"))
            return inspect_adapter(name, local, base=self.engine.model_config.base_shape(),
                                   max_rank=self.engine.config.max_lora_rank)

        try:
            spec = await asyncio.get_running_loop().run_in_executor(None, check)
        except AdapterError as exc:
            return web.json_response({"ok": False, "error": str(exc)})
        return web.json_response({"ok": True, "rank": spec.max_rank, "target_modules": list(spec.target_modules),
                                  "size_bytes": spec.size_bytes, "base_model": spec.base_model})


SERVICE_KEY = web.AppKey("service", RunnerService)


def create_app(service: RunnerService) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY)
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
    p.add_argument("--max-batch-size", type=int, default=32, help="requests per batch (Punica uses 32)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--kv-pages", type=int, default=None, help="KV pages (default: from memory)")
    p.add_argument("--kv-fraction", type=float, default=0.85, help="GPU: share of free memory for the KV cache")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="CPU: KV cache size in GiB")
    p.add_argument("--max-lora-rank", type=int, default=64, help="largest adapter rank accepted")
    p.add_argument("--lora-slots", type=int, default=None, help="adapters resident on the device at once")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every step eagerly on CUDA (no decode or piecewise CUDA graphs)")
    p.add_argument("--admit-batch", type=int, default=None,
                   help="while requests run, admit new ones once this many batch places are free (or after "
                        "--admit-wait-steps steps) so prompts share prefill steps (default: max batch / 8 on "
                        "CUDA, 1 on CPU)")
    p.add_argument("--admit-wait-steps", type=int, default=8, help="longest wait of admission batching, in steps")


def engine_config(args: argparse.Namespace):
    from lorafleet.runner.config import EngineConfig

    return EngineConfig(
        max_batch_size=args.max_batch_size, page_size=args.page_size, num_pages=args.kv_pages,
        kv_fraction=args.kv_fraction, kv_cache_gb=args.kv_cache_gb, max_lora_rank=args.max_lora_rank,
        lora_slots=args.lora_slots, max_model_len=args.max_model_len, dtype=args.dtype, device=args.device,
        cuda_graphs=not args.no_cuda_graphs, admit_batch=args.admit_batch, admit_wait_steps=args.admit_wait_steps,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF model directory, .gguf file or model source URI")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--id", default=None, help="stable runner id (default: env LORAFLEET_RUNNER_ID or host:port)")
    p.add_argument("--grace-seconds", type=float, default=30.0, help="on SIGTERM, time to finish in-flight requests")
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    from lorafleet.runner.engine import Engine

    runner_id = args.id or env.runner_id() or f"{socket.gethostname()}:{args.port}"
    model = args.model
    if "://" in model:
        from lorafleet.common.sources import fetch_model

        model = str(fetch_model(model, cache_dir=env.cache_dir() / "models"))
    cfg = engine_config(args)
    service = RunnerService(lambda: Engine(model, cfg), runner_id, args.grace_seconds)
    app = create_app(service)
    log.info("runner %s listening on %s:%d (pid %d)", runner_id, args.host, args.port, os.getpid())
    web.run_app(app, host=args.host, port=args.port, print=None, handle_signals=True, access_log=None,
                shutdown_timeout=args.grace_seconds + 5)
    return 0



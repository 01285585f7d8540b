"""`lorafleet scheduler`: the OpenAI-compatible front end over a set of runners (no torch).

Authenticates (optional API keys), parses and tokenizes off the event loop, applies the
per-request budgets, places every request on a runner (cluster.py), streams text back with
incremental detokenization and stop strings (sinks.py: written to the client's socket as the
runner's step line is read), cancels the work of clients that went away, and serves the admin
API the operator reads. Every error is an OpenAI-shaped JSON answer
(http_errors.py); the API is described by `/openapi.json` (openapi.py).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hmac
import json
import logging
import secrets
import time
from pathlib import Path

from aiohttp import web
from prometheus_client import generate_latest

from lorafleet import env
from lorafleet.common import cli_args
from lorafleet.common.peft_config import refusal_reason, scrub_paths
from lorafleet.scheduler import limits as limits_mod
from lorafleet.scheduler import openai_api as oa
from lorafleet.scheduler.api_keys import ANYONE, ApiKeyFileError, ApiKeys, Grant, cache_salt
from lorafleet.scheduler.availability import AdapterAvailability
from lorafleet.scheduler.bodies import parse_body
from lorafleet.scheduler.cluster import RUNNER_REFUSED, Cluster
from lorafleet.scheduler.detokenizer import IncrementalDetokenizer
from lorafleet.scheduler.disconnect import DisconnectWatch
from lorafleet.scheduler.discovery import RunnerDirectory, RunnerEndpoint
from lorafleet.scheduler.http_errors import ClientGone, errors_middleware, quiet_client_protocol_errors, read_body
from lorafleet.scheduler.limits import RequestLimits
from lorafleet.scheduler.metrics import SchedulerMetrics
from lorafleet.scheduler.openai_api import ApiError
from lorafleet.scheduler.placement import POLICIES, busiest_fit
from lorafleet.scheduler.prompts import PromptEncoder
from lorafleet.scheduler.registry import AdapterRegistry, DirectoryFeed
from lorafleet.scheduler.request import Request
from lorafleet.scheduler.sinks import CollectSink, StreamSink
from lorafleet.scheduler.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_BODY = 8 * 1024 * 1024


class SchedulerService:
    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        registry: AdapterRegistry,
        directory: RunnerDirectory,
        *,
        max_model_len: int = 4096,
        limits: RequestLimits | None = None,
        api_keys: ApiKeys | None = None,
        max_queue: int = 1024,
        queue_timeout: float = 120.0,
        admin_token: str | None = None,
        poll_interval: float = 0.5,
        grace_seconds: float = 30.0,
        disconnect_poll: float = 0.25,
        placement: str = "busiest",
        runner_token: str | None = None,
    ):
        self.tok, self.model_name = tokenizer, model_name
        self.registry, self.directory = registry, directory
        self.limits = limits or RequestLimits(max_model_len=max_model_len)
        self.max_model_len = self.limits.max_model_len
        self.api_keys = api_keys
        self.max_queue, self.queue_timeout = max_queue, queue_timeout
        self.admin_token = admin_token
        self.grace_seconds = grace_seconds
        self.metrics = SchedulerMetrics()
        self.placement = placement
        if placement.startswith("busiest"):
            per_slot = self.limits.prefix_affinity_tokens if placement == "busiest" else 0
            policy = functools.partial(busiest_fit, max_backlog=self.limits.max_prefill_backlog,
                                       prefix_tokens_per_slot=per_slot)
        else:
            policy = POLICIES[placement]()
        self.cluster = Cluster(directory, poll_interval=poll_interval, metrics=self.metrics, placement=policy,
                               runner_token=runner_token, runner_queue=self.limits.runner_queue)
        self.metrics.attach_cluster(self.cluster)
        self.prompts = PromptEncoder(tokenizer, self.max_model_len)
        self.availability = AdapterAvailability()
        registry.subscribe(self._adapter_changed)
        for entry in registry.entries():
            self._adapter_changed(entry.name, entry)
        self.disconnects = DisconnectWatch(disconnect_poll)
        self.accepting = True
        self.in_flight: set[Request] = set()
        self.key_in_flight: dict[str, int] = {}  # API key (Grant.ident) -> its sequences in flight, for max_concurrent
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
        for req in list(self.in_flight):  # past the grace period: each ends now, answered 503 or its stream closed
            self.cluster.cancel(req)
            if not req.done:  # (a queued request has no runner for cancel() to finish it on)
                req.finish("cancelled")
        for t in self.background:
            t.cancel()
        self.disconnects.stop()
        self.prompts.close()
        await self.cluster.stop()

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
    def _adapter_changed(self, name: str, entry) -> None:
        """A registry change clears the adapter's refusal mark; an entry published with a problem (its files
        failed the registry's check) is marked at once, so it is listed unavailable before any request fails.
        The mark then works like a runner's refusal: after the retry window a request goes to a runner,
        and a success (the files were fixed) clears it."""
        self.availability.clear(name)
        if entry is not None and entry.problem:
            self.availability.refuse(name, entry.problem)

    def _authenticate(self, request: web.Request) -> Grant:
        return self.api_keys.authenticate(request) if self.api_keys is not None else ANYONE

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

    def _check_key_limit(self, grant: Grant, count: int) -> None:
        """An API key's `max_concurrent` (api_keys.py): `count` more sequences must fit beside its others."""
        limit = grant.max_concurrent
        if limit is None:
            return
        if count > limit:
            raise ApiError(400, f"this request asks for {count} sequences; this API key may have at most {limit} in "
                                "flight at once", param="n", code="too_many_sequences")
        if self.key_in_flight.get(grant.ident, 0) + count > limit:
            raise ApiError(429, f"this API key already has {self.key_in_flight[grant.ident]} sequences in flight; it "
                                f"may have at most {limit} at once", type_="rate_limit_error",
                           code="too_many_concurrent_requests", headers={"Retry-After": "1"})

    def _not_found(self, name: str) -> ApiError:
        return ApiError(404, f"The model `{oa.shown_name(name)}` does not exist or you do not have access to it.",
                        param="model", code="model_not_found")

    def _resolve_model(self, name: str, grant: Grant):
        """The adapter entry for `name` (None: the base model); 404 unknown or not granted, 400 refused."""
        if not grant.allows(name):
            raise self._not_found(name)
        if name == self.model_name:
            return None
        entry = self.registry.get(name)
        if entry is None:
            raise self._not_found(name)
        why = self.availability.reason(name)
        if why is not None:
            raise self._adapter_refused(name, why)
        return entry

    @staticmethod
    def _adapter_refused(name: str, why: str) -> ApiError:
        return ApiError(400, f"adapter {name!r} cannot be served: {why}", param="model", code="adapter_unavailable")

    def _failure(self, req: Request, reason: str, error: str | None) -> ApiError:
        """The answer for a sequence that ended without stop/length (before any text was sent)."""
        if reason == "error" and req.adapter is not None:
            why = refusal_reason(error, req.adapter.name)
            if why is not None:
                why = scrub_paths(why)  # runners should send none; clients never see one
                self.availability.refuse(req.adapter.name, why)
                return self._adapter_refused(req.adapter.name, why)
        if reason == "cancelled":
            return ApiError(503, "the request was cancelled by the server", code="cancelled",
                            headers={"Retry-After": "5"})
        if reason == "error" and error and error.startswith(RUNNER_REFUSED):
            # the runner's own validation refused what this server's let through: the client's request, not a fault
            return ApiError(400, f"the request was refused: {scrub_paths(error[len(RUNNER_REFUSED):])}",
                            code="invalid_request")
        return ApiError(500, f"generation failed: {scrub_paths(error or reason)}", code="generation_failed")

    def _parse(self, raw: bytes, chat: bool) -> tuple[oa.GenParams, list]:
        """Blocking (runs in the tokenizer pool): body -> (params, messages or raw prompts)."""
        body = parse_body(raw)
        params = oa.parse_common(body, chat, self.limits.completion_cap, self.tok.vocab_size)
        # the budgets first, from the prompts' sizes: before a walk over (up to millions of) token ids
        count, ids = (1, 0) if chat else oa.prompt_sizes(body, self.max_model_len)
        seqs = count * params.n
        if seqs > self.limits.max_sequences:
            raise ApiError(400, f"this request asks for {seqs} sequences ({count} prompt(s) x n={params.n}); "
                                f"at most {self.limits.max_sequences} are allowed per request",
                           param="n" if params.n > 1 else "prompt", code="too_many_sequences")
        self._check_prompt_tokens(ids * params.n, "prompt")
        items = [oa.parse_messages(body)] if chat else oa.parse_prompts(body, self.tok.vocab_size)
        return params, items

    def _check_prompt_tokens(self, total: int, where: str) -> None:
        if total > self.limits.max_prompt_tokens:
            raise ApiError(400, f"this request holds {total} prompt tokens (prompts x n); at most "
                                f"{self.limits.max_prompt_tokens} are allowed per request", param=where,
                           code="too_many_prompt_tokens")

    def _make_requests(self, params: oa.GenParams, adapter, prompts: list[list[int]], chat: bool,
                       grant: Grant = ANYONE) -> list[Request]:
        lim, ctx = self.limits, self.max_model_len
        where = "messages" if chat else "prompt"
        for p_ids in prompts:
            if len(p_ids) >= ctx:
                raise oa.context_exceeded(where, f"This model's maximum context length is {ctx} tokens, "
                                                 f"however the prompt has {len(p_ids)} tokens.")
        self._check_prompt_tokens(sum(len(p) for p in prompts) * params.n, where)
        reqs = []
        salt = cache_salt(grant.cache_salt, params.cache_salt)
        max_kv = self.cluster.max_total_kv()
        for p_ids in prompts:
            n = len(p_ids)
            if max_kv and n + 1 > max_kv:
                raise oa.context_exceeded(where, f"the prompt has {n} tokens; no runner has that much KV cache "
                                                 f"({max_kv} tokens)")
            max_tokens = params.max_tokens if params.max_tokens is not None else min(lim.completion_cap, ctx - n)
            if max_kv and params.max_tokens is None:  # the default completion: what the largest KV cache can hold
                max_tokens = min(max_tokens, max_kv - n)
            if params.max_tokens is None and params.default_max_tokens is not None:  # completions' default of 16
                max_tokens = min(max_tokens, params.default_max_tokens)
            if n + max_tokens > ctx:
                raise oa.context_exceeded("max_tokens", f"This model's maximum context length is {ctx} tokens, "
                                          f"however you requested {n + max_tokens} tokens ({n} in the prompt, "
                                          f"{max_tokens} for the completion).")
            if params.max_tokens is None and params.min_tokens > max_tokens:  # (a given max_tokens: parse_common)
                raise oa.bad("min_tokens", f"min_tokens ({params.min_tokens}) must not exceed max_tokens (omitted: "
                                           f"{max_tokens}, the room left after the prompt's {n} tokens)")
            for k in range(params.n):
                seed = params.seed + k if params.seed is not None else None
                if seed is None and params.temperature > 0:
                    seed = secrets.randbits(48)
                reqs.append(Request(
                    id=oa.new_id(chat)[-12:] + f"-{len(reqs)}", model=params.model, adapter=adapter,
                    prompt_ids=list(p_ids), max_tokens=max_tokens,
                    sampling={"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                              "seed": seed, "stop_token_ids": list(params.stop_token_ids),
                              "ignore_eos": params.ignore_eos, **params.extras()},
                    cache_salt=salt, priority=max(params.priority, grant.priority) if grant.priority is not None
                    else params.priority,
                ))
        return reqs

    # -- OpenAI endpoints --------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        grant = self._authenticate(request)
        raw = await read_body(request)
        loop = asyncio.get_running_loop()
        params, items = await loop.run_in_executor(self.prompts.pool, self._parse, raw, chat)
        adapter = self._resolve_model(params.model, grant)
        prompts = [await self.prompts.chat(items[0])] if chat else await self.prompts.prompts(items)
        reqs = self._make_requests(params, adapter, prompts, chat, grant)
        self._check_capacity(len(reqs))
        self._check_key_limit(grant, len(reqs))
        detoks = [IncrementalDetokenizer(self.tok, r.prompt_ids, params.stop,
                                         skip_special_tokens=params.skip_special_tokens,
                                         include_stop=params.include_stop_str_in_output) for r in reqs]
        lps = None if params.logprobs is None else [oa.LogprobsWriter(self.tok, chat, params.skip_special_tokens)
                                                    for _ in reqs]
        echo = None
        if params.echo:  # each choice's prompt as given (token-id prompts decoded)
            echo = [p if isinstance(p, str) else self.tok.decode(p, params.skip_special_tokens)
                    for p in items for _ in range(params.n)]
        rid = oa.new_id(chat)
        gone: list[bool] = []

        def client_gone() -> None:
            if not gone:
                gone.append(True)
                self._client_gone(reqs)

        if params.stream:
            enc = oa.ChunkEncoder(rid, params.model, chat)
            sink = StreamSink(detoks, enc, chat, self._stop_string, client_gone,
                              lambda req, reason, error: self._failure(req, reason, error).body()["error"], lps, echo)
        else:
            sink = CollectSink(detoks, self._stop_string, lps, echo)
        for i, r in enumerate(reqs):
            r.index, r.sink = i, sink
            self.metrics.prompt_tokens.inc(len(r.prompt_ids))
            self.metrics.model_prompt_tokens.labels(model=r.model).inc(len(r.prompt_ids))
            self.in_flight.add(r)
            self.cluster.submit(r)
        watch = self.disconnects.watch(request, client_gone)
        if grant.max_concurrent is not None:  # (given back in the finally below, whatever happens)
            self.key_in_flight[grant.ident] = self.key_in_flight.get(grant.ident, 0) + len(reqs)
        try:
            if params.stream:
                return await self._stream(request, rid, params, reqs, chat, sink, enc, gone)
            return await self._collect(rid, params, reqs, chat, sink, gone)
        finally:
            self.disconnects.forget(watch)
            if grant.max_concurrent is not None:
                left = self.key_in_flight.get(grant.ident, 0) - len(reqs)
                if left > 0:
                    self.key_in_flight[grant.ident] = left
                else:
                    self.key_in_flight.pop(grant.ident, None)
            for r in reqs:
                if not r.done:
                    self.cluster.cancel(r)
                    r.finish("cancelled")
                self.in_flight.discard(r)
                self.metrics.observe_finished(r, r.finish_reason or "cancelled")
            # a success clears a refusal mark, unless the adapter's files changed since (a new entry, e.g. files found
            # broken by a rescan while this request ran on the old ones: the mark is the new files')
            if (adapter is not None and all(r.finish_reason in ("stop", "length") for r in reqs)
                    and self.registry.get(adapter.name) == adapter):
                self.availability.clear(adapter.name)

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

    def _usage(self, params: oa.GenParams, reqs: list[Request]) -> dict:
        """Each prompt counts once (not once per choice): its tokens, and its cached tokens as the most any of
        its `n` choices found in a runner's prefix cache (so cached_tokens <= prompt_tokens)."""
        n = params.n
        cached = sum(max(r.cached_tokens or 0 for r in reqs[i:i + n]) for i in range(0, len(reqs), n))
        return oa.usage(sum(len(r.prompt_ids) for r in reqs[::n]), sum(len(r.generated) for r in reqs), cached)

    async def _collect(self, rid: str, params: oa.GenParams, reqs: list[Request], chat: bool, sink: CollectSink,
                       gone: list[bool]) -> web.Response:
        await sink.finished
        if gone:
            raise ClientGone()
        for req, (reason, error) in zip(reqs, sink.ends):
            if reason not in ("stop", "length"):
                raise self._failure(req, reason, error)
        use = self._usage(params, reqs)

        def body() -> str:
            choices = [oa.choice(i, "".join(sink.parts[i]), sink.ends[i][0], chat,
                                 sink.logprobs[i].take() if sink.logprobs else None) for i in range(len(reqs))]
            return json.dumps(oa.completion_body(rid, params.model, chat, choices, use))

        if not sink.logprobs:
            return web.Response(text=body(), content_type="application/json")
        # With log-probabilities (up to 20 alternatives a token, the prompt's too with echo: tens of MB for a long
        # prompt), the entries' texts and the JSON are made in the tokenizer's worker threads, not on the event
        # loop that every other stream shares (the sink is finished: nothing writes it any more).
        text = await asyncio.get_running_loop().run_in_executor(self.prompts.pool, body)
        return web.Response(text=text, content_type="application/json")

    async def _stream(self, request: web.Request, rid: str, params: oa.GenParams, reqs: list[Request], chat: bool,
                      sink: StreamSink, enc: oa.ChunkEncoder, gone: list[bool]) -> web.StreamResponse:
        """SSE. Nothing is sent before the first event, so a refused adapter is still a JSON 4xx.
        After the first awaited write (aiohttp sends the headers) the sink writes each chunk to the
        socket itself as tokens arrive (`sinks.py`); this coroutine only steps in for a slow reader
        and the end."""
        await sink.wait()
        if gone:
            raise ClientGone()
        if sink.first_failure is not None:
            raise self._failure(*sink.first_failure)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)  # (the client may have gone as the headers go out: a reset here too)
            chunked = resp.headers.get("Transfer-Encoding") == "chunked"  # aiohttp frames HTTP/1.1 bodies
            head = b"".join(enc.chunk(i, "", None, role=True) for i in range(len(reqs))) if chat else b""
            await resp.write(head + sink.take())
            while not sink.finished or sink.buf:
                if not sink.finished:
                    sink.attach(request.transport, chunked)
                await sink.wait()
                data = sink.take()
                if data:
                    await resp.write(data)
            if sink.gone:
                raise ClientGone(resp)
            sink.transport = None
            tail = []
            if params.include_usage:
                tail.append(enc.event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                       "created": enc.created, "model": params.model, "choices": [],
                                       "usage": self._usage(params, reqs)}))
            tail.append(b"data: [DONE]\n\n")
            await resp.write(b"".join(tail))
            await resp.write_eof()
        except ConnectionResetError:
            log.debug("client of %s went away; cancelling its requests", rid)
            raise ClientGone(resp) from None
        return resp

    def _model_card(self, name: str) -> dict | None:
        if name == self.model_name:
            return {"id": name, "object": "model", "created": self.created, "owned_by": "lorafleet",
                    "root": name, "parent": None, "status": "available"}
        e = self.registry.get(name)
        if e is None:
            return None
        card = {"id": e.name, "object": "model", "created": int(e.created), "owned_by": "lorafleet",
                "root": e.name, "parent": self.model_name, "status": "available"}
        why = self.availability.listed_reason(e.name)
        if why is not None:
            card.update(status="unavailable", reason=f"adapter {e.name!r} cannot be served: {why}")
        return card

    async def _token_body(self, request: web.Request, fields: set[str]) -> dict:
        """The body of a tokenize / detokenize call (parsed in the tokenizer pool, as a completion's is: an 8 MB body
        is seconds of work): its key checked, `model` one the key may use, no field but `model` and `fields`."""
        grant = self._authenticate(request)
        raw = await read_body(request)
        body = await asyncio.get_running_loop().run_in_executor(self.prompts.pool, parse_body, raw)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise oa.bad("model", "model must be a non-empty string naming the base model or an adapter")
        self._resolve_model(model, grant)
        unknown = sorted(set(body) - fields - {"model"})
        if unknown:
            raise oa.bad(oa.shown_name(unknown[0]), f"unrecognized argument(s): {oa.shown_names(unknown)}")
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        """`POST /v1/tokenize` (also `/tokenize`, vLLM's path): a prompt's token ids as a completion request would
        send them, or a chat's as its template renders them (`messages`, with `add_generation_prompt`, default true,
        and `chat_template_kwargs`), with their count and the model's context length. `model` names the base model
        or an adapter (all share the tokenizer); the API key must allow it."""
        body = await self._token_body(request, {"prompt", "messages", "add_generation_prompt", "chat_template_kwargs",
                                                "add_special_tokens"})
        if ("prompt" in body) == ("messages" in body):
            raise oa.bad("prompt", "give either `prompt` (a string) or `messages` (a chat)")
        for key in ("add_generation_prompt", "add_special_tokens"):
            if not isinstance(body.get(key, True), bool):
                raise oa.bad(key, f"{key} must be a boolean")
        if "messages" in body:
            msgs = await asyncio.get_running_loop().run_in_executor(self.prompts.pool, oa.parse_messages, body)
            ids = await self.prompts.chat_ids(msgs, bool(body.get("add_generation_prompt", True)))
        else:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise oa.bad("prompt", "prompt must be a string")
            ids = await self.prompts.text_ids(prompt, bool(body.get("add_special_tokens", True)))
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids})

    async def detokenize(self, request: web.Request) -> web.Response:
        """`POST /v1/detokenize` (also `/detokenize`): token ids back to text (special tokens dropped, as in
        completions' text)."""
        body = await self._token_body(request, {"tokens"})
        ids = body.get("tokens")
        if isinstance(ids, list) and len(ids) > self.max_model_len * 4:  # (before a walk over millions of items)
            raise oa.bad("tokens", f"at most {self.max_model_len * 4} tokens at once")
        ids = oa._integral_ids(ids)
        vocab = self.tok.vocab_size
        if not isinstance(ids, list) or not all(oa._is_int(t) and 0 <= t < vocab for t in ids):
            raise oa.bad("tokens", f"tokens must be a list of token ids in [0, {vocab})")
        text = await asyncio.get_running_loop().run_in_executor(self.prompts.pool, self.tok.decode, ids)
        return web.json_response({"prompt": text})

    async def models(self, request: web.Request) -> web.Response:
        grant = self._authenticate(request)
        names = [self.model_name] + [n for n in self.registry.names() if n != self.model_name]
        data = [self._model_card(n) for n in names if grant.allows(n)]
        return web.json_response({"object": "list", "data": [d for d in data if d is not None]})

    async def model(self, request: web.Request) -> web.Response:
        grant = self._authenticate(request)
        name = request.match_info["model_id"]
        card = self._model_card(name) if grant.allows(name) else None
        if card is None:
            raise self._not_found(name)
        return web.json_response(card)

    async def openapi(self, request: web.Request) -> web.Response:
        from lorafleet.scheduler.openapi import document

        auth = self.api_keys is not None  # with keys, adapter names are not shown to anyone
        return web.json_response(document(self.model_name, self.limits, [] if auth else self.registry.names(), auth,
                                          vocab_size=self.tok.vocab_size))

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
        if not hmac.compare_digest(got.encode("utf-8", "surrogateescape"),
                                   f"Bearer {self.admin_token}".encode("utf-8", "surrogateescape")):
            raise ApiError(401, "missing or wrong bearer token", type_="authentication_error", code="unauthorized")

    async def admin_state(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return web.json_response(self.cluster.admin_state())

    async def admin_drain(self, request: web.Request) -> web.Response:
        self._authorize(request)
        rid = request.match_info["runner_id"]
        r = self.cluster.set_draining(rid, request.path.endswith("/drain"))
        if r is None:
            raise ApiError(404, f"no runner {rid!r}", code="runner_not_found")
        log.info("runner %s %s", rid, "draining" if r.draining else "back in service")
        return web.json_response({"id": rid, "draining": r.draining, "batch_size": len(r.assigned),
                                  "empty": not r.assigned})

    async def admin_validate(self, request: web.Request) -> web.Response:
        self._authorize(request)
        body = await asyncio.get_running_loop().run_in_executor(self.prompts.pool, parse_body, await read_body(request))
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
    quiet_client_protocol_errors()
    app = web.Application(client_max_size=MAX_BODY, middlewares=[errors_middleware(service.metrics, MAX_BODY)])
    app.router.add_post("/v1/completions", service.completions)
    app.router.add_post("/v1/chat/completions", service.chat_completions)
    app.router.add_get("/v1/models", service.models)
    for prefix in ("/v1", ""):  # (/v1: through the Ingress, which routes only /v1; the bare paths are vLLM's)
        app.router.add_post(f"{prefix}/tokenize", service.tokenize)
        app.router.add_post(f"{prefix}/detokenize", service.detokenize)
    app.router.add_get("/v1/models/{model_id:.+}", service.model)
    app.router.add_get("/openapi.json", service.openapi)
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


def model_config(model_dir: Path) -> dict:
    """The model directory's config.json ({} without one); StartupError for one that is not a readable JSON object
    (the context length and the model's name would silently be guessed)."""
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        return {}
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StartupError(f"{cfg} is not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise StartupError(f"{cfg} must hold a JSON object, found {type(data).__name__}")
    return data


def model_limits(model_dir: Path) -> int:
    """The context length: config.json's max_position_embeddings (4096 without it)."""
    n = model_config(model_dir).get("max_position_embeddings", 4096)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise StartupError(f"{model_dir / 'config.json'}: max_position_embeddings must be a positive whole number, "
                           f"found {n!r}")
    return n


def model_display_name(model_dir: Path) -> str:
    """The base model's API name: config.json's `_name_or_path` (last part), else the folder name (for a
    Hugging Face cache snapshot, `.../models--ORG--NAME/snapshots/HASH`, NAME rather than the hash)."""
    name = model_config(model_dir).get("_name_or_path")
    if isinstance(name, str) and name.strip("/"):
        return name.rstrip("/").rsplit("/", 1)[-1]
    if model_dir.is_file():
        return model_dir.stem
    parts = model_dir.resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].split("--")[-1]
    return model_dir.name


def parse_runner(spec: str, i: int) -> RunnerEndpoint:
    """`id=url` or `url` (id runner-i)."""
    if "=" in spec:
        rid, url = spec.split("=", 1)
        return RunnerEndpoint(rid, url)
    return RunnerEndpoint(f"runner-{i}", spec)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="base model directory (tokenizer + config) or source URI")
    p.add_argument("--model-name", default=None,
                   help="the base model's name in the API (default: the last part of config.json's _name_or_path; "
                        "without one, NAME for a Hugging Face cache snapshot of ORG/NAME, else the folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address the OpenAI API listens on")
    p.add_argument("--port", type=cli_args.port, default=8000, help="port the OpenAI API listens on")
    p.add_argument("--adapters", type=Path, default=None,
                   help="directory with one adapter per subfolder (default: none, or the LoraAdapters with --kube)")
    add_adapter_rescan_argument(p)
    p.add_argument("--runner", action="append", default=[],
                   help="runner endpoint, `id=url` or `url` (repeat; default: none, or the pool's pods with --kube)")
    p.add_argument("--max-queue", type=int, default=1024, help="queued requests before 429")
    p.add_argument("--queue-timeout", type=float, default=120.0, help="seconds a request may wait with no runner")
    p.add_argument("--grace-seconds", type=_grace_seconds, default=30.0, metavar="SECONDS",
                   help="on SIGTERM: stop taking requests, give those in flight this long to finish, then end them "
                        "with an error (default: 30; keep it under the pod's termination grace period)")
    p.add_argument("--kube", action="store_true", help="learn adapters and runners from the Kubernetes API")
    p.add_argument("--namespace", default=None,
                   help="the pool's namespace (needed with --kube; default: none)")
    p.add_argument("--pool", default=None, help="the ServingPool's name (needed with --kube; default: none)")
    add_api_key_argument(p)
    add_placement_argument(p)
    limits_mod.add_arguments(p)


# aiohttp's wait for handlers still running after SchedulerService.stop (which already gave requests the grace
# period and ended the rest): a handler still writing to a slow reader. aiohttp may wait twice this long.
SHUTDOWN_BACKSTOP_S = 5.0


def _grace_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be 0 to 3600 seconds, got {text}")
    return value


def add_adapter_rescan_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter-rescan", type=cli_args.non_negative_float, default=5.0, metavar="SECONDS",
                   help="with --adapters: look at the directory again every SECONDS, so adapters added, changed or "
                        "removed there are served, read again or dropped without a restart (0: never; default: 5)")


def watch_adapters(app: web.Application, registry: AdapterRegistry, root: Path | None, interval: float,
                   model_name: str) -> None:
    """Rescan an adapter directory in the background while `app` runs (registry.DirectoryFeed); a folder named as
    the base model is never published (requests for that name reach the base model)."""
    if root is None or interval <= 0:
        return
    feed = DirectoryFeed(registry, root, interval, skip=frozenset({model_name}))

    async def start(app):
        app["adapter_feed"] = asyncio.create_task(feed.run())

    async def stop(app):
        app["adapter_feed"].cancel()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)


def add_placement_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--placement", choices=sorted(POLICIES), default="busiest",
                   help="busiest: the fitting runner with the largest batch (Punica), a runner likely to hold the "
                        "request's prefix counting as busier (--prefix-affinity-tokens; default); busiest-no-prefix: "
                        "the same, ignoring prefixes; least-loaded: the smallest batch; round-robin")


def add_api_key_argument(p: argparse.ArgumentParser) -> None:
    default = env.api_keys_file()
    p.add_argument("--api-keys", type=Path, default=default, metavar="FILE",
                   help="require API keys on /v1: one key per line, optionally followed by the models it may use "
                        "(comma-separated) and cache_group=NAME; default: env LORAFLEET_API_KEYS_FILE"
                        + (f" (now {default})" if default else ", unset: no keys"))
    p.add_argument("--cache-salt-per-key", action="store_true",
                   help="salt the prefix cache of every API key's requests with that key (keys with a cache_group "
                        "share their group's), so tenants cannot learn each other's prompts from cache timing; "
                        "needs --api-keys (default: off, the cache is shared unless a request sends cache_salt)")


def load_api_keys(args: argparse.Namespace) -> ApiKeys | None:
    per_key = bool(getattr(args, "cache_salt_per_key", False))
    if per_key and not args.api_keys:
        raise ApiKeyFileError("--cache-salt-per-key needs API keys (--api-keys FILE or LORAFLEET_API_KEYS_FILE)")
    return ApiKeys(args.api_keys, salt_per_key=per_key) if args.api_keys else None


class StartupError(ValueError):
    """A model or adapter folder the scheduler cannot start with; the message says why in one line."""


MODEL_HINT = "give the base model's directory, with its tokenizer.json, or a model source URI"


def load_tokenizer(model_dir: Path) -> Tokenizer:
    if not model_dir.exists():
        raise StartupError(f"model path {model_dir} does not exist ({MODEL_HINT})")
    if not model_dir.is_dir():
        raise StartupError(f"model path {model_dir} is not a directory ({MODEL_HINT})")
    try:
        return Tokenizer(model_dir)
    except (OSError, ValueError) as exc:
        raise StartupError(f"the API needs the model's tokenizer: {exc}") from None


def build_service(args: argparse.Namespace) -> SchedulerService:
    if getattr(args, "kube", False) and args.adapters:  # two feeds of one registry would remove each other's
        raise StartupError("give --adapters DIR or --kube (the pool's LoraAdapters), not both")
    api_keys = load_api_keys(args)
    model = args.model
    if "://" in model:
        from lorafleet.common.sources import fetch_model

        model = str(fetch_model(model, cache_dir=env.cache_dir() / "models", tokenizer_only=True))
    model_dir = Path(model)
    tokenizer = load_tokenizer(model_dir)
    try:
        registry = AdapterRegistry.from_directory(args.adapters) if args.adapters else AdapterRegistry()
    except FileNotFoundError as exc:
        raise StartupError(str(exc)) from None
    directory = RunnerDirectory([parse_runner(s, i) for i, s in enumerate(args.runner)])
    return SchedulerService(
        tokenizer, args.model_name or model_display_name(model_dir), registry, directory,
        limits=limits_mod.from_args(args, model_limits(model_dir)), api_keys=api_keys, max_queue=args.max_queue,
        queue_timeout=args.queue_timeout, admin_token=env.admin_token(), placement=args.placement,
        runner_token=env.runner_token(), grace_seconds=args.grace_seconds,
    )


def run(args: argparse.Namespace) -> int:
    from lorafleet.scheduler.api_keys import ApiKeyFileError
    from lorafleet.scheduler.listen import ListenError, bind

    try:
        sock = bind(args.host, args.port)
        service = build_service(args)
    except (ListenError, ApiKeyFileError, StartupError) as exc:
        log.error("%s", exc)
        return 2
    app = create_app(service)
    watch_adapters(app, service.registry, args.adapters, args.adapter_rescan, service.model_name)
    if args.kube:
        if not (args.namespace and args.pool):
            raise SystemExit("--kube needs --namespace and --pool")

        async def feeds(app):
            from lorafleet.scheduler.kube import run_kube_feeds

            app["kube"] = asyncio.create_task(run_kube_feeds(service.registry, service.directory,
                                                             namespace=args.namespace, pool=args.pool))

        app.on_startup.append(feeds)
    log.info("scheduler for %s on http://%s:%d", service.model_name, args.host, args.port)
    web.run_app(app, sock=sock, print=None, shutdown_timeout=SHUTDOWN_BACKSTOP_S)
    return 0

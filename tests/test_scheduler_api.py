"""OpenAI API of the scheduler against scripted runners: shapes, every error case, admin auth."""

from __future__ import annotations

import asyncio
import json

import pytest
from api_helpers import TOKEN, start, stop
from fake_runner import FakeRunner



@pytest.fixture
async def api(tok):
    fr = FakeRunner()
    client, service, servers = await start(tok, [fr])
    yield client, service, fr
    await stop(client, servers)


async def test_completion_and_chat_shapes(api):
    client, _, fr = api
    r = await client.post("/v1/completions", json={"model": "pirate", "prompt": "Hello", "max_tokens": 4})
    body = await r.json()
    assert r.status == 200 and body["object"] == "text_completion" and body["model"] == "pirate"
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 4
    assert fr.seen[-1]["adapter"]["name"] == "pirate"
    r = await client.post("/v1/chat/completions", json={"model": "base", "messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 3, "n": 2, "seed": 1})
    body = await r.json()
    assert body["object"] == "chat.completion" and len(body["choices"]) == 2
    assert body["choices"][1]["message"]["role"] == "assistant" and fr.seen[-1]["adapter"] is None
    m = await (await client.get("/v1/models")).json()
    assert m["object"] == "list"
    assert [(d["id"], d["parent"]) for d in m["data"]] == [("base", None), ("pirate", "base"), ("shouty", "base")]


async def test_streaming_sse(api):
    client, _, _ = api
    r = await client.post("/v1/chat/completions", json={"model": "shouty", "messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 5, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = [ln[6:] for ln in (await r.text()).split("\n\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


BAD = [
    ({"prompt": "x"}, 400, "model"),
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": "base", "prompt": ""}, 400, "prompt"),
    ({"model": "base", "prompt": []}, 400, "prompt"),
    ({"model": "base", "prompt": [1, 99999999]}, 400, "prompt"),
    ({"model": "base", "prompt": 5}, 400, "prompt"),
    ({"model": "base", "prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ({"model": "base", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "base", "prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    ({"model": "base", "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ({"model": "base", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "base", "prompt": "x", "temperature": 1e308 * 10}, 400, "temperature"),
    ({"model": "base", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "base", "prompt": "x", "n": 1000}, 400, "n"),
    ({"model": "base", "prompt": "x", "seed": 2**70}, 400, "seed"),
    ({"model": "base", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": "base", "prompt": "x", "stop": ""}, 400, "stop"),  # as [""]: not a silent "no stop"
    ({"model": "base", "prompt": "x", "stop": ["ok", "y" * 4097]}, 400, "stop"),  # a stream would hold back all text
    ({"model": "base", "prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),  # past the vocabulary:
    ({"model": "base", "prompt": "x", "stop_token_ids": [3, -1]}, 400, "stop_token_ids"),  # not the runner's 500
    ({"model": "base", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": "base", "prompt": "x", "logprobs": 21}, 400, "logprobs"),  # at most 20 alternatives
    ({"model": "base", "prompt": "x", "logprobs": True}, 400, "logprobs"),  # completions: a number
    ({"model": "base", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),  # OpenAI's [-2, 2]
    ({"model": "base", "prompt": "x", "echo": "yes"}, 400, "echo"),
    ({"model": "base", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ({"model": "base", "prompt": "x", "max_tokens": 256}, 400, "max_tokens"),
    ({"model": "base", "prompt": "x", "max_token": 5}, 400, "max_token"),  # misspelt: not the default instead
    ({"model": "base", "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),  # must be > 0
    ({"model": "base", "prompt": "x", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    ({"model": "base", "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": "base", "prompt": "x", "logit_bias": {"-5": 1}}, 400, "logit_bias"),
    ({"model": "base", "prompt": "x", "logit_bias": {str(10**8): 1}}, 400, "logit_bias"),  # past the vocabulary
    ({"model": "base", "prompt": "x", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),  # (int() refuses it)
    ({"model": "base", "prompt": "x", "logit_bias": {"7": 1, "07": 2}}, 400, "logit_bias"),  # one token twice: not the runner's 500
    ({"model": "base", "prompt": "x", "skip_special_tokens": 1}, 400, "skip_special_tokens"),
    ({"model": "base", "prompt": "x", "parallel_tool_calls": True}, 400, "parallel_tool_calls"),
    # the unset or neutral value itself only, not a falsy or equal-comparing one of another type (taken as unset)
    ({"model": "base", "prompt": "x", "stop_token_ids": 0}, 400, "stop_token_ids"),
    ({"model": "base", "prompt": "x", "stop_token_ids": {}}, 400, "stop_token_ids"),
    ({"model": "base", "prompt": "x", "best_of": True}, 400, "best_of"),
    ({"model": "base", "prompt": "x", "suffix": 0}, 400, "suffix"),
    ({"model": "base", "prompt": "x", "suffix": []}, 400, "suffix"),
    ({"model": "base", "prompt": "x", "tools": 0}, 400, "tools"),
    ({"model": "base", "prompt": "x", "tool_choice": 0.0}, 400, "tool_choice"),
    ({"model": "base", "prompt": "x", "messages": []}, 400, "messages"),  # a chat field on the completions route
]


@pytest.mark.parametrize("body,status,param", BAD)
async def test_completion_errors(api, body, status, param):
    client, _, _ = api
    r = await client.post("/v1/completions", json=body)
    err = (await r.json())["error"]
    assert r.status == status and err["param"] == param and err["message"], err


async def test_unrecognized_fields_are_named_and_harmless_openai_fields_pass(api):
    client, _, fr = api
    msgs = [{"role": "user", "content": "Hi"}]
    r = await client.post("/v1/chat/completions", json={"model": "base", "messages": msgs, "max_tokens": 2,
                                                         "temprature": 0, "bogus": 1})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "bogus" and "'temprature'" in err["message"], err
    seen = len(fr.seen)
    for route, body in (("/v1/chat/completions", {"messages": msgs}), ("/v1/completions", {"prompt": "Hi"})):
        r = await client.post(route, json={"model": "base", "max_tokens": 2, "user": "u1", "metadata": {"k": "v"},
                                           "store": False, "service_tier": "auto", **body})
        assert r.status == 200, await r.text()
    assert len(fr.seen) == seen + 2


@pytest.mark.parametrize("body,param", [
    ({"model": "base", "messages": []}, "messages"),
    ({"model": "base", "messages": "hi"}, "messages"),
    ({"model": "base", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "base", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "base", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"model": "base", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
    ({"model": "base", "messages": [{"role": "user", "content": "x"}], "prompt": "x"}, "prompt"),
])
async def test_chat_errors(api, body, param):
    client, _, _ = api
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status == 400 and (await r.json())["error"]["param"] == param


async def test_malformed_and_oversized_bodies(api):
    client, _, _ = api
    for data in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = await client.post("/v1/completions", data=data, headers={"Content-Type": "application/json"})
        assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
    r = await client.post("/v1/completions", data=b'{"model": "base", "prompt": "' + b"a" * (9 << 20) + b'"}',
                          headers={"Content-Type": "application/json"})
    assert r.status == 413
    r = await client.post("/v1/completions", json={"model": "base", "prompt": "word " * 400})
    err = (await r.json())["error"]
    assert r.status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt"


async def test_queue_full_429_and_no_runner_503(tok):
    fr = FakeRunner(max_batch_size=1, delay=0.05)
    client, service, servers = await start(tok, [fr], max_queue=1)
    try:
        body = {"model": "base", "prompt": "x", "max_tokens": 20}
        first = asyncio.create_task(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(client.post("/v1/completions", json=body))  # queued
        await asyncio.sleep(0.1)
        r = await client.post("/v1/completions", json=body)
        assert r.status == 429 and "Retry-After" in r.headers
        assert (await r.json())["error"]["code"] == "queue_full"
        assert (await first).status == 200 and (await second).status == 200
    finally:
        await stop(client, servers)
    client, service, servers = await start(tok, [])
    try:
        r = await client.post("/v1/completions", json={"model": "base", "prompt": "x"})
        assert r.status == 503 and "Retry-After" in r.headers
        assert (await client.get("/readyz")).status == 503
    finally:
        await stop(client, servers)


async def test_stop_string_cancels_runner_request(api, tok):
    client, _, fr = api
    ids = FakeRunner().tokens({"sampling": {"max_tokens": 30}, "prompt_token_ids": tok.encode("Hello")})
    full = tok.decode(ids)
    stop = full[10:14]
    r = await client.post("/v1/completions", json={"model": "base", "prompt": "Hello", "max_tokens": 30, "stop": stop})
    body = await r.json()
    assert body["choices"][0]["text"] == full[: full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_admin_requires_token(tok):
    fr = FakeRunner()
    client, _, servers = await start(tok, [fr], admin_token=None)
    try:
        assert (await client.get("/admin/state")).status == 403
    finally:
        await stop(client, servers)
    client, _, servers = await start(tok, [fr])
    try:
        assert (await client.get("/admin/state")).status == 401
        assert (await client.get("/admin/state", headers={"Authorization": "Bearer wrong"})).status == 401
        st = await (await client.get("/admin/state", headers={"Authorization": f"Bearer {TOKEN}"})).json()
        assert st["queue_length"] == 0 and st["runners"][0]["id"] == "fake-0"
        assert set(st["runners"][0]) >= {"id", "url", "healthy", "draining", "batch_size", "max_batch_size",
                                         "free_kv_tokens", "total_kv_tokens", "idle_seconds", "adapters"}
    finally:
        await stop(client, servers)


@pytest.mark.parametrize("chat", [False, True])
def test_chunk_encoder_bytes_are_the_chunk_json(chat):
    from lorafleet.scheduler import openai_api as oa

    enc = oa.ChunkEncoder("cmpl-1", 'mo"del', chat, created=7)
    for text in ["hi", ' "quoted"\n', "日本語 \u2028"]:
        line = enc.text(3, text)
        assert line.startswith(b"data: ") and line.endswith(b"\n\n")
        want = oa.chunk("cmpl-1", 'mo"del', chat, 3, text, None)
        want["created"] = 7
        assert json.loads(line[6:]) == want
        compact = json.dumps(json.loads(line[6:]), ensure_ascii=False, separators=(",", ":")).encode()
        assert line[6:-2] == compact  # (the text chunks' bytes)
    # the role, finish and logprob chunks are as compact as the text chunks: one stream, one spelling
    for line in (enc.chunk(0, None, None, role=True), enc.chunk(0, None, "stop"),
                 enc.text(0, "x", logprobs={"content": [{"token": "x", "logprob": -0.5}]})):
        body = json.loads(line[6:])
        assert line == b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def test_a_runners_refusal_is_the_clients_400(tok):
    """A request the runner's own validation refuses (a 400 from its submit) is answered 400 with the runner's reason,
    not 500, and the runner keeps serving."""
    from aiohttp import web

    class Refusing(FakeRunner):
        async def generate(self, request):
            body = await request.json()
            if body["sampling"]["max_tokens"] == 7:
                return web.json_response({"error": "sampling: a check only the runner makes"}, status=400)
            return await super().generate(request)

    fr = Refusing()
    client, _, servers = await start(tok, [fr])
    try:
        r = await client.post("/v1/completions", json={"model": "pirate", "prompt": "Hello", "max_tokens": 7})
        err = (await r.json())["error"]
        assert r.status == 400 and err["code"] == "invalid_request", err
        assert err["type"] == "invalid_request_error" and "a check only the runner makes" in err["message"], err
        r = await client.post("/v1/completions", json={"model": "pirate", "prompt": "Hello", "max_tokens": 4})
        assert r.status == 200, await r.text()
    finally:
        await stop(client, servers)


async def test_a_request_only_an_empty_runner_can_start_waits_for_it_not_forever(tok):
    """A runner of 256 KV tokens and a prompt of 220 with max_tokens 50: placement holds a request's tokens plus the
    first 64 of its completion, more than the runner has, so it once waited at the queue's head for room that never
    came, with every request behind it. Its need is capped at the largest runner: it runs (a real runner ends it at
    its KV limit with finish_reason length), and so does the request behind it; a request without max_tokens gets a
    default completion that KV cache can hold."""
    fr = FakeRunner(total_kv=256)
    client, _, servers = await start(tok, [fr], max_model_len=1024)  # the context is not what limits it
    try:
        prompt = [5] * 220
        big = client.post("/v1/completions", json={"model": "pirate", "prompt": prompt, "max_tokens": 50})
        small = client.post("/v1/completions", json={"model": "pirate", "prompt": "Hello", "max_tokens": 4})
        r_big, r_small = await asyncio.wait_for(asyncio.gather(big, small), 20)
        assert r_big.status == 200 and r_small.status == 200, (await r_big.text(), await r_small.text())
        r = await client.post("/v1/completions", json={"model": "pirate", "prompt": prompt})
        body = await r.json()
        assert r.status == 200 and body["usage"]["completion_tokens"] <= 256 - 220, body
    finally:
        await stop(client, servers)

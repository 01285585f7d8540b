"""`/v1/tokenize` and `/v1/detokenize` (also at vLLM's bare paths): the ids a completion or chat request would
send, counted against the context; the API key's model list applies."""

from __future__ import annotations

import pytest


@pytest.fixture
def api(fake_api):
    return fake_api.client, fake_api.service, fake_api.runner, fake_api.tok


async def test_tokenize_gives_the_ids_a_request_would_send(api):
    client, service, fr, tok = api
    for path in ("/v1/tokenize", "/tokenize"):
        r = await client.post(path, json={"model": "pirate", "prompt": "Hello there"})
        body = await r.json()
        assert r.status == 200 and body["tokens"] == tok.encode("Hello there") and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == service.max_model_len
    msgs = [{"role": "user", "content": "Hi"}]
    r = await client.post("/v1/tokenize", json={"model": "base", "messages": msgs})
    ids = (await r.json())["tokens"]
    await client.post("/v1/chat/completions", json={"model": "base", "messages": msgs, "max_tokens": 1})
    assert ids == fr.seen[-1]["prompt_token_ids"]  # what the chat request sent its runner
    r = await client.post("/v1/tokenize", json={"model": "base", "messages": msgs, "add_generation_prompt": False})
    assert len((await r.json())["tokens"]) < len(ids)
    r = await client.post("/v1/tokenize", json={"model": "base", "prompt": "Hi", "add_special_tokens": False})
    assert (await r.json())["tokens"] == tok.encode("Hi", add_special_tokens=False)


async def test_detokenize_inverts_tokenize(api):
    client, _, _, tok = api
    ids = tok.encode("The quick brown fox", add_special_tokens=False)
    r = await client.post("/detokenize", json={"model": "base", "tokens": ids})
    assert r.status == 200 and (await r.json())["prompt"] == "The quick brown fox"


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/tokenize", {"prompt": "x"}, 400, "model"),
    ("/v1/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/tokenize", {"model": "base"}, 400, "prompt"),
    ("/v1/tokenize", {"model": "base", "prompt": "x", "messages": []}, 400, "prompt"),
    ("/v1/tokenize", {"model": "base", "prompt": 5}, 400, "prompt"),
    ("/v1/tokenize", {"model": "base", "prompt": "x", "bogus": 1}, 400, "bogus"),
    ("/v1/tokenize", {"model": "base", "messages": "hi"}, 400, "messages"),
    ("/v1/tokenize", {"model": "base", "prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/v1/detokenize", {"model": "base", "tokens": [1, -1]}, 400, "tokens"),
    ("/v1/detokenize", {"model": "base", "tokens": [10**9]}, 400, "tokens"),
    ("/v1/detokenize", {"model": "base", "tokens": "abc"}, 400, "tokens"),
])
async def test_bad_tokenize_requests_name_the_field(api, path, body, status, param):
    client = api[0]
    r = await client.post(path, json=body)
    err = (await r.json())["error"]
    assert r.status == status and err["param"] == param, err


async def test_tokenize_bodies_are_parsed_off_the_event_loop(api, monkeypatch):
    """An 8 MB body is seconds of parsing (a 4-million-id detokenize call held the event loop, and every other
    client's stream, for about 3 s): tokenize and detokenize parse theirs, and tokenize its messages, in the
    tokenizer pool as completions do, and a token list over the bound is refused before its items are walked."""
    import threading

    from lorafleet.scheduler import openai_api, server

    client, service, _, _ = api
    threads = []

    def recorded(fn):
        def call(*args):
            threads.append(threading.current_thread().name)
            return fn(*args)
        return call

    monkeypatch.setattr(server, "parse_body", recorded(server.parse_body))
    monkeypatch.setattr(openai_api, "parse_messages", recorded(openai_api.parse_messages))
    for path, body in (("/v1/tokenize", {"model": "base", "prompt": "Hi"}),
                       ("/v1/tokenize", {"model": "base", "messages": [{"role": "user", "content": "Hi"}]}),
                       ("/detokenize", {"model": "base", "tokens": [5, 6]})):
        assert (await client.post(path, json=body)).status == 200, path
    assert len(threads) == 4 and all(name.startswith("tokenize") for name in threads), threads
    most = service.max_model_len * 4
    r = await client.post("/v1/detokenize", json={"model": "base", "tokens": [0.5] * (most + 1)})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "tokens" and f"at most {most} tokens" in err["message"], err

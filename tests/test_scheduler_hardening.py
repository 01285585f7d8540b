"""Hostile and unlucky input to the scheduler: always a JSON 4xx naming the problem, never a
5xx or a stalled event loop; budgets; OpenAI routes and conventions; metrics."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from api_helpers import start, stop
from fake_runner import FakeRunner
from lorafleet.scheduler.limits import RequestLimits

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def api(tok):
    fr = FakeRunner()
    client, service, servers = await start(tok, [fr])
    yield client, service, fr
    await stop(client, servers)


def raw(obj) -> bytes:
    return json.dumps(obj).encode()  # keeps lone surrogates as \ud800 escapes, as a hostile client sends them


async def post(client, path, data: bytes):
    r = await client.post(path, data=data, headers={"Content-Type": "application/json"})
    return r.status, await r.json()


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "base", "prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"model": "base", "prompt": ["ok", "\udfff"]}, "prompt[1]"),
    ("/v1/completions", {"model": "base", "prompt": "x", "stop": ["\ud83d"]}, "stop[0]"),
    ("/v1/completions", {"model": "ba\udc00se", "prompt": "x"}, "model"),
    ("/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": "hi \ud800"}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"model": "base", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "\ud800"}]}]}, "messages[0].content[0].text"),
])
async def test_lone_surrogates_are_a_400_naming_the_field(api, path, body, param):
    client, _, fr = api
    status, got = await post(client, path, raw(body))
    assert status == 400 and got["error"]["param"] == param and got["error"]["code"] == "invalid_unicode", got
    assert not fr.seen


async def test_deeply_nested_and_odd_json_are_400(api):
    client, service, _ = api
    deep = b'{"model": "base", "prompt": "x", "extra": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    deeper = b"[" * 100_000 + b"]" * 100_000
    for data in (deep, deeper, b'{"a": ' * 5000 + b"1" + b"}" * 5000):
        status, got = await post(client, "/v1/completions", data)
        assert status == 400 and "nested deeper" in got["error"]["message"], got
    odd = [
        {"model": "base", "prompt": "x", "n": 1.5}, {"model": "base", "prompt": "x", "stop": [1]},
        {"model": "base", "prompt": [[1, 2], "x"]}, {"model": "base", "prompt": [True]},
        {"model": "base", "prompt": "x", "stream_options": {"include_usage": 1}, "stream": True},
        {"model": "base", "prompt": "x", "top_k": "3"}, {"model": "base", "prompt": "x", "seed": 1.5},
        {"model": ["base"], "prompt": "x"}, {"model": "base", "prompt": {"text": "x"}},
        {"model": "base", "messages": [{"role": "user", "content": None}]},
        {"model": "base", "prompt": "x", "max_tokens": 1e400},
    ]
    for body in odd:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, got = await post(client, path, json.dumps(body).encode() if body.get("max_tokens") != 1e400 else
                                 b'{"model": "base", "prompt": "x", "max_tokens": 1e400}')
        assert status == 400 and got["error"]["type"] == "invalid_request_error", (body, got)
    big_int = b'{"model": "base", "prompt": "x", "seed": 1' + b"0" * 5000 + b"}"
    status, _ = await post(client, "/v1/completions", big_int)
    assert status == 400
    assert service.metrics.unhandled_errors._value.get() == 0


async def test_the_path_of_a_refused_node_cuts_the_keys_it_repeats(api):
    """The field a body error names is a path of the client's own keys: each is cut to 40 characters, as an unknown
    field's name is, so that a key of megabytes does not come back (twice: in param and message)."""
    client, _, fr = api
    long = "k" * 40 + "x" * 500_000
    deep = [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
    for extra, param, code in (({long: ["ok", "\ud800"]}, "k" * 40 + "[1]", "invalid_unicode"),
                               ({"a": {long: {"b": deep}}}, "a." + "k" * 40 + ".b" + "[0]" * 29, "invalid_json")):
        status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": "x", **extra}))
        assert status == 400 and got["error"]["code"] == code and got["error"]["param"] == param, str(got)[:300]
        assert len(got["error"]["message"]) < 300
    assert not fr.seen


@pytest.mark.parametrize("path, data, param", [
    ("/v1/completions", b'{"model": "base", "prompt": "x", "max_tokens": 2, "max_tokens": 200}', "max_tokens"),
    ("/v1/completions", b'{"model": "nope", "prompt": "x", "model": "base"}', "model"),
    ("/v1/chat/completions", b'{"model": "base", "messages": [{"role": "user", "content": "a"}, '
                             b'{"role": "user", "content": "b", "role": "system"}]}', "messages[1].role"),
    ("/v1/chat/completions", b'{"model": "base", "messages": [{"role": "user", "content": "a"}], '
                             b'"chat_template_kwargs": {"x": {"y": 1, "z": 2, "y": 1}}}', "chat_template_kwargs.x.y"),
    ("/v1/tokenize", b'{"model": "base", "prompt": "a", "prompt": "b"}', "prompt"),
    ("/v1/detokenize", b'{"model": "base", "tokens": [1], "tokens": [2]}', "tokens"),
    ("/v1/completions", b'{"model": "base", "prompt": "x", "' + b"k" * 100_000 + b'": 1, "' + b"k" * 100_000 + b'": 2}',
     "k" * 40),
])
async def test_a_key_given_twice_in_one_object_is_a_400_naming_it(api, path, data, param):
    """A JSON object that gives a key twice (at the top of a body or inside it): a 400 naming the key by its path,
    not the last value taken silently (which a proxy in front might read differently: the first)."""
    client, _, fr = api
    status, got = await post(client, path, data)
    assert status == 400 and got["error"]["code"] == "invalid_json" and got["error"]["param"] == param, got
    assert got["error"]["message"] == f"{param} is given more than once (a key may appear once in a JSON object)"
    assert not fr.seen


async def test_the_same_key_in_different_objects_is_served(api):
    client, _, fr = api
    status, got = await post(client, "/v1/chat/completions", raw({**CHAT, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}))
    assert status == 200 and len(fr.seen) == 1, got


def test_the_body_walk_names_only_the_node_it_refuses(monkeypatch):
    """check_tree visits every node of a body (an 8 MB one holds millions: `"prompt": [[0]] * 2_000_000`) but
    builds the path that names a field only for the node it refuses: building one for every node took seconds."""
    from lorafleet.scheduler import bodies
    from lorafleet.scheduler.openai_api import ApiError

    built = []
    real = bodies._path
    monkeypatch.setattr(bodies, "_path", lambda parent, key: built.append(key) or real(parent, key))
    bodies.check_tree({"model": "base", "prompt": [[0]] * 100_000, "stop": ["a", "b"], "x": {"y": "é"}})
    assert built == []
    with pytest.raises(ApiError) as refused:
        bodies.check_tree({"model": "base", "prompt": [[0]] * 100_000 + [["ok", {"t": "a\ud800"}]]})
    assert refused.value.param == "prompt[100000][1].t" and refused.value.code == "invalid_unicode"
    assert built == ["prompt", 100_000, 1, "t"]
    built.clear()
    with pytest.raises(ApiError) as refused:
        bodies.check_tree({"a": [[0]] * 1000 + [[[[]]]]}, max_depth=3)
    assert refused.value.param == "a[1000][0]" and "nested deeper than 3" in refused.value.message
    assert len(built) == 3


def test_a_body_is_parsed_with_the_garbage_collector_paused(monkeypatch):
    """json.loads holds the GIL until it returns: with the cyclic collector on, a body of millions of small lists
    set off collection after collection over the growing tree inside it, over a second in which the event loop
    could not run. No collection runs inside the parse; the collector is on again after it (also after a parse
    that fails, and only once no other parse is under way), and stays off if it was off."""
    import gc
    import types

    from lorafleet.scheduler import bodies
    from lorafleet.scheduler.openai_api import ApiError

    collections = []

    def loads(data, **kw):
        before = sum(s["collections"] for s in gc.get_stats())
        try:
            return json.loads(data, **kw)
        finally:
            collections.append(sum(s["collections"] for s in gc.get_stats()) - before)

    monkeypatch.setattr(bodies, "json", types.SimpleNamespace(loads=loads))
    assert gc.isenabled()
    try:
        assert len(bodies.parse_body(raw({"model": "base", "prompt": [[0]] * 200_000}))["prompt"]) == 200_000
        assert collections == [0] and gc.isenabled()
        with pytest.raises(ApiError):
            bodies.parse_body(b'{"model": ')
        assert gc.isenabled()
        with bodies._collector_paused():
            with bodies._collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert gc.isenabled()
        gc.disable()
        bodies.parse_body(raw({"model": "base"}))
        assert not gc.isenabled()
    finally:
        gc.enable()


async def test_huge_prompt_is_refused_at_once_and_heavy_tokenizing_does_not_block(tok):
    fr = FakeRunner()
    client, service, servers = await start(tok, [fr], max_model_len=8192)
    try:
        t0 = time.monotonic()
        status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": "y" * 7_800_000}))
        assert status == 400 and got["error"]["code"] == "context_length_exceeded", got
        assert time.monotonic() - t0 < 2.0
        # Under the character bound: really tokenized (in the pool), then refused as too long.
        heavy = "hello world, this is a test. " * 40_000  # 1.16M characters, ~280k tokens
        assert len(heavy) < service.prompts.max_chars
        worst = 0.0

        async def probe():
            nonlocal worst
            while True:
                t = time.monotonic()
                assert (await client.get("/healthz")).status == 200
                worst = max(worst, time.monotonic() - t)
                await asyncio.sleep(0.01)

        prober = asyncio.create_task(probe())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": heavy}))
        took = time.monotonic() - t0
        prober.cancel()
        assert status == 400 and "the prompt has" in got["error"]["message"], got  # counted tokens, so tokenized
        assert took > 0.3 and worst < max(0.25, took / 3), (took, worst)
    finally:
        await stop(client, servers)


async def test_budgets(tok):
    fr = FakeRunner(max_batch_size=64)
    limits = RequestLimits(max_model_len=256, max_sequences=8, max_prompt_tokens=300, max_completion_tokens=20)
    client, service, servers = await start(tok, [fr], limits=limits)
    try:
        status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": ["a", "b", "c"], "n": 3}))
        assert status == 400 and got["error"]["code"] == "too_many_sequences" and got["error"]["param"] == "n"
        assert "9 sequences" in got["error"]["message"] and "at most 8" in got["error"]["message"]
        status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": ["x"] * 9}))
        assert status == 400 and got["error"]["param"] == "prompt"
        ids = list(range(100, 200))  # 100 tokens x 4 sequences > 300
        status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": ids, "n": 4}))
        assert status == 400 and got["error"]["code"] == "too_many_prompt_tokens", got
        status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": "x", "max_tokens": 21}))
        assert status == 400 and got["error"]["param"] == "max_tokens" and "20" in got["error"]["message"]
        r = await client.post("/v1/chat/completions", json={"model": "base", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status == 200 and fr.seen[-1]["sampling"]["max_tokens"] == 20  # default capped
        assert not [s for s in fr.seen if len(s["prompt_token_ids"]) == 100]
    finally:
        await stop(client, servers)


async def test_prompt_counts_and_sizes_are_refused_before_any_token_id_is_looked_at(tok, monkeypatch):
    """An 8 MB body holds two million one-id prompts (`[[0]] * 2_000_000`): too many prompts, an id list as long as
    the context, too many sequences or prompt tokens are each a 400 naming prompt, found from the lists' lengths
    before any id is looked at (that walk took seconds of the tokenizer pool, which all requests share)."""
    from lorafleet.scheduler import openai_api

    looked = []
    real = openai_api._is_int
    monkeypatch.setattr(openai_api, "_is_int", lambda v: looked.append(v) or real(v))
    fr = FakeRunner()
    limits = RequestLimits(max_model_len=256, max_sequences=8, max_prompt_tokens=300)
    client, _, servers = await start(tok, [fr], limits=limits)
    try:
        for extra, code, words in [
            ({"prompt": [[0]] * 3000}, "invalid_value", "at most 2048 prompts per request, got 3000"),
            ({"prompt": [0] * 100_000}, "context_length_exceeded", "prompt has 100000 tokens"),
            ({"prompt": [[0]] * 2 + [[0] * 256]}, "context_length_exceeded", "prompt has 256 tokens"),
            ({"prompt": [[0] * 50] * 9}, "too_many_sequences", "9 sequences"),
            ({"prompt": [[0] * 200] * 2}, "too_many_prompt_tokens", "holds 400 prompt tokens"),
            ({"prompt": [[0] * 100], "n": 4}, "too_many_prompt_tokens", "holds 400 prompt tokens"),
        ]:
            looked.clear()
            status, got = await post(client, "/v1/completions", raw({"model": "base", "max_tokens": 2, **extra}))
            assert status == 400 and got["error"]["code"] == code and got["error"]["param"] == "prompt", got
            assert words in got["error"]["message"] and len(looked) < 20, (got, len(looked))
        assert not fr.seen
        status, got = await post(client, "/v1/completions", raw({"model": "base", "max_tokens": 2,
                                                                 "prompt": [[5, 6.0], [7]], "n": 2}))
        assert status == 200 and sorted(s["prompt_token_ids"] for s in fr.seen) == [[5, 6], [5, 6], [7], [7]], got
    finally:
        await stop(client, servers)


async def test_context_length_exceeded_is_openai_400(api):
    client, _, fr = api
    status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": list(range(5, 300))}))
    assert status == 400 and got["error"]["code"] == "context_length_exceeded" and got["error"]["param"] == "prompt"
    status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": list(range(5, 205)),
                                                             "max_tokens": 100}))
    assert status == 400 and got["error"]["code"] == "context_length_exceeded"
    assert got["error"]["param"] == "max_tokens" and "300 tokens (200 in the prompt" in got["error"]["message"]
    assert not fr.seen


async def test_models_by_id_unknown_routes_and_methods(api):
    client, _, _ = api
    r = await client.get("/v1/models/pirate")
    card = await r.json()
    assert r.status == 200 and card["id"] == "pirate" and card["object"] == "model" and card["parent"] == "base"
    assert (await (await client.get("/v1/models/base")).json())["parent"] is None
    r = await client.get("/v1/models/nope")
    assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    r = await client.get("/v1/nothing/here")
    assert r.status == 404 and r.content_type == "application/json" and (await r.json())["error"]["message"]
    r = await client.get("/v1/completions")
    assert r.status == 405 and "POST" in r.headers["Allow"] and (await r.json())["error"]["code"] == "method_not_allowed"
    r = await client.delete("/v1/models")
    assert r.status == 405 and r.content_type == "application/json"
    r = await client.post("/v1/completions", data=b"x" * (9 << 20), headers={"Content-Type": "application/json"})
    assert r.status == 413 and (await r.json())["error"]["code"] == "body_too_large"


CHAT = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_an_unknown_model_is_named_briefly_in_its_404(api):
    """A model name the server does not know comes back in the 404's message cut to 40 characters, as unknown field
    names are: a name of megabytes (a body may be 8 MB) is not sent back whole."""
    client, _, fr = api
    name = "m" * 40 + "x" * 1_000_000
    answers = [await client.post(path, json={"model": name, **extra}) for path, extra in (
        ("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT["messages"]}),
        ("/v1/tokenize", {"prompt": "hi"}), ("/v1/detokenize", {"tokens": [1]}))]
    answers.append(await client.get("/v1/models/" + name[:8000]))  # (a URL is bounded by aiohttp's line limit)
    for r in answers:
        got = (await r.json())["error"]
        assert r.status == 404 and got["code"] == "model_not_found" and got["param"] == "model", got
        assert got["message"] == f"The model `{'m' * 40}` does not exist or you do not have access to it.", got
    got = (await (await client.get("/v1/models/nope")).json())["error"]
    assert got["message"] == "The model `nope` does not exist or you do not have access to it."
    assert not fr.seen


@pytest.mark.parametrize("extra, param", [
    ({"messages": [{"role": "user", "content": "hi", "bogus": 1}]}, "messages[0].bogus"),
    ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "t"}]}, {"role": "user", "content": "x"}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "tool", "content": "4", "tool_call_id": ["t"]}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": "", "function_call": {"name": "f"}},
                   {"role": "user", "content": "x"}]}, "messages[0].function_call"),
    ({"stream": True, "stream_options": {"include_usage": True, "bogus": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"user": {"a": 1}}, "user"),
    ({"metadata": "x"}, "metadata"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"store": "yes"}, "store"),
])
async def test_unknown_or_mistyped_fields_below_the_top_level_are_a_400(api, extra, param):
    """A misspelt or mistyped field inside a message or stream_options, or an ignored field of the wrong type, is a
    400 naming it, as an unknown top-level field is: never taken silently."""
    client, _, fr = api
    status, got = await post(client, "/v1/chat/completions", raw({**CHAT, **extra}))
    assert status == 400 and got["error"]["param"] == param, got
    assert not fr.seen


async def test_unknown_message_fields_are_named_briefly(api):
    """Many long unknown keys in a message: the error names the first three, each cut to 40 characters."""
    client, _, fr = api
    keys = [c * 100 for c in "abcde"]
    status, got = await post(client, "/v1/chat/completions",
                             raw({**CHAT, "messages": [{"role": "user", "content": "hi", **dict.fromkeys(keys, 1)}]}))
    assert status == 400 and got["error"]["param"] == "messages[0]." + "a" * 40, got
    assert "and 2 more" in got["error"]["message"] and "d" * 40 not in got["error"]["message"]
    assert len(got["error"]["message"]) < 400 and not fr.seen


async def test_unknown_top_level_fields_are_named_briefly(api):
    """Many long unknown fields at the top of a body, on every endpoint that takes one: the error names the first
    three, each cut to 40 characters (param: the first, cut), as inside a message; they came back whole."""
    client, _, fr = api
    keys = dict.fromkeys((c * 100_000 for c in "abcde"), 1)
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"model": "base", "prompt": "hi"}),
                       ("/v1/tokenize", {"model": "base", "prompt": "hi"}),
                       ("/v1/detokenize", {"model": "base", "tokens": [1]})):
        status, got = await post(client, path, raw({**body, **keys}))
        assert status == 400 and got["error"]["param"] == "a" * 40, (path, str(got)[:300])
        message = got["error"]["message"]
        assert f"{'c' * 40}' and 2 more" in message and "d" * 40 not in message and len(message) < 1000, message
    assert not fr.seen


async def test_the_optional_fields_below_the_top_level_are_served(api):
    """What those checks let through: a message's name, an empty tool_calls, stream_options.include_usage null (not
    set: no usage chunk), the ignored fields at their types."""
    client, _, fr = api
    body = {**CHAT, "messages": [{"role": "system", "content": "be brief", "name": "rules"},
                                 {"role": "assistant", "content": "ok", "tool_calls": [], "refusal": None,
                                  "function_call": None, "audio": None},
                                 {"role": "user", "content": "hi", "name": "ann"}],
            "user": "u-1", "metadata": {"team": "a"}, "store": False}
    status, got = await post(client, "/v1/chat/completions", raw(body))
    assert status == 200 and got["choices"][0]["finish_reason"] == "length", got
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True,
                                                       "stream_options": {"include_usage": None}})
    text = await r.text()
    assert r.status == 200 and text.endswith("data: [DONE]\n\n") and '"usage"' not in text, text
    assert len(fr.seen) == 2


async def test_stop_token_ids_are_bounded(api):
    """stop_token_ids go to the runner with every sequence, which checks each new token against them: more than
    MAX_STOP_TOKEN_IDS (a 5 MB body holds millions, times n) is a 400 naming the field, before any runner sees it;
    that many are served."""
    from lorafleet.scheduler.openai_api import MAX_STOP_TOKEN_IDS

    client, _, fr = api
    body = {"model": "base", "prompt": "hi", "max_tokens": 2, "n": 8}
    status, got = await post(client, "/v1/completions", raw({**body, "stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)}))
    assert status == 400 and got["error"]["param"] == "stop_token_ids", got
    assert f"at most {MAX_STOP_TOKEN_IDS}" in got["error"]["message"] and not fr.seen
    status, got = await post(client, "/v1/completions", raw({**body, "stop_token_ids": [7] * MAX_STOP_TOKEN_IDS}))
    assert status == 200 and len(fr.seen) == 8 and len(fr.seen[0]["sampling"]["stop_token_ids"]) == MAX_STOP_TOKEN_IDS


async def test_too_many_stop_token_ids_are_refused_before_they_are_looked_at(api, monkeypatch):
    """The bound on stop_token_ids is checked on the list's length first: an 8 MB body holds 4 million ids, whose
    conversion and checks took about 3 s of the tokenizer pool before the 400 came; a list of other things that is
    too long is refused the same way."""
    from lorafleet.scheduler import openai_api
    from lorafleet.scheduler.openai_api import MAX_STOP_TOKEN_IDS

    client, _, fr = api
    looked = []
    real = openai_api._is_int
    monkeypatch.setattr(openai_api, "_is_int", lambda v: looked.append(v) or real(v))
    for ids in ([7] * 100_000, [7.0] * (MAX_STOP_TOKEN_IDS + 1), ["x"] * 100_000):
        looked.clear()
        status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": "hi", "max_tokens": 2,
                                                                 "stop_token_ids": ids}))
        assert status == 400 and got["error"]["param"] == "stop_token_ids", got
        assert f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}" in got["error"]["message"]
        assert len(looked) < 20, len(looked)
    assert not fr.seen


async def test_chat_max_tokens_beside_max_completion_tokens_is_still_checked(api):
    """Chat's max_completion_tokens is used instead of max_tokens, but a max_tokens sent beside it that is not a
    valid one is a 400 naming it, not dropped unseen."""
    client, _, fr = api
    for bad in ("abc", 2**70, 0, 1.5):
        status, got = await post(client, "/v1/chat/completions",
                                 raw({**CHAT, "max_completion_tokens": 2, "max_tokens": bad}))
        assert status == 400 and got["error"]["param"] == "max_tokens", (bad, got)
    assert not fr.seen
    status, got = await post(client, "/v1/chat/completions", raw({**CHAT, "max_completion_tokens": 3,
                                                                  "max_tokens": 5}))
    assert status == 200 and fr.seen[-1]["sampling"]["max_tokens"] == 3, got


async def test_completions_without_max_tokens_take_16_or_what_the_context_leaves(api):
    """/v1/completions without max_tokens: OpenAI's 16 tokens, or fewer where the context (256 here) leaves less
    room after the prompt, rather than a 400 about a max_tokens the client never sent."""
    client, _, fr = api
    status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": "hi"}))
    assert status == 200 and got["usage"]["completion_tokens"] == 16, got
    status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": list(range(5, 255))}))
    assert status == 200 and got["usage"]["prompt_tokens"] == 250 and got["usage"]["completion_tokens"] == 6, got
    status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": "hi", "min_tokens": 17}))
    assert status == 400 and got["error"]["param"] == "min_tokens" and "omitted: 16" in got["error"]["message"], got


async def test_min_tokens_above_the_default_max_tokens_is_a_400(api):
    """Without max_tokens, the completion's length is the room the context (256 here) leaves the prompt (chat), or
    16 or less (completions): a min_tokens above it could never be honoured and is a 400 naming it, as it is
    beside a max_tokens sent, rather than a shorter answer than asked for."""
    client, _, fr = api
    status, got = await post(client, "/v1/chat/completions", raw({**CHAT, "max_tokens": None, "min_tokens": 250}))
    assert status == 400 and got["error"]["param"] == "min_tokens" and "omitted: " in got["error"]["message"], got
    status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": list(range(5, 255)),
                                                             "min_tokens": 10}))
    assert status == 400 and got["error"]["param"] == "min_tokens", got
    assert "omitted: 6, the room left after the prompt's 250 tokens" in got["error"]["message"], got
    assert not fr.seen
    status, got = await post(client, "/v1/completions", raw({"model": "base", "prompt": list(range(5, 255)),
                                                             "min_tokens": 6}))
    assert status == 200 and fr.seen[-1]["sampling"]["min_tokens"] == 6 and got["usage"]["completion_tokens"] == 6


async def test_a_stream_whose_client_drops_as_it_starts_is_a_499_not_an_error(api, monkeypatch):
    """A streaming client that hangs up just as the answer's headers go out (aiohttp's prepare raises a connection
    reset): counted 499 with nothing unhandled, its sequence cancelled; the server serves on."""
    from aiohttp import web

    client, service, fr = api
    real = web.StreamResponse.prepare

    async def dropped(self, request):
        if self.headers.get("Content-Type") == "text/event-stream":
            raise ConnectionResetError("Cannot write to closing transport")
        return await real(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", dropped)
    try:
        r = await client.post("/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 50,
                                                       "stream": True})
        await r.read()
    except Exception:  # (the connection closes without an answer)
        pass
    monkeypatch.setattr(web.StreamResponse, "prepare", real)
    for _ in range(100):
        text = await (await client.get("/metrics")).text()
        if 'code="499"' in text and not service.in_flight:
            break
        await asyncio.sleep(0.02)
    assert 'lorafleet_http_requests_total{code="499",route="/v1/completions"} 1.0' in text, text[-2000:]
    assert service.metrics.unhandled_errors._value.get() == 0 and 'code="500"' not in text
    assert not service.in_flight
    r = await client.post("/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 2})
    assert r.status == 200


async def test_a_body_that_cannot_be_decoded_is_a_400_not_an_error(api):
    """A body whose bytes are not in the Content-Encoding it names, or not UTF-8: a JSON 400 saying so, nothing
    unhandled; the same request properly compressed is served."""
    import gzip
    import zlib

    client, _, fr = api
    body = raw({"model": "base", "prompt": "hi", "max_tokens": 2})
    for enc in ("gzip", "deflate"):
        r = await client.post("/v1/completions", data=b"garbage",
                              headers={"Content-Type": "application/json", "Content-Encoding": enc})
        got = await r.json()
        assert r.status == 400 and got["error"]["code"] == "bad_request_body", got
        assert "could not be read" in got["error"]["message"] and "content-encoding" in got["error"]["message"]
    assert not fr.seen
    status, got = await post(client, "/v1/completions", b'{"model": "base", "prompt": "caf\xe9"}')  # Latin-1 bytes
    assert status == 400 and "request body is not valid UTF-8 (byte 32" in got["error"]["message"], got
    for enc, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        r = await client.post("/v1/completions", data=data,
                              headers={"Content-Type": "application/json", "Content-Encoding": enc})
        assert r.status == 200, (enc, await r.text())
    text = await (await client.get("/metrics")).text()
    assert "lorafleet_unhandled_errors_total 0.0" in text


async def test_a_content_encoding_left_undecoded_is_a_415(api):
    """A Content-Encoding aiohttp does not decode (the handler would get the encoded bytes, or, for an unknown name,
    bytes that only look plain): a JSON 415 naming it, nothing unhandled; identity is the plain body."""
    client, _, fr = api
    body = raw({"model": "base", "prompt": "hi", "max_tokens": 2})
    for enc in ("xyz", "x-gzip", "gzip, br", "compress"):
        r = await client.post("/v1/completions", data=body,
                              headers={"Content-Type": "application/json", "Content-Encoding": enc})
        got = await r.json()
        assert r.status == 415 and got["error"]["code"] == "unsupported_content_encoding", (enc, got)
        assert repr(enc) in got["error"]["message"]
    assert not fr.seen
    r = await client.post("/v1/completions", data=body,
                          headers={"Content-Type": "application/json", "Content-Encoding": "Identity"})
    assert r.status == 200, await r.text()
    text = await (await client.get("/metrics")).text()
    assert "lorafleet_unhandled_errors_total 0.0" in text and 'code="415"' in text


async def test_metrics_split_http_codes_from_finish_reasons_and_count_crashes(api):
    client, service, _ = api
    assert (await client.post("/v1/completions", json={"model": "base", "prompt": "hi", "max_tokens": 2})).status == 200
    assert (await client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})).status == 404
    await client.get("/no/such/route")

    async def boom(request):
        raise RuntimeError("bug")

    for route in client.app.router.routes():  # a handler with a bug
        if route.resource is not None and route.resource.canonical == "/readyz":
            route._handler = boom
    r = await client.get("/readyz")
    body = await r.json()
    assert r.status == 500 and body["error"]["code"] == "internal_error" and "bug" not in body["error"]["message"]
    text = await (await client.get("/metrics")).text()
    assert 'lorafleet_http_requests_total{code="200",route="/v1/completions"} 1.0' in text
    assert 'lorafleet_http_requests_total{code="404",route="/v1/completions"} 1.0' in text
    assert 'lorafleet_http_requests_total{code="404",route="unmatched"} 1.0' in text
    assert 'lorafleet_http_requests_total{code="500",route="/readyz"} 1.0' in text
    assert 'lorafleet_sequences_finished_total{finish_reason="length"} 1.0' in text
    assert "lorafleet_unhandled_errors_total 1.0" in text
    assert "lorafleet_requests_total" not in text


async def test_a_dropped_or_stalled_upload_is_a_499_or_a_408_not_an_error(api, monkeypatch):
    """A client that sends its headers and part of the body, then hangs up: counted 499, nothing unhandled; one
    that stalls mid-body: a JSON 408 once the body timeout passes (here 0.5 s), not a handler held forever."""
    from lorafleet.scheduler import http_errors

    client, service, fr = api
    monkeypatch.setattr(http_errors, "BODY_TIMEOUT_S", 0.5)
    host, port = client.server.host, client.server.port
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"model\":")

    reader, writer = await asyncio.open_connection(host, port)
    writer.write(head)
    await writer.drain()
    writer.close()  # gone mid-body
    await writer.wait_closed()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(head)
    await writer.drain()
    t0 = time.monotonic()
    head_in = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)  # answered though the body never came
    length = int(next(ln.split(b":")[1] for ln in head_in.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    writer.close()
    assert head_in.startswith(b"HTTP/1.1 408 "), head_in
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert 0.4 < time.monotonic() - t0 < 5
    for _ in range(100):  # the dropped upload's handler ends on its own
        text = await (await client.get("/metrics")).text()
        if 'code="499"' in text:
            break
        await asyncio.sleep(0.02)
    assert 'route="/v1/chat/completions"' in text and 'code="499"' in text, text[-2000:]
    assert service.metrics.unhandled_errors._value.get() == 0
    assert not fr.seen
    r = await client.post("/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 2})
    assert r.status == 200  # and it still serves


async def test_malformed_http_is_one_warning_line_not_an_error_traceback(api, caplog):
    """A header line over aiohttp's limit: aiohttp answers 400 itself; the log says so in one WARNING line (no
    ERROR, no traceback), and the server keeps serving."""
    import logging

    client, _, _ = api
    host, port = client.server.host, client.server.port
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert answer.split(b" ", 2)[1] == b"400", answer[:200]
    mine = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert mine and all(r.levelno == logging.WARNING and not r.exc_info for r in mine), [
        (r.levelname, r.getMessage()) for r in mine]
    assert "malformed HTTP, answered 400" in mine[0].getMessage()
    assert (await client.get("/v1/models")).status == 200


async def test_a_requeued_request_that_only_an_empty_runner_can_take_does_not_block_the_queue():
    """A request re-queued with 200 prompt and 30 generated tokens (its runner failed or left) under max_tokens 300,
    with one runner of 256 KV tokens: placement's need (its tokens plus the next 64) exceeded every runner, so it
    once stayed at the queue's head and everything behind it waited. Capped at the largest runner, it is placed (the
    one behind it then waits for room on that full runner, as any request does); one that has outgrown every runner
    ends at its length limit instead of waiting."""
    import types

    from lorafleet.scheduler.cluster import Cluster, RunnerHandle
    from lorafleet.scheduler.discovery import RunnerDirectory, RunnerEndpoint
    from lorafleet.scheduler.request import Request

    c = Cluster(RunnerDirectory())
    r = RunnerHandle(RunnerEndpoint("r1", "http://127.0.0.1:9"))
    r.healthy = True
    r.state = {"total_kv_tokens": 256, "max_batch_size": 8, "page_size": 16}
    r.link = types.SimpleNamespace(stream_id="s", cancel=lambda rid: None)
    c.runners["r1"] = r
    placed = []

    async def run_on(runner, req):
        placed.append(req.id)

    c._run_on = run_on
    big = Request(id="big", model="m", adapter=None, prompt_ids=[5] * 200, max_tokens=300, sampling={})
    big.generated = [1] * 30
    c._requeue(r, big, "runner left", migration=False)
    small = Request(id="small", model="m", adapter=None, prompt_ids=[5] * 5, max_tokens=4, sampling={})
    c.submit(small)
    c.dispatch()
    await asyncio.sleep(0)
    assert placed == ["big"] and [q.id for q in c.queue] == ["small"]
    c.queue.clear()
    grown = Request(id="grown", model="m", adapter=None, prompt_ids=[5] * 200, max_tokens=300, sampling={})
    grown.generated = [1] * 60  # 260 tokens: more than any runner holds
    c.queue.append(grown)
    c.dispatch()
    assert grown.done and grown.finish_reason == "length" and not c.queue


async def test_a_runner_whose_health_checks_time_out_is_reported_with_the_reason(caplog):
    """A runner too busy to answer /state in time: the log line that marks it unhealthy, and the error of a request
    that gives up after as many runner failures, say that its health checks timed out (a timeout's own text is
    empty: "runner r1 is unhealthy: " and "generation failed: , 6 times; giving up" before)."""
    import logging
    import types

    from lorafleet.scheduler.cluster import MAX_FAILURES, Cluster, RunnerHandle
    from lorafleet.scheduler.discovery import RunnerDirectory, RunnerEndpoint
    from lorafleet.scheduler.request import Request

    c = Cluster(RunnerDirectory(), poll_interval=0.01)

    def hangs(url, timeout):
        raise asyncio.TimeoutError()

    c.session = types.SimpleNamespace(get=hangs)
    r = RunnerHandle(RunnerEndpoint("r1", "http://127.0.0.1:9"))
    r.healthy = True
    c.runners["r1"] = r
    req = Request(id="q", model="m", adapter=None, prompt_ids=[5] * 5, max_tokens=4, sampling={})
    req.failures = MAX_FAILURES  # its last chance
    r.assigned[req.id] = req
    with caplog.at_level(logging.WARNING, logger="lorafleet.scheduler.cluster"):
        poll = asyncio.create_task(c._poll(r))
        for _ in range(200):
            if req.done:
                break
            await asyncio.sleep(0.01)
        poll.cancel()
    assert req.done and req.finish_reason == "error", req
    assert req.error == f"health check failed: TimeoutError, {MAX_FAILURES + 1} times; giving up", req.error
    assert "runner r1 is unhealthy: health check failed: TimeoutError" in caplog.text, caplog.text

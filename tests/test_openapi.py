"""Real answers of the scheduler match the schemas /openapi.json names (the schemathesis module
fuzzes the same document; this checks the main shapes directly, errors of unrouted paths too)."""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from api_helpers import start, stop
from fake_runner import FakeRunner

pytestmark = pytest.mark.timeout(60)


def validator(doc: dict, name: str) -> Draft202012Validator:
    registry = Registry().with_resource("root", Resource.opaque(doc))
    return Draft202012Validator({"$ref": f"root#/components/schemas/{name}"}, registry=registry)


async def test_real_answers_match_the_document(tok):
    fr = FakeRunner()
    client, service, servers = await start(tok, [fr])
    try:
        doc = await (await client.get("/openapi.json")).json()
        assert doc["openapi"].startswith("3.1") and set(doc["paths"]) >= {
            "/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}", "/openapi.json"}
        props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
        assert props["max_tokens"]["maximum"] == service.limits.completion_cap
        assert props["model"]["examples"] == ["base", "pirate", "shouty"]

        def check(name, body):
            errors = sorted(validator(doc, name).iter_errors(body), key=str)
            assert not errors, (name, [e.message for e in errors], body)

        check("Completion", await (await client.post("/v1/completions", json={
            "model": "pirate", "prompt": ["a", "b"], "max_tokens": 3})).json())
        check("ChatCompletion", await (await client.post("/v1/chat/completions", json={
            "model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 2})).json())
        check("ModelList", await (await client.get("/v1/models")).json())
        check("Model", await (await client.get("/v1/models/shouty")).json())
        for resp in (await client.get("/v1/models/nope"), await client.post("/v1/completions", json={"model": 1}),
                     await client.get("/v1/nowhere"), await client.put("/v1/models")):
            check("Error", await resp.json())
        text = await (await client.post("/v1/chat/completions", json={
            "model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}})).text()
        events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for e in events[:-1]:
            check("ChatCompletionChunk", json.loads(e))
    finally:
        await stop(client, servers)


def test_request_schemas_name_exactly_the_fields_the_parser_takes():
    """additionalProperties is false: the schema's fields are the parser's known fields, no more, no fewer; a body
    the parser answers is valid against the schema, including the neutral values of the unsupported fields."""
    from lorafleet.scheduler.limits import RequestLimits
    from lorafleet.scheduler.openai_api import MESSAGE_FIELDS, known_fields, parse_common
    from lorafleet.scheduler.openapi import document

    doc = document("base", RequestLimits(max_model_len=512))
    for name, chat in (("CompletionRequest", False), ("ChatCompletionRequest", True)):
        schema = doc["components"]["schemas"][name]
        assert schema["additionalProperties"] is False
        assert set(schema["properties"]) == set(known_fields(chat)), name
    message = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["messages"]["items"]
    assert message["additionalProperties"] is False and set(message["properties"]) == set(MESSAGE_FIELDS)
    options = doc["components"]["schemas"]["CompletionRequest"]["properties"]["stream_options"]
    assert options["additionalProperties"] is False and set(options["properties"]) == {"include_usage"}
    body = {"model": "base", "prompt": "x", "repetition_penalty": 1.0, "logprobs": None, "parallel_tool_calls": False,
            "user": None, "safety_identifier": "s", "response_format": {"type": "text"}, "stream": True,
            "stream_options": {"include_usage": True}, "min_p": 0, "skip_special_tokens": True}
    parse_common(body, chat=False, max_tokens_cap=16)
    assert not list(validator(doc, "CompletionRequest").iter_errors(body))


@pytest.mark.parametrize("name, body", [
    ("CompletionRequest", {"model": "base", "prompt": "x", "stop": ""}),
    ("CompletionRequest", {"model": "base", "prompt": "x", "logit_bias": {"0" * 13: 1}}),
    ("CompletionRequest", {"model": "base", "prompt": "x", "stop_token_ids": [1000]}),
    ("TokenizeRequest", {"model": "base", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
    ("TokenizeRequest", {"model": "base"}),
    ("TokenizeRequest", {"model": "base", "messages": [{"role": "user", "content": "x", "bogus": 1}]}),
])
def test_what_the_server_refuses_the_document_does_not_call_valid(name, body):
    """Bodies the server answers 400 are invalid against the request schemas too (a client or a schema-driven fuzzer
    reading the document would otherwise expect them served): an empty stop string, a logit_bias key longer than
    12 digits, a stop token id past the vocabulary, a tokenize call with both or neither of prompt and messages or
    with a message field that chat completions would refuse (tokenize reads messages as they do)."""
    from lorafleet.scheduler.limits import RequestLimits
    from lorafleet.scheduler.openapi import document

    doc = document("base", RequestLimits(max_model_len=512), vocab_size=1000)
    assert list(validator(doc, name).iter_errors(body)), body

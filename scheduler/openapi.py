"""The OpenAPI 3.1 document of the scheduler's HTTP API, served at `/openapi.json`.

Built from the same constants the request parser uses (openai_api.py, limits.py), so the
bounds it states are the ones enforced; tests validate real answers against it and a
schema-driven fuzzer (schemathesis) checks that no input makes the scheduler answer 5xx.
`model` is any string; the names this scheduler serves are listed as an `enum` branch and as
examples (an unknown name is a 404).
"""

from __future__ import annotations

from lorafleet import __version__
from lorafleet.scheduler.limits import RequestLimits
from lorafleet.scheduler.openai_api import (IGNORED, MAX_CACHE_SALT, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N,
                                            MAX_PROMPTS, MAX_REPETITION_PENALTY, MAX_STOP, MAX_STOP_CHARS,
                                            MAX_STOP_TOKEN_IDS, NEUTRAL, OFF_ONLY, ROLES)

JSON = "application/json"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _errors(*codes: int) -> dict:
    words = {400: "invalid request (the message names the field)", 401: "missing or wrong API key",
             403: "admin API disabled", 404: "unknown model or route",
             408: "the request body did not arrive within 60 s of its headers", 413: "request body too large",
             415: "a Content-Encoding other than gzip or deflate",
             429: "queue full (see Retry-After)", 500: "generation failed on a runner",
             503: "no runner available or shutting down (see Retry-After)"}
    return {str(c): _json(_ref("Error"), words[c]) for c in codes}


NULLABLE_STR = {"type": ["string", "null"]}


def _schemas(limits: RequestLimits, names: list[str], vocab_size: int) -> dict:
    cap = limits.completion_cap
    token_ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
                 "minItems": 1, "maxItems": limits.max_model_len - 1}
    model = {"anyOf": [{"enum": names}, {"type": "string", "minLength": 1}], "examples": names,
             "description": "the base model or an adapter (GET /v1/models lists them)"}
    sampling = {
        "model": model,
        "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": cap},
        "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": ["integer", "null"], "minimum": -1, "maximum": 1 << 30},
        "n": {"type": ["integer", "null"], "minimum": 1, "maximum": min(MAX_N, limits.max_sequences),
              "description": f"prompts x n may not exceed {limits.max_sequences} per request"},
        "seed": {"type": ["integer", "null"], "minimum": -(2**63), "maximum": 2**63 - 1},
        "stop": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                           {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                            "maxItems": MAX_STOP}, {"type": "null"}]},
        "stop_token_ids": {"type": ["array", "null"], "maxItems": MAX_STOP_TOKEN_IDS,
                           "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}},
        "ignore_eos": {"type": ["boolean", "null"]},
        "skip_special_tokens": {"type": ["boolean", "null"],
                                "description": "false: special tokens (e.g. an end-of-turn token) spelt out in the "
                                               "text (default true: left out)"},
        "include_stop_str_in_output": {"type": ["boolean", "null"],
                                       "description": "true: the stop string that ended the text (or the text of "
                                                      "the stop token) stays at its end (default false)"},
        "stream": {"type": ["boolean", "null"]},
        "stream_options": {"type": ["object", "null"], "additionalProperties": False,
                           "properties": {"include_usage": {"type": ["boolean", "null"]}},
                           "description": "only with stream: true"},
        "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2,
                             "description": "subtracted once from the logit of each token the output holds"},
        "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2,
                              "description": "subtracted from a token's logit once per time the output holds it"},
        "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": MAX_REPETITION_PENALTY,
                               "description": "HF's: the logit of a token of the prompt or output divided by it "
                                              "(multiplied when negative)"},
        "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1,
                  "description": "a token less likely than min_p times the most likely one is not sampled"},
        "min_tokens": {"type": ["integer", "null"], "minimum": 0, "maximum": cap,
                       "description": "no EOS or stop_token_ids before this many tokens (at most max_tokens)"},
        "logit_bias": {"anyOf": [{"type": "null"}, {
            "type": "object", "maxProperties": MAX_LOGIT_BIAS,
            "propertyNames": {"pattern": "^[0-9]+$", "maxLength": 12},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}],
            "description": f"token id (below {vocab_size}) -> a number added to its logit"},
        **{k: {"type": ["string", "null"], "description": "accepted and ignored"} for k in sorted(IGNORED)},
        "store": {"type": ["boolean", "null"], "description": "accepted and ignored"},
        "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"},
                     "description": "accepted and ignored"},
        **{k: {"enum": [None, False, "none"], "description": "not supported: only unset"} for k in OFF_ONLY},
        **{k: {"enum": [None, v], "description": f"not supported: only {v}"} for k, v in NEUTRAL.items()},
        "response_format": {"anyOf": [{"type": "null"}, {"type": "object", "required": ["type"],
                                                          "properties": {"type": {"const": "text"}}}],
                            "description": "only {\"type\": \"text\"}"},
        "priority": {"type": ["integer", "null"], "minimum": -(2**31), "maximum": 2**31 - 1,
                     "description": "queue order: lower values are placed first (default 0; an API key may set a "
                                    "floor)"},
        "cache_salt": {"type": ["string", "null"], "minLength": 1, "maxLength": MAX_CACHE_SALT,
                       "description": "prefix cache isolation: this request shares cached prompt pages only with "
                                      "requests of the same salt (and the same API key's salt, where the server "
                                      "salts per key)"},
    }
    stream_rule = {  # stream_options only together with stream: true
        "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
        "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
    usage = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens",
                                            "prompt_tokens_details"],
             "properties": {**{k: {"type": "integer", "minimum": 0}
                               for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                            "prompt_tokens_details": {
                                "type": "object", "required": ["cached_tokens"],
                                "properties": {"cached_tokens": {
                                    "type": "integer", "minimum": 0,
                                    "description": "prompt tokens found in a runner's prefix cache (not computed "
                                                   "again); each prompt counts once, like prompt_tokens"}}}}}
    messages = {  # a chat's messages (chat completions and tokenize read them alike)
        "type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {"role": {"enum": list(ROLES)}, "content": {"anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
                    "type": {"const": "text"}, "text": {"type": "string"}}}}]},
                **{k: {"type": ["string", "null"]} for k in ("name", "tool_call_id", "refusal")},
                "tool_calls": {"type": ["array", "null"], "maxItems": 0, "description": "not supported: only unset"},
                **{k: {"type": "null", "description": "not supported: only unset"}
                   for k in ("function_call", "audio")}}}}
    finish = {"enum": ["stop", "length"]}
    # log-probabilities of the generated tokens under the model's distribution (the logits' log-softmax, before
    # temperature, top-k and top-p); -inf is written as -9999.0
    logprob = {"type": "number", "maximum": 0}
    token_bytes = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}
    chat_logprobs = {"anyOf": [{"type": "null"}, {"type": "object", "required": ["content"], "properties": {
        "content": {"type": "array", "items": {
            "type": "object", "required": ["token", "logprob", "bytes", "top_logprobs"],
            "properties": {"token": {"type": "string"}, "logprob": logprob, "bytes": token_bytes,
                           "top_logprobs": {"type": "array", "maxItems": MAX_LOGPROBS, "items": {
                               "type": "object", "required": ["token", "logprob", "bytes"],
                               "properties": {"token": {"type": "string"}, "logprob": logprob,
                                              "bytes": token_bytes}}}}}}}}]}
    completion_logprobs = {"anyOf": [{"type": "null"}, {
        "type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        "properties": {"tokens": {"type": "array", "items": {"type": "string"}},
                       # (null for an echoed prompt's first token)
                       "token_logprobs": {"type": "array", "items": {"anyOf": [logprob, {"type": "null"}]}},
                       "top_logprobs": {"type": "array", "items": {"anyOf": [{"type": "null"}, {
                           "type": "object", "additionalProperties": logprob, "maxProperties": MAX_LOGPROBS}]}},
                       "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}]}
    return {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": NULLABLE_STR,
                           "code": NULLABLE_STR}}}},
        "CompletionRequest": {
            "type": "object", "required": ["model", "prompt"], "additionalProperties": False,
            "allOf": [stream_rule, {  # max_tokens 0 only with echo: true (the prompt scored, nothing generated)
                "if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
                "then": {"required": ["echo"], "properties": {"echo": {"const": True}}}}],
            "properties": {**sampling, "max_tokens": {"type": ["integer", "null"], "minimum": 0, "maximum": cap},
                           "echo": {"type": ["boolean", "null"],
                                    "description": "the prompt first, then the completion (with logprobs: the prompt's "
                                                   "tokens first, the first one with a null log-probability)"},
                           "logprobs": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
                                                  {"enum": [None, False]}],
                                        "description": "each generated token's log-probability with this many of "
                                                       "the most likely alternatives"},
                           "best_of": {"enum": [None, 1], "description": "not supported: only 1"},
                           "suffix": {"enum": [None, ""], "description": "not supported: only unset"},
                           "prompt": {"anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_PROMPTS},
                token_ids,
                {"type": "array", "items": token_ids, "minItems": 1, "maxItems": MAX_PROMPTS}]}}},
        "ChatCompletionRequest": {
            "type": "object", "required": ["model", "messages"], "additionalProperties": False,
            "allOf": [stream_rule, {  # top_logprobs above 0 only with logprobs: true
                "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
                "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}],
            "properties": {**sampling, "max_completion_tokens": sampling["max_tokens"],
                           "logprobs": {"type": ["boolean", "null"],
                                        "description": "each generated token's log-probability"},
                           "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS,
                                            "description": "with logprobs: true, this many of the most likely "
                                                           "alternatives of each generated token"},
                           "chat_template_kwargs": {
                               "type": ["object", "null"], "description": "extra variables of the model's chat "
                               "template, e.g. {\"enable_thinking\": false}; may not set messages, "
                               "add_generation_prompt, tools, documents or special tokens"},
                           "messages": messages}},
        "Completion": {
            "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"const": "text_completion"},
                           "created": {"type": "integer"}, "model": {"type": "string"}, "usage": usage,
                           "choices": {"type": "array", "items": {
                               "type": "object", "required": ["index", "text", "logprobs", "finish_reason"],
                               "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                              "logprobs": completion_logprobs, "finish_reason": finish}}}}},
        "ChatCompletion": {
            "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"const": "chat.completion"},
                           "created": {"type": "integer"}, "model": {"type": "string"}, "usage": usage,
                           "choices": {"type": "array", "items": {
                               "type": "object", "required": ["index", "message", "logprobs", "finish_reason"],
                               "properties": {
                                   "index": {"type": "integer"}, "logprobs": chat_logprobs, "finish_reason": finish,
                                   "message": {"type": "object", "required": ["role", "content"], "properties": {
                                       "role": {"const": "assistant"}, "content": {"type": "string"}}}}}}}},
        "CompletionChunk": {
            "type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"const": "text_completion"},
                           "created": {"type": "integer"}, "model": {"type": "string"}, "usage": usage,
                           "choices": {"type": "array", "items": {
                               "type": "object", "required": ["index", "text", "finish_reason"],
                               "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                              "logprobs": completion_logprobs,
                                              "finish_reason": {"enum": ["stop", "length", None]}}}}}},
        "ChatCompletionChunk": {
            "type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"const": "chat.completion.chunk"},
                           "created": {"type": "integer"}, "model": {"type": "string"}, "usage": usage,
                           "choices": {"type": "array", "items": {
                               "type": "object", "required": ["index", "delta", "finish_reason"],
                               "properties": {
                                   "index": {"type": "integer"}, "logprobs": chat_logprobs,
                                   "finish_reason": {"enum": ["stop", "length", None]},
                                   "delta": {"type": "object", "properties": {
                                       "role": {"const": "assistant"}, "content": {"type": "string"}}}}}}}},
        "StreamEvent": {
            "description": "one server-sent event: `data:` holds a chunk, an error (a sequence failed after the "
                           "stream began) or the final `[DONE]`",
            "type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [
                {"const": "[DONE]"},
                {"type": "string", "contentMediaType": JSON, "contentSchema": {
                    "anyOf": [_ref("CompletionChunk"), _ref("ChatCompletionChunk"), _ref("Error")]}}]}}},
        "TokenizeRequest": {
            "type": "object", "required": ["model"], "additionalProperties": False,
            "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
            "description": "either prompt (a text) or messages (a chat, rendered by the model's template)",
            "properties": {"model": model, "prompt": {"type": "string"},
                           "messages": messages,
                           "add_generation_prompt": {"type": "boolean", "description": "messages: default true"},
                           "add_special_tokens": {"type": "boolean", "description": "prompt: default true"},
                           "chat_template_kwargs": {"type": ["object", "null"]}}},
        "TokenizeResponse": {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
            "count": {"type": "integer", "minimum": 0}, "max_model_len": {"type": "integer"},
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}},
        "DetokenizeRequest": {"type": "object", "required": ["model", "tokens"], "additionalProperties": False,
                              "properties": {"model": model, "tokens": {
                                  "type": "array", "items": {"type": "integer", "minimum": 0,
                                                             "maximum": vocab_size - 1}}}},
        "DetokenizeResponse": {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        "Model": {
            "type": "object", "required": ["id", "object", "created", "owned_by", "status"],
            "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                           "owned_by": {"type": "string"}, "root": {"type": "string"}, "parent": NULLABLE_STR,
                           "status": {"enum": ["available", "unavailable"]},
                           "reason": {"type": "string", "description": "why an adapter is unavailable"}}},
        "ModelList": {"type": "object", "required": ["object", "data"],
                      "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}},
        "AdminState": {"type": "object", "required": ["runners", "queue_length"],
                       "properties": {"queue_length": {"type": "integer"},
                                      "runners": {"type": "array", "items": {"type": "object"}}}},
    }


def _generate_op(summary: str, request: str, response: str) -> dict:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
        "responses": {"200": {"description": "the completion (JSON), or server-sent events with stream: true",
                              "content": {JSON: {"schema": _ref(response)},
                                          "text/event-stream": {"schema": _ref("StreamEvent")}}},
                      **_errors(400, 401, 404, 408, 413, 415, 429, 500, 503)},
    }


def _tokens_op(summary: str, request: str, response: str) -> dict:
    return {"summary": summary, "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
            "responses": {"200": _json(_ref(response), summary), **_errors(400, 401, 404, 408, 413, 415)}}


def document(model_name: str, limits: RequestLimits, adapters: list[str] = (), auth: bool = False,
             vocab_size: int = 2**31) -> dict:
    """The OpenAPI document; `auth`: the /v1 endpoints require an API key."""
    names = [model_name, *adapters]
    v1_security = [{"apiKey": []}] if auth else []
    admin = [{"adminToken": []}]
    ops = {
        "/v1/completions": {"post": _generate_op("text completion", "CompletionRequest", "Completion")},
        "/v1/chat/completions": {"post": _generate_op("chat completion", "ChatCompletionRequest", "ChatCompletion")},
        **{f"{prefix}/tokenize": {"post": _tokens_op("a prompt's or a chat's token ids", "TokenizeRequest",
                                                     "TokenizeResponse")} for prefix in ("/v1", "")},
        **{f"{prefix}/detokenize": {"post": _tokens_op("token ids to text", "DetokenizeRequest",
                                                       "DetokenizeResponse")} for prefix in ("/v1", "")},
        "/v1/models": {"get": {"summary": "the base model and the adapters this key may use",
                               "responses": {"200": _json(_ref("ModelList"), "models"), **_errors(401)}}},
        "/v1/models/{model_id}": {"get": {
            "summary": "one model", "parameters": [{"name": "model_id", "in": "path", "required": True,
                                                    "schema": {"type": "string", "minLength": 1}}],
            "responses": {"200": _json(_ref("Model"), "the model"), **_errors(401, 404)}}},
    }
    for path_ops in ops.values():
        for op in path_ops.values():
            op["security"] = v1_security
    plain = {
        "/openapi.json": {"get": {"summary": "this document", "security": [],
                                  "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1")}}},
        "/healthz": {"get": {"summary": "liveness", "security": [], "responses": {
            "200": _json({"type": "object", "required": ["ok"], "properties": {"ok": {"const": True}}}, "alive")}}},
        "/readyz": {"get": {"summary": "readiness: at least one healthy runner", "security": [], "responses": {
            code: _json({"type": "object", "required": ["ready"], "properties": {"ready": {"type": "boolean"}}},
                        what) for code, what in (("200", "ready"), ("503", "not ready"))}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "security": [], "responses": {
            "200": {"description": "text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/admin/state": {"get": {"summary": "cluster view for the operator", "security": admin, "responses": {
            "200": _json(_ref("AdminState"), "runners and queue"), **_errors(401, 403)}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "lorafleet scheduler", "version": __version__,
                 "description": "OpenAI-compatible API over a pool of LoRA runners. Errors have OpenAI's shape "
                                "{\"error\": {\"message\", \"type\", \"param\", \"code\"}}. A request body "
                                "that gives a key twice in one JSON object is a 400 (invalid_json) naming it."},
        "paths": {**ops, **plain},
        "components": {
            "schemas": _schemas(limits, names, vocab_size),
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer", "description": "--api-keys"},
                                "adminToken": {"type": "http", "scheme": "bearer",
                                               "description": "LORAFLEET_ADMIN_TOKEN"}},
        },
    }

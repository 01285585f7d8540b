"""OpenAI request validation and response shapes (completions and chat completions).

Every rejection is an `ApiError` carrying the HTTP status and the OpenAI error body:
`{"error": {"message", "type", "param", "code"}}`, with `param` naming the bad field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from dataclasses import dataclass

from lorafleet.scheduler.tokenizer import RESERVED_TEMPLATE_VARS

MAX_N = 128  # OpenAI's bound; the scheduler's sequence budget (limits.py) is usually lower
MAX_PROMPTS = 2048
MAX_STOP = 4
MAX_STOP_CHARS = 4096  # per stop string: a stream holds back up to that much text until it cannot be a stop's start
MAX_CACHE_SALT = 256  # characters; the runners take the same bound
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs bound); the runners take the same bound
MIN_LOGPROB = -9999.0  # a log-probability of -inf (a token the model rules out) as JSON can carry it
MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's bound); the runners take the same bound
# stop_token_ids per request: each travels with every sequence to its runner, which checks every generated token
# against them; the runners take the same bound
MAX_STOP_TOKEN_IDS = 1024
MAX_REPETITION_PENALTY = 10.0  # the runners take the same bound

# The body fields each endpoint reads, refuses as unsupported (_refuse_unsupported) or ignores (IGNORED: OpenAI
# fields that change nothing about the output). Anything else is refused, as OpenAI refuses an unrecognized
# argument: a misspelt field (`max_token`) would otherwise fall back to its default unnoticed.
# Sampling extras of vLLM's API (its own benchmark client sends repetition_penalty 1.0) at the value that
# changes nothing; any other value is refused as unsupported.
NEUTRAL = {"spaces_between_special_tokens": True}
# OpenAI features this server lacks, accepted when unset (null, false or "none"), otherwise refused as unsupported.
OFF_ONLY = ("tools", "functions", "tool_choice", "function_call", "parallel_tool_calls", "reasoning_effort",
            "verbosity")
COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stop_token_ids", "ignore_eos",
    "stream", "stream_options", "cache_salt", "presence_penalty", "frequency_penalty", "logprobs", "logit_bias",
    "response_format", "repetition_penalty", "min_p", "min_tokens", "priority", "skip_special_tokens",
    "include_stop_str_in_output", *OFF_ONLY, *NEUTRAL})
COMPLETION_FIELDS = frozenset({"prompt", "echo", "best_of", "suffix"})
CHAT_FIELDS = frozenset({"messages", "max_completion_tokens", "chat_template_kwargs", "top_logprobs"})
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})
INT64 = 2**63
COMPLETION_DEFAULT_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.code, self.headers = code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def context_exceeded(param: str, message: str) -> ApiError:
    """OpenAI's answer to a prompt (plus completion) longer than the model's context."""
    return ApiError(400, message, param=param, code="context_length_exceeded")


EXTRA_SAMPLING = ("logprobs", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                  "min_tokens")


@dataclass
class GenParams:
    model: str
    n: int
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    cache_salt: str | None = None  # the request's own salt (api_keys.cache_salt mixes in the key's)
    logprobs: int | None = None  # alternatives per generated token with its log-probability; None: none asked
    echo: bool = False  # completions: the prompt comes back before the completion (with logprobs: its tokens' too)
    priority: int = 0  # queue order, lower first (an API key's `priority` is a floor: api_keys.py)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    skip_special_tokens: bool = True  # False: special tokens (e.g. <|im_end|>) spelt out in the text
    include_stop_str_in_output: bool = False  # the stop string (or stopping token's text) kept at the text's end
    # max_tokens omitted on /v1/completions: OpenAI's default of 16 (at most the cap), which the server also bounds
    # by the room the context leaves the prompt (chat's omitted max_tokens is that room)
    default_max_tokens: int | None = None

    def extras(self) -> dict:
        """The sampling fields past the basic ones (EXTRA_SAMPLING) that this request sets to something other than
        their default (the neutral value), as a runner's `sampling` (and SamplingParams) take them."""
        default = {f.name: f.default for f in dataclasses.fields(self)}
        out = {k: getattr(self, k) for k in EXTRA_SAMPLING if getattr(self, k) != default[k]}
        if self.echo and self.logprobs is not None:
            out["prompt_logprobs"] = self.logprobs
        return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _number(body: dict, key: str, default, lo: float, hi: float, *, lo_open=False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not _is_num(v) or v != v:
        raise bad(key, f"{key} must be a number")
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad(key, f"{key} must be {'>' if lo_open else '>='} {lo} and <= {hi}, got {v}")
    return float(v)


def _integer(body: dict, key: str, default, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise bad(key, f"{key} must be an integer")
    if not (lo <= v <= hi):
        raise bad(key, f"{key} must be between {lo} and {hi}, got {v}")
    return v


def known_fields(chat: bool) -> frozenset:
    return COMMON_FIELDS | IGNORED | (CHAT_FIELDS if chat else COMPLETION_FIELDS)


def _refuse_unknown(body: dict, chat: bool) -> None:
    unknown = sorted(k for k in body if k not in known_fields(chat))
    if unknown:
        takes = ", ".join(sorted(COMMON_FIELDS | (CHAT_FIELDS if chat else COMPLETION_FIELDS)))
        raise bad(shown_name(unknown[0]),
                  f"unrecognized request argument(s): {shown_names(unknown)} (this endpoint takes {takes})")


def shown_name(name: str) -> str:
    """A name the client sent (a field's, a model's) as an error message repeats it: cut to 40 characters, so
    that a name of megabytes does not come back whole."""
    return name[:40]


def shown_names(keys: list[str]) -> str:
    """Unknown field names for an error message: the first three, each cut (shown_name)."""
    shown = ", ".join(repr(shown_name(k)) for k in keys[:3])
    return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def _check_ignored(body: dict) -> None:
    """The OpenAI fields this server accepts and ignores (IGNORED) must still have their types, so that a
    malformed request is not taken silently: user, service_tier, safety_identifier and prompt_cache_key strings,
    store a boolean, metadata an object of strings."""
    for key in ("user", "service_tier", "safety_identifier", "prompt_cache_key"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise bad(key, f"{key} must be a string")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise bad("store", "store must be true or false")
    meta = body.get("metadata")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise bad("metadata", "metadata must be an object of string values")


def _refuse_unsupported(body: dict, chat: bool) -> None:
    # (each only at the neutral value itself: not `true` for best_of 1, nor 0, [] or false for an unset field)
    best_of = body.get("best_of")
    if best_of not in (None, 1) or isinstance(best_of, bool):
        raise bad("best_of", "best_of is not supported")
    if body.get("suffix") not in (None, ""):
        raise bad("suffix", "suffix is not supported")
    for key in OFF_ONLY:
        v = body.get(key)
        if not (v is None or v is False or v == "none"):
            raise bad(key, f"{key} is not supported")
    for key, neutral in NEUTRAL.items():
        v = body.get(key)
        if v is not None and (type(v) is not type(neutral) and not (_is_num(v) and _is_num(neutral)) or v != neutral):
            raise bad(key, f"{key} is not supported (only {json.dumps(neutral)})")
    rf = body.get("response_format")
    if rf not in (None,) and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad("response_format", "only response_format {\"type\": \"text\"} is supported")


def parse_common(body: dict, chat: bool, max_tokens_cap: int, vocab_size: int | None = None) -> GenParams:
    """The sampling and output fields shared by both endpoints; `max_tokens_cap` bounds max_tokens, `vocab_size`
    (where known) the stop token ids."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model must be a non-empty string naming the base model or an adapter")
    _refuse_unknown(body, chat)
    _check_ignored(body)
    _refuse_unsupported(body, chat)
    echo = False if chat else _boolean(body, "echo", False)
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    # max_tokens 0 with echo: the prompt scored, nothing generated
    max_tokens = _integer(body, key, None, 0 if echo else 1, max_tokens_cap)
    if key != "max_tokens":  # chat: the max_tokens that max_completion_tokens overrides is still checked
        _integer(body, "max_tokens", None, 1, max_tokens_cap)
    default_max = None if chat or max_tokens is not None else min(COMPLETION_DEFAULT_TOKENS, max_tokens_cap)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str) and stop:
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= MAX_STOP:
        stop = tuple(stop)
    else:
        raise bad("stop", f"stop must be a non-empty string or a list of up to {MAX_STOP} non-empty strings")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise bad("stop", f"a stop string may be at most {MAX_STOP_CHARS} characters long, got "
                          f"{max(len(s) for s in stop)}")
    stop_ids = [] if body.get("stop_token_ids") is None else body["stop_token_ids"]
    if isinstance(stop_ids, list) and len(stop_ids) > MAX_STOP_TOKEN_IDS:  # (before a walk over millions of items)
        raise bad("stop_token_ids", f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_ids)}")
    stop_ids = _integral_ids(stop_ids)
    if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
        raise bad("stop_token_ids", "stop_token_ids must be a list of token ids")
    if vocab_size is not None and any(t >= vocab_size for t in stop_ids):
        raise bad("stop_token_ids", f"stop_token_ids must be in [0, {vocab_size}), got {max(stop_ids)}")
    stream = _boolean(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "stream_options must be an object like {\"include_usage\": true}")
    if opts is not None and any(k != "include_usage" for k in opts):
        raise bad("stream_options", f"unrecognized stream option(s): "
                                    f"{shown_names([k for k in opts if k != 'include_usage'])} (takes include_usage)")
    if opts is not None and not isinstance(opts.get("include_usage", False), (bool, type(None))):
        raise bad("stream_options.include_usage", "stream_options.include_usage must be true or false")
    if opts is not None and not stream:
        raise bad("stream_options", "stream_options is only allowed when stream is true")
    top_k = _integer(body, "top_k", -1, -1, 1 << 30)
    logprobs = _parse_logprobs(body, chat)
    min_tokens = _integer(body, "min_tokens", 0, 0, max_tokens_cap)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad("min_tokens", f"min_tokens ({min_tokens}) must not exceed {key} ({max_tokens})")
    if default_max is not None and min_tokens > default_max:
        raise bad("min_tokens", f"min_tokens ({min_tokens}) must not exceed max_tokens (omitted: {default_max})")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT):
        raise bad("cache_salt", f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters")
    return GenParams(
        model=model,
        n=_integer(body, "n", 1, 1, MAX_N),
        max_tokens=max_tokens,
        default_max_tokens=default_max,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k in (-1, 0) else top_k,
        seed=_integer(body, "seed", None, -INT64, INT64 - 1),
        stop=stop,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_boolean(body, "ignore_eos", False),
        stream=stream,
        include_usage=bool(opts and opts.get("include_usage")),
        cache_salt=salt,
        logprobs=logprobs,
        echo=echo,
        priority=_integer(body, "priority", 0, -(2**31), 2**31 - 1),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, lo_open=True),
        logit_bias=_parse_logit_bias(body, vocab_size),
        min_tokens=min_tokens,
        skip_special_tokens=_boolean(body, "skip_special_tokens", True),
        include_stop_str_in_output=_boolean(body, "include_stop_str_in_output", False),
    )


def _boolean(body: dict, key: str, default: bool) -> bool:
    """A boolean field (null or absent: `default`); anything else is a 400 naming it."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(key, f"{key} must be a boolean")
    return v


def _parse_logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """`logit_bias`: an object of token ids (as strings, OpenAI's form) to numbers in [-100, 100] added to those
    tokens' logits, at most MAX_LOGIT_BIAS of them; sorted (id, bias) pairs."""
    lb = body.get("logit_bias")
    if lb is None:
        return ()
    if not isinstance(lb, dict):
        raise bad("logit_bias", "logit_bias must be an object mapping token ids to numbers")
    if len(lb) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"logit_bias may bias at most {MAX_LOGIT_BIAS} tokens, got {len(lb)}")
    out: dict[int, float] = {}
    for k, v in lb.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 12) or (
                vocab_size is not None and int(k) >= vocab_size):
            raise bad("logit_bias", f"logit_bias keys must be token ids{f' in [0, {vocab_size})' if vocab_size else ''}, "
                                    f"got {k!r}")
        if not _is_num(v) or not -100 <= v <= 100:
            raise bad("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {k}")
        if int(k) in out:  # "7" and "07": two keys, one token
            raise bad("logit_bias", f"logit_bias names token {int(k)} twice ({k!r} and another spelling of it)")
        out[int(k)] = float(v)
    return tuple(sorted(out.items()))


def _parse_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each generated token's log-probability comes with, or None (not asked). Chat:
    `logprobs` true, with `top_logprobs` alternatives (0 to 20; only with logprobs true). Completions: `logprobs`
    as a number of alternatives (0 to 20)."""
    lp = body.get("logprobs")
    if not chat:
        return None if lp is False else _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    lp = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top and not lp:
        raise bad("top_logprobs", "top_logprobs needs logprobs set to true")
    return (top or 0) if lp else None


def _integral(xs: list) -> list:
    """Token ids written as integral floats (`5.0`, which JSON Schema counts as integers) become ints."""
    return [int(t) if isinstance(t, float) and t.is_integer() and abs(t) < 2**63 else t for t in xs]


def _integral_ids(p):
    """`_integral` for a list of ids or a list of id lists (anything else as it is)."""
    if isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        return [_integral(x) for x in p]
    if isinstance(p, list) and not any(isinstance(x, str) for x in p):
        return _integral(p)
    return p


def _prompt_list(body: dict) -> list:
    """A completions `prompt` as its list of prompts: itself where it is a list of strings or id lists (told by its
    first item), else a list of the one prompt."""
    p = body.get("prompt")
    return p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]


def prompt_sizes(body: dict, max_model_len: int) -> tuple[int, int]:
    """How many prompts a completions `prompt` holds and how many token ids its id lists hold together, found
    without looking into them (so that budgets are checked before a walk over millions of ids): more than
    MAX_PROMPTS prompts is a 400, and so is an id list as long as the context (context_length_exceeded)."""
    prompts = _prompt_list(body)
    if len(prompts) > MAX_PROMPTS:
        raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    ids = 0
    for x in prompts:
        if isinstance(x, list):
            if len(x) >= max_model_len:
                raise context_exceeded("prompt", f"prompt has {len(x)} tokens; this model's maximum context "
                                                 f"length is {max_model_len} tokens")
            ids += len(x)
    return len(prompts), ids


def parse_prompts(body: dict, vocab_size: int) -> list[str | list[int]]:
    """A completions `prompt`: a string, a list of strings, a list of ids, or a list of id lists. Its sizes are the
    caller's to check first (`prompt_sizes`, before any prompt is looked into)."""
    shape = "prompt must be a non-empty string, list of strings, list of token ids, or list of those"
    prompts = _prompt_list(body)
    texts = isinstance(prompts[0], str)
    out = []
    for x in prompts:
        if texts and isinstance(x, str):
            if not x:
                raise bad("prompt", "prompt must not be empty")
            out.append(x)
            continue
        if texts or not isinstance(x, list) or not x:
            raise bad("prompt", shape)
        ids = _integral(x)
        if not all(_is_int(t) for t in ids):
            raise bad("prompt", shape)
        if any(t < 0 or t >= vocab_size for t in ids):
            raise bad("prompt", f"token ids must be in [0, {vocab_size})")
        out.append(ids)
    return out


ROLES = ("system", "user", "assistant", "tool", "developer")
# a message's fields: `name`, `tool_call_id` and `refusal` strings (accepted; the chat template gets role and content
# only); `tool_calls`, `function_call` and `audio` only unset (null; tool_calls also []), as clients replaying a
# history send them
MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id", "refusal", "tool_calls", "function_call", "audio")


class ChatMessages(list):
    """A chat request's messages (dicts of role and text content), with the extra variables
    its `chat_template_kwargs` gives the chat template."""

    template_kwargs: dict

    def __init__(self, messages: list[dict], template_kwargs: dict | None = None):
        super().__init__(messages)
        self.template_kwargs = dict(template_kwargs or {})


def _finite_json(v) -> bool:
    """True when `v` holds no NaN or infinity (what Python's json parser lets through)."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, float) and not math.isfinite(x):
            return False
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return True


def parse_template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs`: an object of extra chat template variables (e.g. {"enable_thinking": false});
    it may not set what the server sets itself (messages, add_generation_prompt, tools, documents, the
    special tokens, the template's functions)."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise bad("chat_template_kwargs", "chat_template_kwargs must be an object of template variables")
    for key, value in kw.items():
        if key in RESERVED_TEMPLATE_VARS:
            raise bad("chat_template_kwargs", f"chat_template_kwargs may not set {key!r}: the server sets it")
        if not _finite_json(value):
            raise bad("chat_template_kwargs", f"chat_template_kwargs.{key} must be a JSON value (no NaN or Infinity)")
    return kw


def parse_messages(body: dict) -> ChatMessages:
    """`messages` as role + text dicts (text parts joined), carrying the request's `chat_template_kwargs`."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "each message must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"role must be one of {', '.join(ROLES)}")
        unknown = [k for k in m if k not in MESSAGE_FIELDS]
        if unknown:
            raise bad(f"messages[{i}].{shown_name(unknown[0])}", f"unrecognized message field(s): "
                      f"{shown_names(unknown)} (a message takes {', '.join(MESSAGE_FIELDS)})")
        for key in ("name", "tool_call_id", "refusal"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise bad(f"messages[{i}].{key}", f"{key} must be a string")
        if m.get("tool_calls") not in (None, []):
            raise bad(f"messages[{i}].tool_calls", "tool calls are not supported")
        for key in ("function_call", "audio"):
            if m.get(key) is not None:
                raise bad(f"messages[{i}].{key}", f"{key} in a message is not supported")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content[{j}]", "only text content parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "content must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return ChatMessages(out, parse_template_kwargs(body))


# -- responses --------------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens a runner's prefix cache held (not computed again)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_body(rid: str, model: str, chat: bool, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": use}


def choice(index: int, text: str, finish_reason: str | None, chat: bool, logprobs: dict | None = None) -> dict:
    if chat:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chunk(rid: str, model: str, chat: bool, index: int, text: str | None, finish_reason: str | None,
          role: bool = False, logprobs: dict | None = None) -> dict:
    if chat:
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        ch = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        ch = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [ch]}


def _top_dict(pairs) -> dict:
    """Completions' {token text: log-probability}, most likely first; two tokens of one text (byte-level pieces
    of characters read as U+FFFD) keep the first, larger, value."""
    out: dict = {}
    for text, v in pairs:
        out.setdefault(text, _finite_lp(v))
    return out


def _finite_lp(v: float) -> float:
    """A log-probability JSON can carry: -inf (and NaN, which a sound model never gives) as MIN_LOGPROB."""
    return v if v >= MIN_LOGPROB else MIN_LOGPROB  # (NaN compares false)


class LogprobsWriter:
    """One choice's log-probabilities in OpenAI's shapes, token by token as they come (`take` gives the object
    for the tokens added since the last `take`; `text_offset` of completions keeps counting across takes).

    Each entry is (token id, [log-probability, [[id, log-probability], ...]]) as a runner reports it (the model's
    own distribution: the logits' log-softmax, before temperature, top-k and top-p). A token's text is its bytes
    (`Tokenizer.token_bytes`, special tokens spelt out) read as UTF-8, a byte sequence cut inside a character
    as U+FFFD; chat entries carry the exact `bytes` too."""

    def __init__(self, tok, chat: bool, skip_special_tokens: bool = True):
        self.tok, self.chat, self.skip = tok, chat, skip_special_tokens  # skip: the choice's text leaves them out
        self.entries: list[tuple[int, list]] = []
        self.offsets: list[int] = []  # completions: each entry's text_offset
        self.offset = 0  # where the next generated token's text starts in the choice's text

    def add(self, ids: list[int], lps: list, texts: list[str] | None = None) -> None:
        """Generated tokens' entries; `texts`: the text each adds to the choice's text (its offsets follow them;
        a special token adds none where the text leaves it out)."""
        self.entries.extend(zip(ids, lps))
        for t in texts if texts is not None else [""] * len(ids):
            self.offsets.append(self.offset)
            self.offset += len(t)

    def add_prompt(self, ids: list[int], lps: list, text: str) -> None:
        """An echoed prompt's tokens (`text`: the echoed text): the first has no log-probability (null), the others
        `lps` (as many as there are; a shorter list, from a runner that gave none, leaves the rest null); their
        offsets index `text`."""
        self.entries.extend(zip(ids, [None, *lps, *[None] * (len(ids) - 1 - len(lps))]))
        offsets = self.tok.text_offsets(ids, text)
        if offsets is None:  # text decoded from the ids: each token's place in it (one incremental pass)
            from lorafleet.scheduler.detokenizer import IncrementalDetokenizer

            d, offsets, pos = IncrementalDetokenizer(self.tok, [], skip_special_tokens=self.skip), [], 0
            for i in ids:
                offsets.append(pos)
                d.push([i])
                pos += len(d.last_new)
        self.offsets += offsets
        self.offset = len(text)

    def _token(self, i: int) -> tuple[str, bytes]:
        b = self.tok.token_bytes(i)
        return b.decode("utf-8", "replace"), b

    def take(self) -> dict | None:
        if not self.entries:
            return None
        entries, self.entries = self.entries, []
        if self.chat:
            content = []
            for i, (lp, top) in entries:
                text, b = self._token(i)
                content.append({"token": text, "logprob": _finite_lp(lp), "bytes": list(b), "top_logprobs": [
                    {"token": t, "logprob": _finite_lp(v), "bytes": list(tb)}
                    for t, tb, v in ((*self._token(j), v) for j, v in top)]})
            return {"content": content}
        offsets, self.offsets = self.offsets[:len(entries)], self.offsets[len(entries):]
        return {"tokens": [self._token(i)[0] for i, _ in entries],
                "token_logprobs": [None if e is None else _finite_lp(e[0]) for _, e in entries],
                "top_logprobs": [None if e is None else _top_dict((self._token(j)[0], v) for j, v in e[1])
                                 for _, e in entries],
                "text_offset": offsets}


_json_text = json.JSONEncoder(ensure_ascii=False).encode
_json_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # (a stream's chunks all alike)


class ChunkEncoder:
    """SSE `data:` lines of one streamed API call, as bytes, without building a dict per token.

    The fixed parts of a text chunk (id, object, created, model, index) are encoded once; each
    token's text is one JSON string encode. Every chunk compact (no spaces after separators), the same bytes
    as `chunk()` gives for a text chunk."""

    def __init__(self, rid: str, model: str, chat: bool, created: int | None = None):
        self.rid, self.model, self.chat = rid, model, chat
        self.created = int(time.time()) if created is None else created
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (f'data: {{"id":{_json_text(rid)},"object":"{obj}","created":{self.created},'
                      f'"model":{_json_text(model)},"choices":[{{"index":').encode()
        self._mid = b',"delta":{"content":' if chat else b',"text":'
        self._tail = (b'},"logprobs":null,"finish_reason":null}]}\n\n' if chat
                      else b',"logprobs":null,"finish_reason":null}]}\n\n')

    def text(self, index: int, text: str, logprobs: dict | None = None) -> bytes:
        if logprobs is not None:
            return self.chunk(index, text, None, logprobs=logprobs)
        return b"".join((self._head, str(index).encode(), self._mid, _json_text(text).encode(), self._tail))

    def event(self, obj: dict) -> bytes:
        return b"data: " + _json_compact(obj).encode() + b"\n\n"

    def chunk(self, index: int, text: str | None, finish_reason: str | None, role: bool = False,
              logprobs: dict | None = None) -> bytes:
        c = chunk(self.rid, self.model, self.chat, index, text, finish_reason, role, logprobs)
        c["created"] = self.created
        return self.event(c)

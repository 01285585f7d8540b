"""JSON request bodies: parsed off the event loop, bounded, and checked for text that cannot
be tokenized, so bad input is a 400 that names the field, never a 500.

`parse_body` is blocking (the server runs it in a worker thread): `json.loads`, then one walk
over the result that refuses nesting deeper than MAX_DEPTH and strings with lone UTF-16
surrogates (`"\\ud800"` is valid JSON but not valid Unicode text; tokenizers reject it).
"""

from __future__ import annotations

import json
import re

from lorafleet.scheduler.openai_api import ApiError

MAX_DEPTH = 32
_SURROGATE = re.compile("[\ud800-\udfff]")


def _bad_json(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_json")


def _path(parent: str, key) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else str(key)


def _check_text(s: str, where: str) -> None:
    if not s.isascii() and _SURROGATE.search(s):
        raise ApiError(400, f"{where or 'body'} contains invalid Unicode (a lone surrogate such as \\ud800)",
                       param=where or None, code="invalid_unicode")


def check_tree(value, max_depth: int = MAX_DEPTH) -> None:
    """Refuse nesting deeper than `max_depth` and lone surrogates in any string or key."""
    stack = [(value, "", 0)]
    while stack:
        v, where, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v, where)
        elif isinstance(v, (dict, list)):
            if depth >= max_depth:
                raise _bad_json(f"JSON nested deeper than {max_depth} levels", where or None)
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, child in items:
                if isinstance(k, str):
                    _check_text(k, where)
                stack.append((child, _path(where, k), depth + 1))


def parse_body(raw: bytes) -> dict:
    """The request body as a dict; ApiError(400) for anything else.

    NaN and Infinity are parsed (as Python's json does) so the field validators can name the
    field they landed in."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _bad_json(f"JSON nested deeper than {MAX_DEPTH} levels") from None
    except UnicodeDecodeError as exc:
        raise _bad_json(f"request body is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
    except ValueError:
        raise _bad_json("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise _bad_json("request body must be a JSON object")
    check_tree(body)
    return body

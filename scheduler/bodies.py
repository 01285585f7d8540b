"""JSON request bodies: parsed off the event loop, bounded, and checked for text that cannot
be tokenized, so bad input is a 400 that names the field, never a 500.

`parse_body` is blocking (the server runs it in a worker thread): `json.loads` (with the cyclic
garbage collector paused), then one walk over the result that refuses nesting deeper than
MAX_DEPTH, strings with lone UTF-16 surrogates (`"\\ud800"` is valid JSON but not valid
Unicode text; tokenizers reject it) and objects that give a key twice (valid JSON too, but
one of the values would be dropped unseen).
"""

from __future__ import annotations

import gc
import json
import re
import threading
from contextlib import contextmanager

from lorafleet.scheduler.openai_api import ApiError, shown_name

MAX_DEPTH = 32
_SURROGATE = re.compile("[\ud800-\udfff]")


_gc_lock = threading.Lock()
_gc_holders = 0  # parses under way with the collector paused
_gc_was_enabled = False


@contextmanager
def _collector_paused():
    """The cyclic garbage collector off while a body is parsed (in whichever thread, however many at once).

    `json.loads` holds the GIL while it builds lists and strings, and each list or object it makes counts toward
    the next collection: a body of millions of small lists (`[[0]] * 2_000_000`, 8 MB) set off a dozen full
    collections over the growing tree within one parse, well over a second in which no other thread ran (the
    event loop included) for about 0.25 s of parsing. The tree has no cycles; paused, the collector walks it
    once, at its next collection after."""
    global _gc_holders, _gc_was_enabled
    with _gc_lock:
        if _gc_holders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_enabled:
                gc.enable()


def _bad_json(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_json")


def _path(parent: str, key) -> str:
    """`parent`'s item `key` (`prompt[1]`, `messages[0].content`); a key the client sent is cut (shown_name)."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{shown_name(key)}" if parent else shown_name(key)


def _bad_text(where: str) -> ApiError:
    return ApiError(400, f"{where or 'body'} contains invalid Unicode (a lone surrogate such as \\ud800)",
                    param=where or None, code="invalid_unicode")


def _lone_surrogate(s: str) -> bool:
    return not s.isascii() and _SURROGATE.search(s) is not None


class _RepeatedKey(dict):
    """A JSON object of the body that gives a key more than once (`key`: the first such); `check_tree` refuses it."""

    key: str


def _object(pairs: list) -> dict:
    """`json.loads`' object_pairs_hook: the object as a dict, or a _RepeatedKey where a key appears twice (plain
    `json.loads` keeps the last value and drops the others unseen)."""
    d = dict(pairs)
    if len(d) == len(pairs):
        return d
    seen = set()
    repeated = _RepeatedKey(d)
    repeated.key = next(k for k, _ in pairs if k in seen or seen.add(k))
    return repeated


class _Refused(Exception):
    """A node `check_tree` refuses (`why`: deep, text or repeated); `keys` is its path from the node up, filled in
    as the walk unwinds."""

    def __init__(self, why: str, keys: list):
        self.why, self.keys = why, keys


def _walk(v, depth: int, max_depth: int) -> None:
    if depth >= max_depth:
        raise _Refused("deep", [])
    if type(v) is dict:
        for k in v:
            if _lone_surrogate(k):
                raise _Refused("text", [])  # (named by the object that holds the key)
        items = v.items()
    else:
        items = enumerate(v)
    for k, child in items:
        t = type(child)
        if t is str:
            if _lone_surrogate(child):
                raise _Refused("text", [k])
        elif t is list or t is dict:
            try:
                _walk(child, depth + 1, max_depth)
            except _Refused as exc:
                exc.keys.append(k)
                raise
        elif t is _RepeatedKey:
            raise _Refused("repeated", [child.key, k])


def check_tree(value, max_depth: int = MAX_DEPTH) -> None:
    """Refuse nesting deeper than `max_depth`, lone surrogates in any string or key of `value` (what
    `parse_body`'s `json.loads` gives) and an object that gives a key twice. One recursive pass (as
    deep as `max_depth` at most) that keeps no list of nodes to visit: the path that names the field
    (`prompt[1]`, `messages[0].content`) is built only for the node refused, as the walk unwinds from it."""
    if type(value) is str:
        if _lone_surrogate(value):
            raise _bad_text("")
        return
    try:
        if type(value) is _RepeatedKey:
            raise _Refused("repeated", [value.key])
        if type(value) is not list and type(value) is not dict:
            return
        _walk(value, 0, max_depth)
    except _Refused as exc:
        where = ""
        for k in reversed(exc.keys):
            where = _path(where, k)
        if exc.why == "deep":
            raise _bad_json(f"JSON nested deeper than {max_depth} levels", where or None) from None
        if exc.why == "repeated":
            raise _bad_json(f"{where} is given more than once (a key may appear once in a JSON object)",
                            where) from None
        raise _bad_text(where) from None


def parse_body(raw: bytes) -> dict:
    """The request body as a dict; ApiError(400) for anything else.

    NaN and Infinity are parsed (as Python's json does) so the field validators can name the
    field they landed in."""
    try:
        with _collector_paused():
            body = json.loads(raw, object_pairs_hook=_object)
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

"""Optional API keys for the OpenAI endpoints (`--api-keys FILE`, env LORAFLEET_API_KEYS_FILE).

File format, one key per line:

    KEY                      # may use every model
    KEY  pirate,shouty       # may use only these (the base model's name may be listed too)
    KEY  cache_group=team-a  # its requests share the prefix cache only with team-a's keys
    KEY  pirate cache_group=team-a
    KEY  max_concurrent=16   # at most 16 sequences of this key's requests in flight at once (else 429)
    KEY  priority=5          # its requests queue behind those of priority < 5 (a request may ask for a larger value)

Blank lines and `#` comments are ignored (so a key cannot hold `#` or whitespace). A key holds no quote, brace or
bracket, is not `-` and does not end in `:`, so a YAML or JSON file given by mistake is refused, not read as keys
nobody meant. Clients send `Authorization: Bearer KEY`. A
missing or wrong key is a 401; a model the key may not use answers 404 exactly like a model
that does not exist (its existence is not revealed), and `/v1/models` lists only what the
key may use. The file is re-read when it changes (checked at most every `reload_s`); a file
that became unreadable or malformed keeps the keys loaded before and logs the error. Keys are
held only as sha256 digests.

Prefix cache salts (docs/security.md): a key with `cache_group=NAME`, and with `salt_per_key`
(`--cache-salt-per-key`) every key without a group, salts all its requests, so the runners'
prefix cache is shared only among the requests of one group (or one key) and a tenant cannot
learn another's prompts from cache hits. The salt is a one-way hash of the key's digest (or of
the group's name); it never reveals the key and is neither logged nor sent to clients.
`cache_salt()` mixes it with a request's own `cache_salt`.

Concurrency limits: a key with `max_concurrent=N` has at most N sequences (prompts x n) queued or running at
once; a request that would pass the limit is answered 429 `too_many_concurrent_requests` with Retry-After,
so one tenant cannot fill the queue of all the others. The count is the scheduler's own (one scheduler per
pool); a key edited in the file keeps the count of its requests in flight.

Priorities: a key with `priority=N` has its requests queued (in the scheduler and on the runners) at priority N
or a larger value a request asks for (lower values go first, vLLM's convention); without it a request's own
`priority` (default 0) stands. Priority orders the queues; it does not stop requests already running.
"""

from __future__ import annotations

import hashlib
import logging
import re
import os
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from lorafleet.scheduler.openai_api import ApiError

log = logging.getLogger(__name__)


class ApiKeyFileError(ValueError):
    """The key file cannot be used; the message says which line and why (never the key)."""


@dataclass(frozen=True)
class Grant:
    """What one key may use: `models` None means every model."""

    models: frozenset[str] | None = None
    cache_salt: str | None = None  # mixed into every request's prefix cache salt (`cache_salt()`)
    max_concurrent: int | None = None  # sequences of this key in flight at once (None: no limit)
    priority: int | None = None  # the lowest priority value its requests may have (None: any)
    ident: str = ""  # names the key where its requests are counted (a digest prefix; never the key)

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


ANYONE = Grant()  # no key file: no authentication


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _salt(domain: str, data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16, person=b"lorafleet-salt", salt=domain.encode()).hexdigest()


def key_salt(digest: bytes) -> str:
    """The prefix cache salt of one key (from its sha256 digest; the key cannot be read back from it)."""
    return _salt("key", digest)


def group_salt(name: str) -> str:
    """The prefix cache salt of a `cache_group`."""
    return _salt("group", name.encode("utf-8", "surrogatepass"))


def cache_salt(grant_salt: str | None, request_salt: str | None) -> str | None:
    """The salt a runner keys a request's prefix cache pages with: None when neither is set, else a hash of
    both, so a request's own salt can never name another key's or group's salt."""
    if grant_salt is None and request_salt is None:
        return None
    data = f"{grant_salt or ''}\0{request_salt or ''}".encode("utf-8", "surrogatepass")
    return _salt("request", data)


NOT_IN_A_KEY = frozenset("\"'{}[]")  # (with a key of `-` or one ending in `:`: a YAML or JSON file)


def parse_keys(text: str, salt_per_key: bool = False) -> dict[bytes, Grant]:
    """sha256(key) -> Grant; ApiKeyFileError for a malformed line or a repeated key. `salt_per_key`: a key
    without a `cache_group` gets a cache salt of its own."""
    keys: dict[bytes, Grant] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if fields[0] == "-" or fields[0].endswith(":") or NOT_IN_A_KEY.intersection(fields[0]):
            raise ApiKeyFileError(f"line {n}: this looks like YAML or JSON, not a key; the file holds one key per "
                                  "line: `KEY [model,model,...] [option=value ...]`")
        options = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
        rest = [f for f in fields[1:] if "=" not in f]
        if len(rest) > 1 or len(options) != len(fields) - 1 - len(rest):
            # (the fields are not echoed: a misplaced one may be a key)
            what = (f"{len(rest)} space-separated fields after the key where one model list may stand" if len(rest) > 1
                    else "an option given twice")
            raise ApiKeyFileError(f"line {n}: {what}; expected `KEY [model,model,...] [cache_group=NAME] "
                                  "[max_concurrent=N] [priority=N]` (no spaces in the list)")
        unknown = sorted(set(options) - {"cache_group", "max_concurrent", "priority"})
        if unknown:
            raise ApiKeyFileError(f"line {n}: unknown option {unknown[0]!r} (known: cache_group, max_concurrent, "
                                  "priority)")
        floor = None
        if "priority" in options:
            v = options["priority"]
            if not (re.fullmatch(r"-?[0-9]{1,10}", v) and -(2**31) <= int(v) < 2**31):
                raise ApiKeyFileError(f"line {n}: priority must be a whole number (32-bit)")
            floor = int(v)
        limit = None
        if "max_concurrent" in options:
            v = options["max_concurrent"]
            if not (v.isascii() and v.isdigit() and 1 <= int(v) <= 1_000_000):
                raise ApiKeyFileError(f"line {n}: max_concurrent must be a whole number from 1 to 1000000")
            limit = int(v)
        digest = _digest(fields[0])
        if digest in keys:
            raise ApiKeyFileError(f"line {n}: this key appears twice")
        models = None
        if rest:
            models = frozenset(m for m in rest[0].split(",") if m)
            if not models:
                raise ApiKeyFileError(f"line {n}: empty model list")
        salt = None
        if "cache_group" in options:
            if not options["cache_group"]:
                raise ApiKeyFileError(f"line {n}: empty cache_group")
            salt = group_salt(options["cache_group"])
        elif salt_per_key:
            salt = key_salt(digest)
        keys[digest] = Grant(models, salt, limit, floor, digest.hex()[:16])
    return keys


class ApiKeys:
    """The key file, loaded at start (errors are fatal) and reloaded when it changes."""

    def __init__(self, path: Path | str, reload_s: float = 2.0, salt_per_key: bool = False):
        self.path = Path(path)
        self.reload_s = reload_s
        self.salt_per_key = salt_per_key
        self._stamp: tuple | None = None
        self._checked = 0.0
        self.keys: dict[bytes, Grant] = {}
        self._load(fatal=True)

    def _file_stamp(self) -> tuple:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load(self, fatal: bool) -> None:
        try:
            stamp = self._file_stamp()
            keys = parse_keys(self.path.read_text(encoding="utf-8"), self.salt_per_key)
        except (OSError, UnicodeDecodeError, ApiKeyFileError) as exc:
            msg = f"API key file {self.path}: {exc}"
            if fatal:
                raise ApiKeyFileError(msg) from None
            log.error("%s; keeping the %d key(s) loaded before", msg, len(self.keys))
            self._stamp = None
            return
        if not keys:
            log.warning("API key file %s holds no key: every request to /v1 is refused", self.path)
        log.info("API key file %s %s: %d key(s)", self.path, "loaded" if fatal else "reloaded", len(keys))
        self.keys, self._stamp = keys, stamp

    def maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.reload_s:
            return
        self._checked = now
        try:
            stamp = self._file_stamp()
        except OSError as exc:
            log.error("API key file %s: %s; keeping the %d key(s) loaded before", self.path, exc, len(self.keys))
            return
        if stamp != self._stamp:
            self._load(fatal=False)

    def authenticate(self, request: web.Request) -> Grant:
        """The caller's Grant; ApiError 401 for a missing or wrong key."""
        self.maybe_reload()
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "You didn't provide an API key. Send it as `Authorization: Bearer KEY`.",
                           type_="invalid_request_error", code="missing_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        grant = self.keys.get(_digest(token))
        if grant is None:
            raise ApiError(401, "Incorrect API key provided.", type_="invalid_request_error",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return grant

"""Per-pool credentials derived from one key, so the operator never reads a Secret of a pool.

The operator holds one random key (the chart keeps it in a Secret of the operator's own
namespace and mounts it as a file). Each pool's tokens are HMAC-SHA256 of that key over the
token's purpose, the namespace and the pool name:

    token = base64url(HMAC(key, purpose + "\\0" + namespace + "\\0" + pool))

- `admin`: the scheduler's admin API (`LORAFLEET_ADMIN_TOKEN`), which the operator calls;
- `runner`: what the scheduler presents to its runners (`LORAFLEET_RUNNER_TOKEN`).

The operator writes these into per-pool Secrets (create/patch) and computes them again when it
needs them, so it needs no get/list/watch on Secrets anywhere. A new key changes every token
and, through the fingerprint annotation on the pod templates, rolls the pods.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ADMIN = "admin"
RUNNER = "runner"
MIN_KEY_BYTES = 16


class KeyError_(ValueError):
    """The key file is missing, unreadable or too short."""


@dataclass(frozen=True)
class Credentials:
    """Derives the tokens of any pool from the operator's key."""

    key: bytes

    def __post_init__(self) -> None:
        if len(self.key) < MIN_KEY_BYTES:
            raise KeyError_(f"the credentials key must be at least {MIN_KEY_BYTES} bytes")

    def token(self, purpose: str, namespace: str, pool: str) -> str:
        msg = "\0".join((purpose, namespace, pool)).encode()
        return base64.urlsafe_b64encode(hmac.new(self.key, msg, hashlib.sha256).digest()).decode().rstrip("=")

    def admin_token(self, namespace: str, pool: str) -> str:
        return self.token(ADMIN, namespace, pool)

    def runner_token(self, namespace: str, pool: str) -> str:
        return self.token(RUNNER, namespace, pool)

    @property
    def fingerprint(self) -> str:
        """A short public id of the key (changes when the key does; reveals nothing of it)."""
        return hmac.new(self.key, b"fingerprint", hashlib.sha256).hexdigest()[:12]

    @classmethod
    def from_file(cls, path: str | Path) -> "Credentials":
        try:
            raw = Path(path).read_bytes().strip()
        except OSError as exc:
            raise KeyError_(f"cannot read the credentials key file {path}: {exc.strerror or exc}") from None
        if len(raw) < MIN_KEY_BYTES:
            raise KeyError_(f"the credentials key file {path} holds {len(raw)} bytes; at least "
                            f"{MIN_KEY_BYTES} are needed")
        return cls(raw)

    @classmethod
    def ephemeral(cls) -> "Credentials":
        """A random key for this process only (no key file): tokens change when the operator restarts."""
        log.warning("no credentials key file given (--credentials-key-file): using a random key; every pool's "
                    "tokens change, and its pods roll, when this operator restarts")
        return cls(secrets.token_bytes(32))

"""HTTP(S) GETs for sources under the source policy (stdlib only, blocking).

Every hop (the first URL and each redirect) is resolved once, checked by `SourcePolicy`,
and connected to at exactly the checked address; TLS still verifies the certificate
against the host name. A bearer credential is sent only to the origin it was given for:
a redirect to another scheme, host or port drops it. Redirects from https to http are
refused. Proxy variables are not used for sources (a proxy would resolve names itself).
"""

from __future__ import annotations

import http.client
import logging
import socket
import ssl
import urllib.parse
from dataclasses import dataclass

from lorafleet.common.source_errors import SourceRefused, SourceUnreachable
from lorafleet.common.source_policy import SourcePolicy

log = logging.getLogger(__name__)

MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)


class HTTPStatusError(Exception):
    """A final answer with status >= 400 (the caller classifies it)."""

    def __init__(self, url: str, status: int, reason: str):
        super().__init__(f"{url}: HTTP {status} {reason}")
        self.url, self.status, self.reason = url, status, reason


@dataclass(frozen=True)
class Origin:
    scheme: str
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> "Origin":
        p = urllib.parse.urlsplit(url)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise SourceRefused(f"{_public(url)}: only http and https URLs can be fetched")
        try:
            port = p.port or (443 if p.scheme == "https" else 80)
        except ValueError:
            raise SourceRefused(f"{_public(url)}: invalid port") from None
        return cls(p.scheme, p.hostname.lower(), port)


def _public(url: str) -> str:
    """The URL without user info, query or fragment (what messages may show)."""
    try:
        p = urllib.parse.urlsplit(url)
        host = p.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if p.port:
            netloc += f":{p.port}"
        return urllib.parse.urlunsplit((p.scheme, netloc, p.path, "", ""))
    except ValueError:
        return "<invalid URL>"


class _PinnedHTTP(http.client.HTTPConnection):
    """An HTTP connection to `host` made at the already checked `address`."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, address: str, timeout: float, context: ssl.SSLContext):
        super().__init__(host, port, timeout=timeout, context=context)
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def _connect(origin: Origin, address: str, timeout: float) -> http.client.HTTPConnection:
    if origin.scheme == "https":
        return _PinnedHTTPS(origin.host, origin.port, address, timeout, ssl.create_default_context())
    return _PinnedHTTP(origin.host, origin.port, address, timeout)


def open_url(url: str, *, timeout: float, token: str | None = None, policy: SourcePolicy | None = None,
             headers: dict | None = None) -> http.client.HTTPResponse:
    """GET `url` following up to MAX_REDIRECTS redirects under `policy`; the open response.

    `token` is sent as a bearer credential only to the first URL's origin. Raises
    SourceRefused (policy), SourceUnreachable (network) or HTTPStatusError (>= 400).
    """
    policy = policy or SourcePolicy.from_env()
    credential_origin = Origin.of(url)
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        origin = Origin.of(current)
        shown = _public(current)
        address = policy.resolve(origin.host, origin.port, shown)
        parts = urllib.parse.urlsplit(current)
        target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        send = {"User-Agent": "lorafleet", "Connection": "close", **(headers or {})}
        if token and origin == credential_origin:
            send["Authorization"] = f"Bearer {token}"
        conn = _connect(origin, address, timeout)
        try:
            conn.request("GET", target, headers=send)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException, ssl.SSLError) as exc:
            conn.close()
            log.info("source %s: %s at %s: %s", shown, type(exc).__name__, address, exc)
            raise SourceUnreachable(f"{shown}: unreachable") from None
        if resp.status in REDIRECTS:
            location = resp.getheader("Location")
            resp.close()
            conn.close()
            if not location:
                raise SourceUnreachable(f"{shown}: redirect without a Location")
            nxt = urllib.parse.urljoin(current, location)
            if origin.scheme == "https" and urllib.parse.urlsplit(nxt).scheme != "https":
                raise SourceRefused(f"{shown}: redirect from https to {urllib.parse.urlsplit(nxt).scheme or '?'} "
                                    "is not followed")
            current = nxt
            continue
        if resp.status >= 400:
            status, reason = resp.status, resp.reason
            resp.close()
            conn.close()
            raise HTTPStatusError(shown, status, reason)
        return resp
    raise SourceRefused(f"{_public(url)}: more than {MAX_REDIRECTS} redirects")

"""The operator's client of a pool scheduler's admin API (docs/api.md).

Errors become `SchedulerUnavailable` with a short, user-facing message (it ends up in
LoraAdapter and ServingPool statuses): what went wrong in words, never a Python exception's
text; the exception itself is logged at debug level.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

log = logging.getLogger(__name__)
# aiohttp >= 3.10 tells a failed name resolution apart from other connection failures.
_DNS_ERRORS: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(aiohttp, "ClientConnectorDNSError", None),) if t is not None)


class SchedulerUnavailable(Exception):
    """The scheduler did not answer, or answered that it cannot do this now (e.g. no runner)."""


def describe_failure(exc: BaseException, timeout: float) -> str:
    """A connection failure in words, for a status message."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, aiohttp.ServerTimeoutError)):
        return f"it did not answer within {timeout:g}s"
    if isinstance(exc, _DNS_ERRORS):
        return "its address does not resolve"
    if isinstance(exc, aiohttp.ClientConnectorError):
        if isinstance(exc.os_error, ConnectionRefusedError):
            return "the connection was refused (is its pod running?)"
        if isinstance(exc.os_error, OSError) and "Name or service not known" in str(exc.os_error):
            return "its address does not resolve"
        return "the connection failed"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "it closed the connection"
    if isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.ClientResponseError)):
        return "its answer was cut short or malformed"
    return "the connection failed"


class AdminClient:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str | None, timeout: float = 10.0):
        self._session = session
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._timeout_s = timeout

    async def _call(self, method: str, path: str, body: Any = None, *, accept_errors: bool = False) -> Any:
        try:
            async with self._session.request(method, self.base_url + path, json=body, headers=self._headers,
                                             timeout=self._timeout) as resp:
                try:
                    doc = await resp.json(content_type=None)
                except ValueError:
                    doc = None
                if resp.status >= 500 or resp.status in (401, 403, 404, 429):
                    detail = (doc or {}).get("error") if isinstance(doc, dict) else None
                    if isinstance(detail, dict):  # an OpenAI-shaped error
                        detail = detail.get("message")
                    detail = str(detail)[:200] if detail else None
                    raise SchedulerUnavailable(f"the pool's scheduler answered HTTP {resp.status} to {method} {path}"
                                               + (f": {detail}" if detail else ""))
                if resp.status >= 400 and not accept_errors:
                    raise SchedulerUnavailable(f"the pool's scheduler answered HTTP {resp.status} to {method} {path}")
                return doc
        except (aiohttp.ClientError, asyncio.TimeoutError, TimeoutError) as exc:
            log.debug("%s %s%s failed: %r", method, self.base_url, path, exc)
            raise SchedulerUnavailable(f"the pool's scheduler is not reachable: "
                                       f"{describe_failure(exc, self._timeout_s)}") from None

    async def state(self) -> dict:
        """GET /admin/state: {"runners": [...], "queue_length": n}."""
        doc = await self._call("GET", "/admin/state")
        if not isinstance(doc, dict):
            raise SchedulerUnavailable("the pool's scheduler answered GET /admin/state with something else than "
                                       "a JSON object")
        return doc

    async def drain(self, runner_id: str) -> dict:
        return await self._call("POST", f"/admin/runners/{runner_id}/drain") or {}

    async def undrain(self, runner_id: str) -> dict:
        return await self._call("POST", f"/admin/runners/{runner_id}/undrain") or {}

    async def validate(self, name: str, source: str, sha256: str | None) -> dict:
        """POST /admin/adapters/validate -> {"ok": true, ...} or {"ok": false, "error": ...}."""
        doc = await self._call("POST", "/admin/adapters/validate", {"name": name, "source": source, "sha256": sha256},
                               accept_errors=True)
        if not isinstance(doc, dict) or "ok" not in doc:
            raise SchedulerUnavailable("the pool's scheduler answered POST /admin/adapters/validate without 'ok'")
        return doc

    async def models(self) -> list[str]:
        """The names the scheduler serves now (GET /v1/models)."""
        doc = await self._call("GET", "/v1/models")
        return [str(m.get("id")) for m in (doc or {}).get("data") or () if isinstance(m, dict)]

"""The operator's client of a pool scheduler's admin API (docs/api.md)."""

from __future__ import annotations

from typing import Any

import aiohttp


class SchedulerUnavailable(Exception):
    """The scheduler did not answer, or answered that it cannot do this now (e.g. no runner)."""


class AdminClient:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str | None, timeout: float = 10.0):
        self._session = session
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout)

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
                    raise SchedulerUnavailable(f"{method} {path}: HTTP {resp.status}" + (f" ({detail})" if detail else ""))
                if resp.status >= 400 and not accept_errors:
                    raise SchedulerUnavailable(f"{method} {path}: HTTP {resp.status}")
                return doc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SchedulerUnavailable(f"scheduler at {self.base_url} unreachable ({exc!r})") from None

    async def state(self) -> dict:
        """GET /admin/state: {"runners": [...], "queue_length": n}."""
        doc = await self._call("GET", "/admin/state")
        if not isinstance(doc, dict):
            raise SchedulerUnavailable("GET /admin/state: not a JSON object")
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
            raise SchedulerUnavailable("POST /admin/adapters/validate: answer without 'ok'")
        return doc

    async def models(self) -> list[str]:
        """The names the scheduler serves now (GET /v1/models)."""
        doc = await self._call("GET", "/v1/models")
        return [str(m.get("id")) for m in (doc or {}).get("data") or () if isinstance(m, dict)]

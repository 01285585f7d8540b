"""Adapters a runner refused (bad files, unsupported features, unreachable source), or the registry did
when it published them (an `--adapters` directory's scan, see registry.py and server.py).

A refusal is logged once (again only if the reason changes), answered as a 400 naming the
adapter and the reason, and shown in `/v1/models` as `"status": "unavailable"`. Requests for
it are refused at once without bothering a runner until `retry_s` has passed; the next one
after that goes to a runner again (the files may have been fixed). A change of the adapter's
registry entry (new source or checksum) or its removal clears the mark.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class AdapterAvailability:
    def __init__(self, retry_s: float = 30.0):
        self.retry_s = retry_s
        self._refused: dict[str, tuple[str, float]] = {}  # name -> (reason, when)

    def refuse(self, name: str, reason: str) -> None:
        before = self._refused.get(name)
        if before is None or before[0] != reason:
            log.warning("adapter %r is unavailable: %s", name, reason)
        self._refused[name] = (reason, time.monotonic())

    def reason(self, name: str) -> str | None:
        """Why `name` is unavailable, or None (also when the mark is older than retry_s)."""
        got = self._refused.get(name)
        if got is None or time.monotonic() - got[1] > self.retry_s:
            return None
        return got[0]

    def listed_reason(self, name: str) -> str | None:
        """The last refusal still shown in /v1/models (kept until a request succeeds or it changes)."""
        got = self._refused.get(name)
        return got[0] if got else None

    def clear(self, name: str, *_ignored) -> None:
        if self._refused.pop(name, None) is not None:
            log.info("adapter %r: available again", name)

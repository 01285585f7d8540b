"""Which adapter a request uses: plain data, without torch (the runner's front builds these from requests)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterRef:
    """Which adapter a request uses and where the runner can load it from. `version` (optional) changes when the
    files at `source` change (a directory's adapters are rescanned): a new version is read again, never served from
    a copy of the old one."""

    name: str
    source: str
    sha256: str | None = None
    version: str | None = None

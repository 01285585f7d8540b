"""An aiohttp resolver that looks names up in an /etc/hosts-style file before DNS.

`LORAFLEET_HOSTS_FILE` (see env.py) names the file; it is read again whenever it changes, so
entries added while the process runs count at once. Lines are `ADDRESS NAME [NAME...]`, `#`
starts a comment. Names not in the file go to aiohttp's default resolver.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver


def parse_hosts(text: str) -> dict[str, str]:
    """name (lower case) -> address; the first entry of a name wins, as in /etc/hosts."""
    table: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) < 2:
            continue
        for name in words[1:]:
            table.setdefault(name.lower().rstrip("."), words[0])
    return table


class HostsFileResolver(AbstractResolver):
    def __init__(self, path: Path, fallback: AbstractResolver | None = None):
        self.path = path
        self.fallback = fallback or aiohttp.DefaultResolver()
        self._stamp: tuple[int, int] | None = None
        self._table: dict[str, str] = {}

    def table(self) -> dict[str, str]:
        try:
            st = self.path.stat()
        except OSError:
            return {}
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            try:
                self._table = parse_hosts(self.path.read_text())
            except (OSError, UnicodeDecodeError):
                return {}
            self._stamp = stamp
        return self._table

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[dict[str, Any]]:
        addr = self.table().get(host.lower().rstrip("."))
        if addr is None:
            return await self.fallback.resolve(host, port, family)
        fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
        return [{"hostname": host, "host": addr, "port": port, "family": fam, "proto": 0,
                 "flags": socket.AI_NUMERICHOST}]

    async def close(self) -> None:
        await self.fallback.close()


def client_session(hosts_file: Path | None, **kwargs: Any) -> aiohttp.ClientSession:
    """An aiohttp session that consults `hosts_file` first (a plain session when None)."""
    if hosts_file is None:
        return aiohttp.ClientSession(**kwargs)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(resolver=HostsFileResolver(hosts_file)), **kwargs)

"""The one source policy: where models and adapters may be fetched from.

Used by every fetch of the operator, the scheduler and the runners (through `sources.py`):

- Network destinations are checked *after* DNS resolution, on every redirect, and the
  connection goes to the address that was checked (no second lookup, so no DNS rebinding).
  Refused unless `LORAFLEET_ALLOW_PRIVATE_SOURCES=1`: loopback, private (RFC 1918, ULA),
  link-local, carrier-grade NAT and every other non-global address. Always refused:
  cloud metadata addresses (169.254.169.254 and friends), multicast, the unspecified address.
- Local paths (plain paths, `file://`, `pvc://`) must resolve, symlinks followed, to a place
  under one of the source roots: `LORAFLEET_SOURCE_ROOTS` (os.pathsep-separated), by default
  the cache directory (`LORAFLEET_CACHE`, which holds the demo and downloads) and the PVC
  mount root (`LORAFLEET_PVC_ROOT`).

Refusals raise `SourceRefused` with a message that names the source but not what the
address resolved to or whether anything answers there; details go to the log.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from lorafleet.common.source_errors import SourceRefused

log = logging.getLogger(__name__)

# Instance metadata services: AWS/GCP/Azure/OpenStack, AWS IPv6, ECS task metadata, Alibaba, Oracle.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "169.254.170.2", "100.100.100.200", "192.0.0.192"))
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_v4(ip: ipaddress._BaseAddress) -> ipaddress._BaseAddress:
    """The IPv4 address inside an IPv4-mapped or NAT64 IPv6 address (else `ip` itself)."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return ip.ipv4_mapped
        if ip in _NAT64:
            return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip


def address_refusal(address: str, allow_private: bool) -> str | None:
    """Why `address` may not be contacted (e.g. "loopback"), or None when it may."""
    try:
        ip = _embedded_v4(ipaddress.ip_address(address.split("%", 1)[0]))
    except ValueError:
        return "not an IP address"
    if ip in METADATA_ADDRESSES:
        return "cloud metadata address"
    if ip.is_multicast or ip.is_unspecified:
        return "multicast or unspecified address"
    if allow_private or ip.is_global:
        return None
    if ip.is_loopback:
        return "loopback address"
    if ip.is_link_local:
        return "link-local address"
    return "private or reserved address"





def default_roots() -> tuple[Path, ...]:
    from lorafleet import env

    return (env.cache_dir(), env.pvc_root())


@dataclass(frozen=True)
class SourcePolicy:
    """What sources may reach: private addresses or not, and the local roots."""

    allow_private: bool = False
    roots: tuple[Path, ...] = ()

    @classmethod
    def from_env(cls) -> "SourcePolicy":
        """LORAFLEET_ALLOW_PRIVATE_SOURCES and LORAFLEET_SOURCE_ROOTS (default: cache dir, PVC root)."""
        from lorafleet import env

        return cls(allow_private=env.allow_private_sources(), roots=env.source_roots() or default_roots())

    # -- network ---------------------------------------------------------------------------------
    def resolve(self, host: str, port: int, what: str) -> str:
        """The address to connect to for `host`: every address it resolves to must be allowed."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError, OSError) as exc:
            log.info("source %s: cannot resolve %r: %s", what, host, exc)
            from lorafleet.common.source_errors import SourceUnreachable

            raise SourceUnreachable(f"{what}: unreachable (host {host!r} could not be resolved)") from None
        addresses = list(dict.fromkeys(info[4][0] for info in infos))
        for addr in addresses:
            why = address_refusal(addr, self.allow_private)
            if why is not None:
                log.warning("source %s refused: %r resolves to %s (%s)", what, host, addr, why)
                raise SourceRefused(f"{what}: host {host!r} is not allowed by the source policy")
        return addresses[0]

    # -- local paths -----------------------------------------------------------------------------
    def confine(self, path: str | Path, what: str) -> Path:
        """`path` with every symlink resolved, if that lies under a source root; else SourceRefused."""
        p = Path(path)
        if not p.is_absolute():
            raise SourceRefused(f"{what}: a local source must be an absolute path")
        real = Path(os.path.realpath(p))
        for root in self.roots:
            r = Path(os.path.realpath(root))
            if real == r or r in real.parents:
                return real
        log.warning("source %s refused: %s resolves to %s, outside the source roots %s",
                    what, p, real, [str(r) for r in self.roots])
        raise SourceRefused(f"{what}: local path is outside the allowed source roots")

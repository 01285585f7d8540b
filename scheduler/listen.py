"""The listening socket of a server, bound before anything slow happens.

`lorafleet serve`, `lorafleet scheduler` and `lorafleet runner` bind their port first, so a port
that is taken is reported at once (a clear message, a non-zero exit, no traceback) instead of
after loading a model; the bound socket is then handed to aiohttp (no window for another
process). A host name is bound at the first address it resolves to (give 0.0.0.0 or :: for all).
"""

from __future__ import annotations

import errno
import socket


class ListenError(OSError):
    """The address cannot be listened on; the message says why in plain words."""


def bind(host: str, port: int) -> socket.socket:
    if not 0 <= port <= 65535:  # getaddrinfo would take it modulo 65536: another port than the one announced
        raise ListenError(f"cannot listen on {host}:{port}: a port is between 0 and 65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {host}:{port}: unknown host ({exc.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp does: TIME_WAIT is fine
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            from lorafleet import env

            another = env.port_hint().replace("<port>", str(port + 1 if port < 65535 else 8000))
            raise ListenError(f"port {port} on {host} is already in use (another server is listening there); "
                              f"stop it or choose another port, e.g. {another}") from None
        if exc.errno == errno.EACCES:
            raise ListenError(f"not allowed to listen on {host}:{port} (ports below 1024 need privileges)") from None
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock

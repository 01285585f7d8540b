"""The channel between a runner's HTTP front and its engine core process.

One `socket.socketpair()` (AF_UNIX, SOCK_STREAM); every message is a 4-byte big-endian
length followed by that many bytes of UTF-8 JSON (a JSON array whose first item names the
message). Nothing is pickled: the core is started with `subprocess` (not `multiprocessing`,
whose spawn start method unpickles its arguments), and both ends parse plain JSON only.

Why JSON from the standard library: the messages are small and few — one per engine step
for the whole batch, one per submit or cancel. Measured on a CPU of the development machine,
a step message of 32 outputs is 1.4 kB and costs 20 µs to encode (in the core) and 10 µs to
decode (in the front), about 1 µs per request-output, against GPU steps of ~10 ms; that needs
no extra dependency in the runner image and no schema step. What crosses, front → core:

    ["init", {"model": str, "config": {EngineConfig fields}}]        first message
    ["submit", {"id", "prompt_ids", "sampling": {...}, "adapter": {name, source, sha256}|null, "arrival"}]
    ["cancel", id]
    ["state"]                                                          ask for a snapshot now
    ["shutdown"]

core → front:

    ["ready", {"page_size", "max_model_len", "model", "base_shape": {...}, "max_lora_rank", "state": {...}}]
    ["step", [[id, [new token ids], finish_reason|null, error|null], ...], state|null]
    ["state", {...}]
    ["beat"]                                                            every second, from a thread of its own
    ["fatal", "reason"]                                                 then the core exits
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading

HEADER = struct.Struct(">I")
MAX_MESSAGE = 256 << 20  # a corrupt length must not make either side allocate without bound

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_loads = json.loads


class ChannelClosed(EOFError):
    """The other end closed the channel (or died)."""


def encode(msg: list) -> bytes:
    body = _dumps(msg).encode()
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> list:
    msg = _loads(body)
    if not isinstance(msg, list) or not msg or not isinstance(msg[0], str):
        raise ValueError("channel message must be a JSON array starting with its name")
    return msg


class BlockingChannel:
    """The core's end: blocking send (whole messages, from any thread), and receive with a timeout (select-based)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()
        self._send_lock = threading.Lock()

    def send(self, msg: list) -> None:
        data = encode(msg)
        with self._send_lock:
            self.sock.sendall(data)

    def _take(self) -> list | None:
        if len(self.buf) < HEADER.size:
            return None
        (n,) = HEADER.unpack_from(self.buf)
        if n > MAX_MESSAGE:
            raise ValueError(f"channel message of {n} bytes")
        if len(self.buf) < HEADER.size + n:
            return None
        body = bytes(self.buf[HEADER.size : HEADER.size + n])
        del self.buf[: HEADER.size + n]
        return decode(body)

    def recv_all(self, timeout: float | None) -> list[list]:
        """Every complete message available, waiting up to `timeout` seconds (None: forever) for the first."""
        import select

        out = []
        while True:
            msg = self._take()
            if msg is not None:
                out.append(msg)
                continue
            wait = 0.0 if out else timeout
            ready, _, _ = select.select([self.sock], [], [], wait)
            if not ready:
                return out
            data = self.sock.recv(1 << 20)
            if not data:
                if out:
                    return out
                raise ChannelClosed("the front closed the channel")
            self.buf += data


class AsyncChannel:
    """The front's end, on its event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, sock: socket.socket) -> "AsyncChannel":
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_MESSAGE)
        return cls(reader, writer)

    def send(self, msg: list) -> None:
        """Queue a message (the transport writes it without blocking the loop)."""
        self.writer.write(encode(msg))

    async def recv(self) -> list:
        try:
            head = await self.reader.readexactly(HEADER.size)
            (n,) = HEADER.unpack(head)
            if n > MAX_MESSAGE:
                raise ValueError(f"channel message of {n} bytes")
            return decode(await self.reader.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise ChannelClosed("the engine core closed the channel") from exc

    def close(self) -> None:
        self.writer.close()

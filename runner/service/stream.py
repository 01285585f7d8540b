"""One scheduler's multiplexed token stream from this runner (`GET /v1/stream`).

Every engine step becomes at most one NDJSON line per stream, holding the outputs of all of
that stream's requests in the step:

    {"o": [[request_id, [new token ids], finish_reason | null, error | null
            (, cached_tokens(, logprobs(, prompt_logprobs)))], ...]}

An entry that carries a request's first token has a fifth element: how many of its prompt tokens the
prefix cache held (their K/V were not computed again); the optional elements are null where a later one is
given. The sixth, for a request that asked for log-probabilities, has one [log-probability, [[id,
log-probability], ...]] per new token; the seventh, for a request that asked for its prompt's, the same for
the prompt positions computed in that step (an entry may carry only those: no tokens yet).

If the HTTP writer falls behind, the lines of several steps leave in one write. A heartbeat
(an empty line) goes out after `HEARTBEAT_S` of silence so the scheduler can tell an idle
runner from a hung connection.
"""

from __future__ import annotations

import asyncio
import json

HEARTBEAT_S = 5.0
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def hello_line(runner_id: str, stream_id: str, info: dict) -> bytes:
    return _dumps({"hello": {"runner": runner_id, "stream": stream_id, **info}}).encode() + b"\n"


class RunnerStream:
    """Buffers the lines of one stream until its HTTP handler writes them."""

    def __init__(self, stream_id: str):
        self.id = stream_id
        self._buf: list[bytes] = []
        self._wake = asyncio.Event()
        self.closed = False

    def deliver(self, entries: list[list]) -> None:
        self._buf.append(b'{"o":' + _dumps(entries).encode() + b"}\n")
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        self._wake.set()

    async def next_chunk(self) -> bytes | None:
        """Everything buffered (waiting for at least one line, or a heartbeat); None once closed and drained."""
        while not self._buf:
            if self.closed:
                return None
            try:
                await asyncio.wait_for(self._wake.wait(), HEARTBEAT_S)
            except asyncio.TimeoutError:
                return b"\n"
            self._wake.clear()
        data = b"".join(self._buf) if len(self._buf) > 1 else self._buf[0]
        self._buf.clear()
        return data

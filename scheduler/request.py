"""One client request as the scheduler tracks it from arrival to its last token."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from lorafleet.scheduler.registry import AdapterEntry

_order = itertools.count()


class Sink:
    """Where the requests of one API call report to their HTTP handler (shared by the `n` choices).

    Events are `(index, [ids])` for new tokens and `(index, None, finish_reason, error)` at the end.
    `push` never blocks and wakes the handler at most once however many events pile up, so a
    handler that falls behind takes the tokens of several steps in one go.
    """

    __slots__ = ("events", "_waiter")

    def __init__(self):
        self.events: list[tuple] = []
        self._waiter: asyncio.Future | None = None

    def push(self, ev: tuple) -> None:
        self.events.append(ev)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    async def wait(self) -> list[tuple]:
        """Every event since the last call (waits for at least one)."""
        if not self.events:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        evs, self.events = self.events, []
        return evs


@dataclass(eq=False)
class Request:
    """Prompt ids, ids generated so far (across runners) and where it runs now.

    Its events go to `sink` (its HTTP handler). `arrival` never changes, so a migrated request
    keeps its FCFS place. `rid` names it on its current runner (it changes on every re-placement,
    so a late event from a runner it left is never taken for the new one).
    """

    id: str
    model: str
    adapter: AdapterEntry | None
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict  # temperature, top_p, top_k, seed, stop_token_ids, ignore_eos
    arrival: float = field(default_factory=time.time)
    generated: list[int] = field(default_factory=list)
    sink: Sink = field(default_factory=Sink)
    index: int = 0  # choice index within its API call
    runner_id: str | None = None
    rid: str | None = None
    migrations: int = 0
    failures: int = 0
    done: bool = False
    finish_reason: str | None = None
    error: str | None = None
    first_token_time: float | None = None
    queued_at: float | None = None
    order: int = field(default_factory=lambda: next(_order))

    @property
    def key(self) -> tuple[float, int]:
        return (self.arrival, self.order)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.generated)

    def runner_body(self, stream_id: str) -> dict:
        """What a runner receives: prompt + ids generated so far (recompute by prefill)."""
        self.rid = f"{self.id}.{self.migrations}.{self.failures}"
        return {
            "request_id": self.rid,
            "stream": stream_id,
            "prompt_token_ids": self.prompt_ids + self.generated,
            "adapter": None if self.adapter is None else {
                "name": self.adapter.name, "source": self.adapter.source, "sha256": self.adapter.sha256},
            "sampling": {**self.sampling, "max_tokens": self.remaining},
            "arrival": self.arrival,
        }

    def add_tokens(self, ids: list[int]) -> None:
        """New ids from the runner (never more than max_tokens in all)."""
        if self.done or not ids:
            return
        room = self.max_tokens - len(self.generated)
        if len(ids) > room:
            ids = ids[: max(room, 0)]
            if not ids:
                return
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.generated += ids
        self.sink.push((self.index, ids))

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.done:
            return
        self.done, self.finish_reason, self.error = True, reason, error
        self.sink.push((self.index, None, reason, error))

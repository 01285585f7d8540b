"""One client request as the scheduler tracks it from arrival to its last token."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from lorafleet.scheduler.registry import AdapterEntry

_order = itertools.count()


@dataclass(eq=False)
class Request:
    """Prompt ids, ids generated so far (across runners) and where it runs now.

    `events` carries ("tokens", [ids]) and finally ("done", finish_reason, error) to the
    HTTP handler. `arrival` never changes, so a migrated request keeps its FCFS place.
    """

    id: str
    model: str
    adapter: AdapterEntry | None
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict  # temperature, top_p, top_k, seed, stop_token_ids, ignore_eos
    arrival: float = field(default_factory=time.time)
    generated: list[int] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    runner_id: str | None = None
    migrations: int = 0
    failures: int = 0
    done: bool = False
    finish_reason: str | None = None
    error: str | None = None
    first_token_time: float | None = None
    queued_at: float | None = None
    placed_at_generated: int = -1  # len(generated) when last placed on a runner
    order: int = field(default_factory=lambda: next(_order))

    @property
    def key(self) -> tuple[float, int]:
        return (self.arrival, self.order)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def awaiting_first_token(self) -> bool:
        """Placed on a runner that has not sent a token for it yet (its prefill is queued there)."""
        return self.runner_id is not None and len(self.generated) == self.placed_at_generated

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.generated)

    def runner_body(self) -> dict:
        """What a runner receives: prompt + ids generated so far (recompute by prefill)."""
        return {
            "request_id": f"{self.id}.{self.migrations}.{self.failures}",
            "prompt_token_ids": self.prompt_ids + self.generated,
            "adapter": None if self.adapter is None else {
                "name": self.adapter.name, "source": self.adapter.source, "sha256": self.adapter.sha256},
            "sampling": {**self.sampling, "max_tokens": self.remaining},
            "arrival": self.arrival,
        }

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.done:
            return
        self.done, self.finish_reason, self.error = True, reason, error
        self.events.put_nowait(("done", reason, error))

"""Where a new request goes (Punica §5.1): the busiest runner that still has room.

A runner fits a request when it is healthy, not draining, its batch is below its max
batch size, and its free KV tokens cover the request's need:

    need = prompt tokens (+ tokens generated so far, for a migrated request)
           + min(remaining max_tokens, KV_RESERVE)      # room to decode without evicting at once

Among fitting runners the one with the largest batch wins; ties go to the highest runner
id. None fits: the request waits in the FCFS queue. `least_loaded` and `round_robin` are
the comparison policies of `lorafleet simulate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

KV_RESERVE = 64


@dataclass(frozen=True)
class RunnerView:
    id: str
    healthy: bool
    draining: bool
    batch_size: int
    max_batch_size: int
    free_kv_tokens: int
    total_kv_tokens: int = 0


def kv_need(num_tokens: int, remaining_max_tokens: int) -> int:
    return num_tokens + min(max(remaining_max_tokens, 1), KV_RESERVE)


def fits(r: RunnerView, need: int) -> bool:
    return r.healthy and not r.draining and r.batch_size < r.max_batch_size and r.free_kv_tokens >= need


def busiest_fit(runners: Sequence[RunnerView], need: int) -> str | None:
    """The id of the fitting runner with the largest batch (ties: highest id), or None."""
    best = None
    for r in runners:
        if fits(r, need) and (best is None or (r.batch_size, r.id) > (best.batch_size, best.id)):
            best = r
    return best.id if best else None


def least_loaded(runners: Sequence[RunnerView], need: int) -> str | None:
    best = None
    for r in runners:
        if fits(r, need) and (best is None or (r.batch_size, r.id) < (best.batch_size, best.id)):
            best = r
    return best.id if best else None


class RoundRobin:
    def __init__(self):
        self.next = 0

    def __call__(self, runners: Sequence[RunnerView], need: int) -> str | None:
        order = sorted(runners, key=lambda r: r.id)
        for k in range(len(order)):
            r = order[(self.next + k) % len(order)]
            if fits(r, need):
                self.next = (self.next + k + 1) % len(order)
                return r.id
        return None


POLICIES = {"busiest": lambda: busiest_fit, "least-loaded": lambda: least_loaded, "round-robin": RoundRobin}

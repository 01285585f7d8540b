"""Where a new request goes (Punica §5.1): the busiest runner that still has room.

A runner fits a request when it is healthy, not draining, the requests placed on it are
below its max batch size plus its queue allowance, and its free KV tokens cover the request's need:

    need = prompt tokens (+ tokens generated so far, for a migrated request)
           + min(remaining max_tokens, KV_RESERVE)      # room to decode without evicting at once

Among fitting runners the one with the largest batch wins; ties go to the highest runner
id. None fits: the request waits in the FCFS queue. `least_loaded` and `round_robin` are
the comparison policies of `lorafleet simulate`.

Prefix affinity: `RunnerView.prefix_tokens` is how much of this request's leading tokens the
runner likely holds in its prefix cache (`prefix_index.py`). Busiest-that-fits weighs it in batch
places: a runner's score is

    batch_size + prefix_tokens / prefix_tokens_per_slot      (the bonus only when batch_size > 0)

and the highest score wins (ties: the larger batch, then the highest id). With the default 16
tokens per place, each likely cached 16-token page counts as one more request in the batch:

- a prefix of a few pages (a chat template's opening, shared by every runner that served the
  adapter) moves a request by a few places only, so consolidation still decides between runners
  far apart in load;
- a long prefix outweighs any difference in load: 1,024 tokens (a system prompt, a conversation
  so far) are 64 places, more than a runner of max batch 32 holds with its queue allowance (40),
  so among the runners that already have requests the one holding it wins, and load decides
  between runners holding as much;
- an empty runner never gets a bonus, so no request is sent to an idle runner for its cache:
  idle runners still drain, and the autoscaler releases them, however much of a prefix they hold.

What is given up is load balance among busy runners, never the number of busy runners. `lorafleet
simulate --workload chat` measured the weights (16, 32, 64 tokens per place and prefixes ignored,
docs/benchmarks.md §11): the GPU-hours of busiest-that-fits stay, and the hit rate rises with the
weight up to about one page per place. `prefix_tokens_per_slot=0` ignores prefixes
(`--placement busiest-no-prefix`, or `--prefix-affinity-tokens 0`).

Queue allowance: a runner may hold a few requests beyond its max batch (`RunnerView.queue`;
the scheduler's default is a quarter of the max batch, `--runner-queue`), so it can load their
adapters and prefill while its batch is full instead of only when a slot frees. (On an H200,
600 requests over 600 adapter names: 501 tok/s online without it, 547 with 8, 541 with 32; the
online distinct-adapter gap lies elsewhere, see docs/benchmarks.md.)

Prefill backlog: a runner's `prefill_backlog` is the prompt tokens of requests placed there
that have not produced their first token yet (work queued ahead of a new request's first
token). Busiest-that-fits stays the policy, except that a runner is passed over while its
backlog plus the new request's prefill would exceed `max_backlog` tokens, so long prompts do
not pile onto one runner while another idles. A runner with no backlog always qualifies; when
every fitting runner has too long a backlog, the one with the shortest backlog gets the
request (ties: busiest, then highest id). A runner's cached prefix counts as prefill it will
not do: the request adds only its other tokens to that runner's backlog.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

KV_RESERVE = 64
PREFILL_BACKLOG = 2048  # tokens of queued prefill beyond which a runner is passed over
PREFIX_TOKENS_PER_SLOT = 16  # likely cached prefix tokens worth one more request in a batch: one page


@dataclass(frozen=True)
class RunnerView:
    id: str
    healthy: bool
    draining: bool
    batch_size: int
    max_batch_size: int
    free_kv_tokens: int
    total_kv_tokens: int = 0
    prefill_backlog: int = 0  # prompt tokens placed here still waiting for their first token
    queue: int = 0  # requests it may hold beyond max_batch_size (see "Queue allowance")
    prefix_tokens: int = 0  # leading tokens of the request being placed that it likely holds cached


def kv_need(num_tokens: int, remaining_max_tokens: int) -> int:
    return num_tokens + min(max(remaining_max_tokens, 1), KV_RESERVE)


def fits(r: RunnerView, need: int) -> bool:
    return (r.healthy and not r.draining and r.batch_size < r.max_batch_size + r.queue
            and r.free_kv_tokens >= need)


def default_queue(max_batch_size: int) -> int:
    """The scheduler's default queue allowance: a quarter of the max batch."""
    return max_batch_size // 4


def calm(r: RunnerView, prefill: int, max_backlog: int) -> bool:
    """The runner's queued prefill leaves room for `prefill` more tokens (or it has none)."""
    return r.prefill_backlog == 0 or r.prefill_backlog + prefill <= max_backlog


def score(r: RunnerView, prefix_tokens_per_slot: int) -> float:
    """A runner's batch size plus its likely cached prefix in batch places (none for an empty runner)."""
    if prefix_tokens_per_slot <= 0 or r.batch_size == 0:
        return r.batch_size
    return r.batch_size + r.prefix_tokens / prefix_tokens_per_slot


def busiest_fit(runners: Sequence[RunnerView], need: int, prefill: int = 0, max_backlog: int = PREFILL_BACKLOG,
                prefix_tokens_per_slot: int = PREFIX_TOKENS_PER_SLOT) -> str | None:
    """The id of the fitting runner with the highest `score` (its batch, plus its likely cached prefix of the
    request; ties: larger batch, then highest id) among those whose prefill backlog is calm; else the fitting
    runner with the shortest backlog; else None."""
    fitting = [r for r in runners if fits(r, need)]
    if not fitting:
        return None
    preferred = [r for r in fitting if calm(r, max(prefill - r.prefix_tokens, 0), max_backlog)]
    if preferred:
        return max(preferred, key=lambda r: (score(r, prefix_tokens_per_slot), r.batch_size, r.id)).id
    return max(fitting, key=lambda r: (-r.prefill_backlog, r.batch_size, r.id)).id


def least_loaded(runners: Sequence[RunnerView], need: int, prefill: int = 0) -> str | None:
    best = None
    for r in runners:
        if fits(r, need) and (best is None or (r.batch_size, r.id) < (best.batch_size, best.id)):
            best = r
    return best.id if best else None


class RoundRobin:
    def __init__(self):
        self.next = 0

    def __call__(self, runners: Sequence[RunnerView], need: int, prefill: int = 0) -> str | None:
        order = sorted(runners, key=lambda r: r.id)
        for k in range(len(order)):
            r = order[(self.next + k) % len(order)]
            if fits(r, need):
                self.next = (self.next + k + 1) % len(order)
                return r.id
        return None


POLICIES = {"busiest": lambda: busiest_fit,
            "busiest-no-prefix": lambda: functools.partial(busiest_fit, prefix_tokens_per_slot=0),
            "least-loaded": lambda: least_loaded, "round-robin": RoundRobin}

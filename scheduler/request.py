"""One client request as the scheduler tracks it from arrival to its last token."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from lorafleet.scheduler.registry import AdapterEntry
from lorafleet.scheduler.sinks import Discard

_order = itertools.count()


@dataclass(eq=False)
class Request:
    """Prompt ids, ids generated so far (across runners) and where it runs now.

    Its tokens and its end go to `sink` (`sinks.py`: straight to its client). `arrival` never changes, so a migrated request
    keeps its FCFS place. `rid` names it on its current runner (it changes on every re-placement,
    so a late event from a runner it left is never taken for the new one). `cached_tokens` is what
    the first runner that computed its prompt found in its prefix cache (the API's usage reports it);
    `cache_salt` keys its pages there (`api_keys.cache_salt`).
    """

    id: str
    model: str
    adapter: AdapterEntry | None
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict  # temperature, top_p, top_k, seed, stop_token_ids, ignore_eos (, GenParams.extras())
    arrival: float = field(default_factory=time.time)
    generated: list[int] = field(default_factory=list)
    sink: object = field(default_factory=Discard)
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
    placed_at_generated: int = -1  # len(generated) when last placed on a runner
    cache_salt: str | None = None
    priority: int = 0  # lower values are placed first (vLLM's convention); a migrated request keeps it
    cached_tokens: int | None = None  # prompt tokens its first runner found in its prefix cache
    prefix_page_size: int = 0  # the page size `prefix_keys` were chained with (prefix_index.py)
    prefix_keys: list[bytes] = field(default_factory=list)  # keys of its leading full pages
    # with echo and logprobs (sampling's prompt_logprobs): one entry per prompt token after the first, as they come
    prompt_lps: list = field(default_factory=list)
    order: int = field(default_factory=lambda: next(_order))

    @property
    def key(self) -> tuple[int, float, int]:
        """Queue order: the lower priority value first, then FCFS."""
        return (self.priority, self.arrival, self.order)

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

    def runner_body(self, stream_id: str) -> dict:
        """What a runner receives: prompt + ids generated so far (recompute by prefill)."""
        self.rid = f"{self.id}.{self.migrations}.{self.failures}"
        sampling = {**self.sampling, "max_tokens": max(1, self.remaining)}  # (max_tokens 0: echo alone; see add_tokens)
        if self.generated:  # tokens generated on an earlier runner come back as prompt: they count as output there
            sampling["prior_output_tokens"] = len(self.generated)
        if "prompt_logprobs" in sampling:
            if self.prompt_logprobs_done:
                del sampling["prompt_logprobs"]  # its first runner gave them all
            else:
                self.prompt_lps = []  # an earlier runner gave part of them: the new one gives them all again
        return {
            "request_id": self.rid,
            "stream": stream_id,
            "prompt_token_ids": self.prompt_ids + self.generated,
            "adapter": None if self.adapter is None else {
                "name": self.adapter.name, "source": self.adapter.source, "sha256": self.adapter.sha256,
                **({"version": self.adapter.version} if self.adapter.version else {})},
            "sampling": sampling,
            "arrival": self.arrival,
            **({"priority": self.priority} if self.priority else {}),
            **({"cache_salt": self.cache_salt} if self.cache_salt is not None else {}),
        }

    @property
    def prompt_logprobs_done(self) -> bool:
        return len(self.prompt_lps) >= len(self.prompt_ids) - 1

    def add_prompt_logprobs(self, entries: list) -> None:
        """Entries of its prompt's log-probabilities from the runner, in prompt order."""
        if not self.done and not self.prompt_logprobs_done:
            self.prompt_lps += entries[: len(self.prompt_ids) - 1 - len(self.prompt_lps)]

    def add_tokens(self, ids: list[int], logprobs: list | None = None, ending: bool = False) -> None:
        """New ids from the runner (never more than max_tokens in all), with their log-probabilities where the
        request asked for them (one entry per id); `ending`: the runner stopped the request at the last of them (EOS
        or a stop token id)."""
        if self.done or not ids:
            return
        room = self.max_tokens - len(self.generated)
        if len(ids) > room:
            ids, ending = ids[: max(room, 0)], False
            if not ids:
                return
        if logprobs is not None:
            logprobs = logprobs[: len(ids)] if len(logprobs) >= len(ids) else None  # (a runner's short list: none)
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.generated += ids
        self.sink.tokens(self, ids, logprobs, ending)

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.done:
            return
        self.done, self.finish_reason, self.error = True, reason, error
        self.sink.done(self, reason, error)

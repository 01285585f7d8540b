"""One request as it flows through the engine."""

from __future__ import annotations

import enum
import itertools
import os
import time
from dataclasses import dataclass, field

from lorafleet.runner.executor.sampler import MAX_LOGPROBS
from lorafleet.runner.lora.adapter import AdapterRef  # noqa: F401 (a request names its adapter by one)

_counter = itertools.count()


class SamplingError(ValueError):
    """Invalid sampling parameters."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters. `logprobs` (None: off) asks for
    each generated token's log-probability and that many of the most likely alternatives (0..MAX_LOGPROBS), under
    the model's own distribution (the logits' log-softmax, before temperature, top-k and top-p)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise SamplingError(f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def parse_token_ids(value, what: str = "prompt_token_ids") -> list[int]:
    """A non-empty list of non-negative ints, or SamplingError naming `what`."""
    if not isinstance(value, list) or not value or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    ):
        raise SamplingError(f"{what} must be a non-empty list of non-negative integers")
    return value


def sampling_from_dict(d: dict) -> SamplingParams:
    """SamplingParams from a JSON object (the runner API and `generate` input); SamplingError if invalid."""
    try:
        return SamplingParams(
            max_tokens=d.get("max_tokens", 16),
            temperature=float(d.get("temperature", 0.0)),
            top_p=float(d.get("top_p", 1.0)),
            top_k=d.get("top_k", 0),
            seed=d.get("seed"),
            stop_token_ids=tuple(parse_token_ids(list(d["stop_token_ids"]), "stop_token_ids"))
            if d.get("stop_token_ids") else (),
            ignore_eos=bool(d.get("ignore_eos", False)),
            logprobs=d.get("logprobs"),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, SamplingError):
            raise
        raise SamplingError(str(exc)) from None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request: prompt ids, ids generated so far, its adapter, sampling and KV pages.

    `arrival` orders requests: FCFS admission takes the oldest first; eviction takes the
    newest. A resumed (migrated) request keeps its original arrival.
    """

    id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter: AdapterRef | None = None
    arrival: float = field(default_factory=time.time)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V sit in (or are being written to) this request's pages
    # Tokens sampled on the device but not yet read back (overlapped scheduling): the last
    # `num_pending` tokens of the sequence exist only as device values of the step in flight.
    num_pending: int = 0
    # Bumped whenever the request leaves the running batch (finish, cancel, eviction), so a step in
    # flight that still carries it can tell that its result for this request is stale.
    epoch: int = 0
    slot: int = -1  # adapter pool slot while admitted (-1: none)
    finish_reason: str | None = None
    error: str | None = None
    order: int = field(default_factory=lambda: next(_counter))  # tie-break for equal arrivals
    sample_seed: int = 0
    max_len: int = 1 << 30  # the engine's context length, set when the engine accepts the request
    cache_salt: str | None = None  # prefix cache: requests share cached pages only with the same salt
    # prefix cache bookkeeping (block_manager.py): the key chain's root and the keys of the full pages so far
    key_root: bytes | None = None
    page_keys: list = field(default_factory=list)
    num_registered: int = 0  # pages of `pages` registered in the cache
    cached_tokens: int | None = None  # prompt tokens found in the cache at its first admission here

    def __post_init__(self):
        if not self.prompt_ids:
            raise SamplingError("prompt_token_ids must not be empty")
        # Sampling draws depend only on (seed, position), so a resumed request samples the same.
        self.sample_seed = self.params.seed if self.params.seed is not None else int.from_bytes(os.urandom(6), "little")

    @property
    def all_ids(self) -> list[int]:
        """Prompt and generated ids known on the host (pending device tokens not included)."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, including the ones still pending on the device."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_pending

    @property
    def done_generating(self) -> bool:
        """Its last token is already sampled (max_tokens or the context is reached): nothing to schedule."""
        return self.num_generated >= self.params.max_tokens or self.num_tokens >= self.max_len

    @property
    def prefilling(self) -> bool:
        """Some prompt (or resumed) tokens still lack their K/V: the next rows are a prefill chunk."""
        return self.num_cached < self.num_tokens - 1

    @property
    def adapter_name(self) -> str | None:
        return self.adapter.name if self.adapter else None

    @property
    def age_key(self) -> tuple[float, int]:
        return (self.arrival, self.order)

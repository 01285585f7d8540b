"""One request as it flows through the engine. Torch-free at import: the runner's front (which never imports
torch) parses requests into these."""

from __future__ import annotations

import enum
import itertools
import os
import time
from dataclasses import dataclass, field

from lorafleet.runner.lora.ref import AdapterRef  # noqa: F401 (a request names its adapter by one)

MAX_LOGPROBS = 20  # alternatives per token a request may ask for with its log-probability (OpenAI's bound)
MAX_LOGIT_BIAS = 300  # token ids one request may bias (OpenAI's bound)
MAX_STOP_TOKEN_IDS = 1024  # stop_token_ids of one request (every generated token is checked against them)
MAX_REPETITION_PENALTY = 10.0

_counter = itertools.count()


class SamplingError(ValueError):
    """Invalid sampling parameters."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 disable those filters. `logprobs` (None: off) asks
    for each generated token's log-probability and that many of the most likely alternatives (0..MAX_LOGPROBS),
    under the model's own distribution (the logits' log-softmax, before any of the changes below).
    `prompt_logprobs` (None: off) asks the same for every prompt token after the first (each under the logits of
    the position before it); such a request computes its whole prompt (it takes no pages from the prefix cache).

    The logits are changed before sampling (sampler.adjust_logits, in this order): `repetition_penalty` (HF's: a
    logit of a token seen in the prompt or the output divided by it if positive, multiplied if not), then
    OpenAI's `presence_penalty` (subtracted once from a token that occurs in the output) and `frequency_penalty`
    (times its count there), then `logit_bias` ((token id, bias) pairs added), then `min_tokens`: until that many
    tokens are generated, EOS (unless `ignore_eos`) and `stop_token_ids` cannot be sampled. The last
    `prior_output_tokens` ids of the prompt are output generated earlier (a request resumed elsewhere): they count
    as output for the penalties and for `min_tokens`."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    prior_output_tokens: int = 0

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
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                                f"{len(self.stop_token_ids)}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or isinstance(self.prompt_logprobs, bool)
                or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise SamplingError(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, "
                                f"got {self.prompt_logprobs!r}")
        if not 0.0 <= float(self.min_p) <= 1.0:
            raise SamplingError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= float(getattr(self, name)) <= 2.0:
                raise SamplingError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < float(self.repetition_penalty) <= MAX_REPETITION_PENALTY:
            raise SamplingError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                                f"got {self.repetition_penalty!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 and -100.0 <= float(b) <= 100.0
                for i, b in self.logit_bias):
            raise SamplingError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases in [-100, 100]")
        for name in ("min_tokens", "prior_output_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise SamplingError(f"{name} must be a non-negative integer, got {v!r}")
        # read per sampled row every step: plain attributes, worked out once. penalized: the output's tokens
        # change the logits (presence, frequency or repetition penalty); adjusts_always: some change of the logits
        # applies whatever the output's length (min_tokens' applies only while fewer tokens are out)
        penalized = self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
        object.__setattr__(self, "penalized", penalized)
        object.__setattr__(self, "adjusts_always", penalized or bool(self.logit_bias))

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


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as a JSON object ({"token id": bias}, OpenAI's form) or a list of [id, bias] pairs, sorted by id;
    each id once."""
    if not value:
        return ()
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in value):
        items = list(value)
    else:
        raise SamplingError("logit_bias must be an object of token ids to numbers or a list of [id, number] pairs")
    out = {}
    for k, b in items:
        if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 12:
            k = int(k)
        if not isinstance(k, int) or isinstance(k, bool) or not isinstance(b, (int, float)) or isinstance(b, bool):
            raise SamplingError(f"logit_bias must map token ids to numbers, got {k!r}: {b!r}")
        if k in out:
            raise SamplingError(f"logit_bias gives token {k} twice")
        out[k] = float(b)
    return tuple(sorted(out.items()))


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
            prompt_logprobs=d.get("prompt_logprobs"),
            min_p=float(d.get("min_p", 0.0)),
            presence_penalty=float(d.get("presence_penalty", 0.0)),
            frequency_penalty=float(d.get("frequency_penalty", 0.0)),
            repetition_penalty=float(d.get("repetition_penalty", 1.0)),
            logit_bias=_logit_bias(d.get("logit_bias")),
            min_tokens=d.get("min_tokens", 0),
            prior_output_tokens=d.get("prior_output_tokens", 0),
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

    `priority` then `arrival` order requests: admission takes the lowest priority value, and among equals the
    oldest, first; eviction takes the other end (the newest of the least important). A resumed (migrated)
    request keeps its original arrival and priority.
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
    priority: int = 0  # lower values go first (vLLM's convention); 0 for everyone by default
    # prefix cache bookkeeping (block_manager.py): the key chain's root and the keys of the full pages so far
    key_root: bytes | None = None
    page_keys: list = field(default_factory=list)
    num_registered: int = 0  # pages of `pages` registered in the cache
    cached_tokens: int | None = None  # prompt tokens found in the cache at its first admission here
    # with penalties (params.penalized): each output token's count so far, read back ones only (the engine adds
    # each as it comes); a token still pending on the device is counted there (sampler.adjust_logits)
    out_counts: dict[int, int] = field(default_factory=dict)
    _prompt_distinct: object = None  # with a repetition penalty: its prompt's distinct ids (int64 CPU tensor)

    def __post_init__(self):
        if not self.prompt_ids:
            raise SamplingError("prompt_token_ids must not be empty")
        if self.params.prior_output_tokens > len(self.prompt_ids):
            raise SamplingError("prior_output_tokens exceeds the prompt's length")
        if self.params.penalized:
            for t in self.prompt_ids[len(self.prompt_ids) - self.params.prior_output_tokens:]:
                self.out_counts[t] = self.out_counts.get(t, 0) + 1
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

    def prompt_distinct(self):
        """Its prompt's distinct ids as an int64 CPU tensor (the repetition penalty's part from the prompt),
        worked out once."""
        if self._prompt_distinct is None:
            import torch

            self._prompt_distinct = torch.tensor(list(dict.fromkeys(self.prompt_ids)), dtype=torch.int64)
        return self._prompt_distinct

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
    def age_key(self) -> tuple[int, float, int]:
        """Admission order (FCFS within a priority, the lower value first) and, from the other end, eviction's."""
        return (self.priority, self.arrival, self.order)

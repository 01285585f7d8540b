"""Per-request budgets of the scheduler and the flags that set them.

One request may ask for many sequences (`n` × prompts), long prompts and long completions;
these bounds keep one request from occupying the server. Each refusal is a 400 that names
the limit and the flag that raises it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from lorafleet.common.cli_args import non_negative_int, positive_int
from lorafleet.scheduler.placement import PREFILL_BACKLOG, PREFIX_TOKENS_PER_SLOT

DEFAULT_MAX_SEQUENCES = 32
DEFAULT_MAX_PROMPT_TOKENS = 65536


@dataclass(frozen=True)
class RequestLimits:
    """Budgets of one OpenAI request (sequences = prompts × n)."""

    max_model_len: int = 4096  # context: prompt + completion of one sequence
    max_sequences: int = DEFAULT_MAX_SEQUENCES  # prompts × n of one request
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS  # prompt tokens of all its sequences together
    max_completion_tokens: int | None = None  # cap on max_tokens per sequence (None: the context)
    max_prefill_backlog: int = PREFILL_BACKLOG  # placement: queued prefill tokens per runner
    runner_queue: int | None = None  # placement: requests a runner may hold beyond its max batch (None: a quarter)
    prefix_affinity_tokens: int = PREFIX_TOKENS_PER_SLOT  # placement: cached prefix tokens worth a batch place

    @property
    def completion_cap(self) -> int:
        cap = self.max_completion_tokens or self.max_model_len
        return max(1, min(cap, self.max_model_len))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The budget flags (shared by `lorafleet scheduler` and `lorafleet serve`)."""
    p.add_argument("--max-sequences-per-request", type=positive_int, default=DEFAULT_MAX_SEQUENCES, metavar="N",
                   help=f"prompts x n of one request (default: {DEFAULT_MAX_SEQUENCES})")
    p.add_argument("--max-prompt-tokens-per-request", type=positive_int, default=DEFAULT_MAX_PROMPT_TOKENS, metavar="N",
                   help="prompt tokens of all sequences of one request together, prompts x n "
                        f"(default: {DEFAULT_MAX_PROMPT_TOKENS}, at least the context length)")
    p.add_argument("--max-completion-tokens", type=positive_int, default=None, metavar="N",
                   help="largest max_tokens a request may ask for (default: the context length)")
    p.add_argument("--max-prefill-backlog", type=positive_int, default=PREFILL_BACKLOG, metavar="TOKENS",
                   help="placement passes over a runner whose queued prompt tokens would exceed this "
                        f"(default: {PREFILL_BACKLOG})")
    p.add_argument("--runner-queue", type=non_negative_int, default=None, metavar="N",
                   help="requests placed on a runner beyond its max batch size, so it loads their adapters "
                        "while its batch is full (default: a quarter of its max batch; 0: none)")
    p.add_argument("--prefix-affinity-tokens", type=non_negative_int, default=PREFIX_TOKENS_PER_SLOT, metavar="TOKENS",
                   help="placement: a runner likely to hold this many tokens of a request's prefix in its cache counts "
                        f"as one more request in its batch (default: {PREFIX_TOKENS_PER_SLOT}; 0: ignore prefixes)")


def from_args(args: argparse.Namespace, max_model_len: int) -> RequestLimits:
    """The limits the flags set. argparse refuses values out of range before anything loads; these checks remain
    for namespaces built by hand (tests, embedding code)."""
    for flag in ("max_sequences_per_request", "max_prompt_tokens_per_request", "max_prefill_backlog"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    if args.max_completion_tokens is not None and args.max_completion_tokens < 1:
        raise SystemExit("--max-completion-tokens must be at least 1")
    if args.runner_queue is not None and args.runner_queue < 0:
        raise SystemExit("--runner-queue must be 0 or more")
    if args.prefix_affinity_tokens < 0:
        raise SystemExit("--prefix-affinity-tokens must be 0 or more")
    return RequestLimits(
        max_model_len=max_model_len,
        max_sequences=args.max_sequences_per_request,
        max_prompt_tokens=max(args.max_prompt_tokens_per_request, max_model_len),
        max_completion_tokens=args.max_completion_tokens,
        max_prefill_backlog=args.max_prefill_backlog,
        runner_queue=args.runner_queue,
        prefix_affinity_tokens=args.prefix_affinity_tokens,
    )

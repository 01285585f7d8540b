"""Argument types shared by the commands that start an engine (`generate`, `runner`, `serve`, `bench`): a bad
value is refused by argparse in one line, before anything loads."""

from __future__ import annotations

import argparse
import re

DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_LORA_RANK = 128  # the CUDA kernels' largest rank (csrc/sgmv.h kMaxRank); the CPU path keeps the same bound


def device(value: str) -> str:
    """auto, cpu, cuda or cuda:N."""
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not auto, cpu, cuda or cuda:N")


def lora_rank(value: str) -> int:
    """An integer LoRA rank in [1, MAX_LORA_RANK]."""
    try:
        rank = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if not 1 <= rank <= MAX_LORA_RANK:
        raise argparse.ArgumentTypeError(f"a LoRA rank is between 1 and {MAX_LORA_RANK} (got {rank})")
    return rank


def _integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None


def positive_int(value: str) -> int:
    """An integer of at least 1 (a batch size, page size, page count, slot count, GPU count, length)."""
    n = _integer(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {n})")
    return n


def positive_float(value: str) -> float:
    """A finite number above 0 (a size in GiB)."""
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not (x > 0 and x != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0 (got {value})")
    return x


def fraction(value: str) -> float:
    """A number in (0, 1] (a share of free GPU memory)."""
    x = positive_float(value)
    if x > 1:
        raise argparse.ArgumentTypeError(f"must be at most 1 (got {value})")
    return x


def port(value: str) -> int:
    """A TCP port, 0 to 65535 (0: any free port)."""
    n = _integer(value)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"a port is between 0 and 65535 (got {n})")
    return n

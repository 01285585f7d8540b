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

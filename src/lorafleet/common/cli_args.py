"""Argument types shared by the commands that start an engine (`generate`, `runner`, `serve`, `bench`): a bad
value is refused by argparse in one line, before anything loads."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

from lorafleet.common import outputs

DTYPES = ("auto", "float32", "bfloat16", "float16")
MAX_LORA_RANK = 128  # the CUDA kernels' largest rank (csrc/sgmv.h kMaxRank); the CPU path keeps the same bound


def device(value: str) -> str:
    """auto, cpu, cuda or cuda:N."""
    if value in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not auto, cpu, cuda or cuda:N")


def lora_rank(value: str) -> int:
    """An integer LoRA rank in [1, MAX_LORA_RANK]."""
    rank = _integer(value)
    if not 1 <= rank <= MAX_LORA_RANK:
        raise argparse.ArgumentTypeError(f"a LoRA rank is between 1 and {MAX_LORA_RANK} (got {rank})")
    return rank


def _parsed(value: str, convert, noun: str):
    try:
        return convert(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not {noun}") from None


def _integer(value: str) -> int:
    return _parsed(value, int, "an integer")


def _number(value: str) -> float:
    return _parsed(value, float, "a number")


def positive_int(value: str) -> int:
    """An integer of at least 1 (a batch size, page size, page count, slot count, GPU count, length)."""
    n = _integer(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {n})")
    return n


def non_negative_int(value: str) -> int:
    """An integer of at least 0 (a token count where 0 means none)."""
    n = _integer(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0 (got {n})")
    return n


def non_negative_float(value: str) -> float:
    """A finite number of at least 0 (a time in seconds where 0 means at once)."""
    x = _number(value)
    if not 0 <= x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of at least 0 (got {value})")
    return x


def positive_float(value: str) -> float:
    """A finite number above 0 (a size in GiB)."""
    x = _number(value)
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


def existing_file(value: str) -> Path:
    """A path that names something readable as a file: an existing path that is not a directory (a pipe or
    /dev/stdin too)."""
    path = Path(value)
    if not path.exists() or path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} {'is a directory' if path.exists() else 'does not exist'}")
    return path


def _json_object(value: str) -> tuple[Path, dict]:
    path = existing_file(value)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"{value} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{value} is not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") \
            from None
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"{value} does not hold a JSON object")
    return path, data


def json_file(value: str) -> Path:
    """An existing file holding a JSON object (read here, so that a missing or broken one is refused in one line)."""
    return _json_object(value)[0]


def results_file(value: str) -> Path:
    """A result file of an earlier benchmark run (`--merge`, `--plot-from`): an existing file holding a JSON object
    with a list of `runs`."""
    path, data = _json_object(value)
    if not isinstance(data.get("runs"), list):
        raise argparse.ArgumentTypeError(f"{value} is not a benchmark result file (no list of runs)")
    return path


def output_file(value: str) -> Path:
    """A results file a run writes at its end (`--out`, `--plot`): its folder is made and the file tried now
    (lorafleet.common.outputs), so that a path that cannot take it is refused before the work, not after."""
    path = Path(value)
    why = outputs.problem(path)
    if why:
        raise argparse.ArgumentTypeError(why)
    return path


def existing_dir(value: str) -> Path:
    """A path that names an existing directory."""
    path = Path(value)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} {'is not a directory' if path.exists() else 'does not exist'}")
    return path


def model_dir(*files: str) -> Callable[[str], str]:
    """The type of an option naming a model directory that must hold each of `files` (e.g. "config.json",
    "tokenizer.json"): a path that is not a directory, or a directory without one of them, is refused in one
    line naming the directory and what it lacks. The value is returned as given."""

    def check(value: str) -> str:
        path = existing_dir(value)
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise argparse.ArgumentTypeError(f"model directory {value} has no {' and no '.join(missing)}")
        return value

    return check


BATCH_INVARIANT_HELP = ("a decode row's bits do not depend on the other rows of its step: a step's decode rows and "
                        "prompt rows run as two forward passes, decode attention on the project's kernel (the two "
                        "passes cost about 3 %% at ShareGPT-like loads on an H100; docs/api.md, Reproducibility, "
                        "says what it covers). Default: off")


def add_batch_invariant_argument(p) -> None:
    """--batch-invariant (runner, serve, generate, bench e2e): EngineConfig.batch_invariant."""
    p.add_argument("--batch-invariant", action="store_true", help=BATCH_INVARIANT_HELP)

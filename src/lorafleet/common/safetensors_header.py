"""Reads a safetensors header without torch: tensor names, dtypes and shapes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
MAX_HEADER = 100 * 1024 * 1024


class HeaderError(ValueError):
    """The file is not a well-formed safetensors file."""


def read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Return {tensor name: (dtype, shape)}; raise HeaderError on any inconsistency."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"{path.name} is truncated ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or n > MAX_HEADER or 8 + n > size:
            raise HeaderError(f"{path.name} has an impossible header length {n} (file is {size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    # ValueError: JSONDecodeError, and an integer past Python's digit limit; RecursionError: arrays nested deeper
    # than the parser's stack
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise HeaderError(f"{path.name} has a corrupt header: {exc}") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path.name} has a corrupt header (not an object)")
    data_len = size - 8 - n
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise HeaderError(f"{path.name}: malformed entry for tensor {name!r}") from None
        # Exact JSON types, as the safetensors library itself requires: a string or float offset would fail the
        # comparisons below with a TypeError, and a negative dimension (or a pair of them) could match the byte
        # count while naming no tensor that library can read.
        if not isinstance(dtype, str) or not all(_count(v) for v in (*shape, start, end)):
            raise HeaderError(f"{path.name}: malformed entry for tensor {name!r} (its dtype must be a string, its "
                              "shape and data_offsets non-negative integers)")
        if dtype not in DTYPE_BYTES:
            raise HeaderError(f"{path.name}: tensor {name!r} has unsupported dtype {dtype}")
        numel = 1
        for s in shape:
            numel *= s
        if not (0 <= start <= end <= data_len) or end - start != numel * DTYPE_BYTES[dtype]:
            raise HeaderError(f"{path.name}: tensor {name!r} points outside the file (truncated or corrupt)")
        out[name] = (dtype, shape)
    return out


def _count(v) -> bool:
    """A JSON non-negative integer (not a bool, float or string)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0

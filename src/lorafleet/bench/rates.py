"""The rates a memory floor is computed at: the card's device-to-device copy bandwidth (bytes read plus bytes
written, per second) and its bf16 matrix-product rate, measured once per process and device on the card the
benchmark runs on, so that a floor is that card's own. Without a CUDA device (CPU runs of the tiny shapes), the
H200's measured figures stand in, and the record says so.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# The H200's measured rates (a 1 GiB device-to-device copy; 8192 x 8192 x 8192 bf16 products on random data).
REFERENCE = {"bandwidth": 4.2e12, "matmul": 7.7e14, "measured": False,
             "source": "the H200's measured rates (no CUDA device to measure)"}

COPY_BYTES = 1 << 30  # far past any L2: the copy streams from and to device memory
MATMUL_N = 8192
_measured: dict = {}


def card_rates(device=None) -> dict:
    """{"bandwidth": bytes/s, "matmul": FLOP/s, "measured": bool, "source": str} for `device` (a torch device or
    None for the current CUDA device); REFERENCE where it is not a CUDA device. Measured once per process and
    device; a card too full for the copy's 2 GiB falls back to REFERENCE with a warning, and its record says so."""
    import torch

    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type != "cuda":
        return dict(REFERENCE)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.index not in _measured:
        try:
            rates = _measure(dev)
        except torch.cuda.OutOfMemoryError:
            rates = None
        torch.cuda.empty_cache()  # (after the except block: a failed measurement's tensors are gone by now)
        if rates is None:
            log.warning("no room on %s to measure its rates: floors at the H200's", dev)
            return dict(REFERENCE, source=f"the H200's measured rates (no room on {dev} to measure its own)")
        _measured[dev.index] = rates
    return dict(_measured[dev.index])


def _timed(fn, reps: int, device) -> float:
    """Seconds per call of fn on `device`, after two warm-up calls, by CUDA events."""
    import torch

    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream(device)
    start.record(stream)
    for _ in range(reps):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _measure(device) -> dict:
    import torch

    with torch.cuda.device(device):
        src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_s = _timed(lambda: dst.copy_(src), 10, device)
        del src, dst
        a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=device)
        b = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=device)
        mm_s = _timed(lambda: torch.mm(a, b), 10, device)
        del a, b
    name = torch.cuda.get_device_name(device)
    rates = {"bandwidth": 2 * COPY_BYTES / copy_s, "matmul": 2 * MATMUL_N ** 3 / mm_s, "measured": True,
             "source": f"measured on {name}: a {COPY_BYTES >> 30} GiB device-to-device copy (bytes read and "
                       f"written), {MATMUL_N}^3 bf16 products"}
    log.info("floor rates on %s: %.2f TB/s copy, %.0f TFLOP/s bf16", name, rates["bandwidth"] / 1e12,
             rates["matmul"] / 1e12)
    return rates


def describe(rates: dict) -> str:
    """One line for logs and tables: '3.02 TB/s, 790 TFLOP/s (measured on ...)'."""
    return f"{rates['bandwidth'] / 1e12:.2f} TB/s, {rates['matmul'] / 1e12:.0f} TFLOP/s ({rates['source']})"

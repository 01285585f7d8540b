"""CUDA graph capture without the per-capture device-wide housekeeping of `torch.cuda.graph`."""

from __future__ import annotations

import torch


def capture(graph: "torch.cuda.CUDAGraph", fn, pool=None, stream: "torch.cuda.Stream | None" = None):
    """Capture `fn()` into `graph` on a side stream (sharing memory `pool` when given).

    Unlike `torch.cuda.graph`, this does not synchronise the device, release the allocator
    caches and (on some torch versions) collect garbage before every capture, which adds up to
    minutes over the hundreds of piecewise graphs; callers do that once before a series.

    Capture errors are thread-local: other threads (adapter loaders, NCCL's own threads under
    tensor parallelism) may keep using CUDA while a graph is captured."""
    dev = stream.device if stream is not None else torch.device("cuda", torch.cuda.current_device())
    stream = stream or torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            out = fn()
        except BaseException as exc:
            try:
                graph.capture_end()
            except Exception as end_exc:  # a failed capture usually fails to end too: keep the cause
                raise exc from end_exc
            raise
        graph.capture_end()
    torch.cuda.current_stream(dev).wait_stream(stream)
    return out

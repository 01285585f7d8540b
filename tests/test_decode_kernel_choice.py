"""The choice of the decode attention kernel (KernelChoices.decode_kernel) on the CPU side: which models the project's
kernel takes, and the launch shape it is given (csrc/decode_attn.cu is checked on the GPU, tests/gpu)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lorafleet.runner.config import KernelChoices
from lorafleet.runner.executor.attention import decode_kernel as dk


def cfg(heads, kv_heads, head_dim):
    return SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


@pytest.mark.parametrize("shape, ok", [
    ((32, 32, 128), True),   # Llama-2-7B
    ((64, 8, 128), True),    # Llama-2-70B, Llama-3
    ((28, 4, 128), True),    # Qwen2-7B: 7 query heads per K/V head
    ((8, 4, 256), True),     # Gemma-style 256-wide heads
    ((14, 2, 64), True),
    ((32, 32, 96), False),   # Phi-3-mini's 96-wide heads: flashinfer's kernel
    ((32, 2, 128), False),   # 16 query heads per K/V head
    ((6, 4, 128), False),    # heads not a multiple of the K/V heads
])
def test_supported_shapes(shape, ok):
    assert dk.supported(cfg(*shape)) is ok


@pytest.mark.parametrize("shape, kv_dtype, ok", [
    ((32, 32, 128), torch.float8_e4m3fn, True),   # Llama-2-7B, FP8 pages: measured faster at every context
    ((32, 32, 128), torch.bfloat16, False),       # bf16 pages: flashinfer's was faster
    ((64, 8, 128), torch.float8_e4m3fn, False),   # grouped heads: flashinfer's tensor-core decode
    ((28, 4, 128), torch.float8_e4m3fn, False),   # groups of 2-7: not measured
    ((32, 32, 96), torch.float8_e4m3fn, False),   # a head size the kernel lacks
])
def test_auto_takes_the_kernel_only_where_it_was_measured_faster(shape, kv_dtype, ok):
    assert dk.preferred(cfg(*shape), kv_dtype) is ok


def test_workers_fill_the_gpu_within_the_chunks():
    assert dk.CTAS_PER_SM == 4
    assert dk.workers(132, 64, 32, [370] * 64) == 1  # 2,048 CTAs already: one each
    assert dk.workers(132, 32, 32, [370] * 32) == 1  # 1,024 pairs, 7.8 per SM: one each (measured fastest)
    assert dk.workers(132, 8, 32, [370] * 8) == 2  # 256 pairs: two workers (measured fastest), two chunks each
    assert dk.workers(132, 8, 32, [100] * 8) == 1  # ... but these have one chunk
    assert dk.workers(132, 1, 8, [5000]) == dk.MAX_CHUNKS  # one long request: as many as it has chunks
    assert dk.workers(132, 1, 8, [300]) == 2
    assert dk.workers(132, 1, 8, [1]) == 1
    assert dk.workers(132, 2, 8) == dk.MAX_CHUNKS  # a CUDA graph: the lengths are not known
    assert dk.workers(132, 16, 8) == 4  # 528 / 128, rounded
    assert dk.CHUNK % 16 == 0
    # shorter chunks and more CTAs per SM (LORAFLEET_DECODE_CHUNK / _CTAS_PER_SM): more workers where chunks allow
    assert dk.workers(132, 32, 32, [370] * 32, chunk=64, ctas_per_sm=16) == 2  # 2,112 / 1,024, rounded
    assert dk.workers(132, 32, 32, [370] * 32, chunk=64, ctas_per_sm=32) == 4
    assert dk.workers(132, 32, 32, [370] * 32, chunk=128, ctas_per_sm=32) == 3  # 370 tokens: three chunks of 128
    assert dk.workers(132, 32, 32, None, chunk=64, ctas_per_sm=64) == 8  # a graph: as many as asked, up to 16


def test_workspace_holds_every_chunk_of_every_row():
    ws = dk.Workspace(3, 8, 2, 64, "cpu")
    assert ws.partial_o.numel() == 3 * 8 * dk.MAX_CHUNKS * 64
    assert ws.partial_ml.numel() == 3 * 8 * dk.MAX_CHUNKS * 2
    assert ws.counters.numel() == 6 and int(ws.counters.abs().sum()) == 0


def test_the_choice_is_validated():
    assert KernelChoices().decode_kernel == "auto"
    assert "decode_kernel=lorafleet" in KernelChoices(decode_kernel="lorafleet").describe()
    with pytest.raises(ValueError, match="decode_kernel must be one of auto, flashinfer, lorafleet"):
        KernelChoices(decode_kernel="triton")

"""Pick the attention backend for a device: flashinfer on CUDA when available, torch otherwise."""

from __future__ import annotations

import logging

import torch

from lorafleet.runner.config import KernelChoices
from lorafleet.runner.executor.attention.torch_backend import TorchAttention

log = logging.getLogger(__name__)


def attention_backend(kv, cfg, device: torch.device, kernels: KernelChoices, q_dtype: torch.dtype | None = None):
    """`cfg`: this rank's ModelConfig (heads, windows, scale); `kernels.attention`: auto, flashinfer or torch;
    `q_dtype`: the queries' dtype (the model's; the K/V pages may be FP8)."""
    choice = kernels.attention
    if device.type == "cuda" and choice in ("auto", "flashinfer"):
        try:
            from lorafleet.runner.executor.attention.flashinfer_backend import FlashInferAttention
        except ImportError as exc:
            if choice == "flashinfer":
                raise RuntimeError(f"LORAFLEET_ATTENTION=flashinfer but flashinfer is not importable: {exc}") from None
            log.warning("flashinfer not available (%s); using the torch attention path", exc)
        else:
            return FlashInferAttention(kv, cfg, device, kernels.prefill, q_dtype, kernels.decode_tc,
                                       kernels.decode_kernel, kernels.decode_no_split, kernels)
    elif choice == "flashinfer":
        raise RuntimeError("LORAFLEET_ATTENTION=flashinfer needs a CUDA device")
    return TorchAttention(kv, cfg)

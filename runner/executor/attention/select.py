"""Pick the attention backend for a device: flashinfer on CUDA when available, torch otherwise."""

from __future__ import annotations

import logging

import torch

from lorafleet import env
from lorafleet.runner.executor.attention.torch_backend import TorchAttention

log = logging.getLogger(__name__)


def attention_backend(kv, cfg, device: torch.device, engine_cfg):
    choice = env.attention_backend()
    if device.type == "cuda" and choice in ("auto", "flashinfer"):
        try:
            from lorafleet.runner.executor.attention.flashinfer_backend import FlashInferAttention
        except ImportError as exc:
            if choice == "flashinfer":
                raise RuntimeError(f"LORAFLEET_ATTENTION=flashinfer but flashinfer is not importable: {exc}") from None
            log.warning("flashinfer not available (%s); using the torch attention path", exc)
        else:
            return FlashInferAttention(kv, cfg, device, engine_cfg)
    elif choice == "flashinfer":
        raise RuntimeError("LORAFLEET_ATTENTION=flashinfer needs a CUDA device")
    return TorchAttention(kv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

"""Chooses the SGMV implementation for a device: the CUDA kernels on CUDA, plain torch elsewhere."""

from __future__ import annotations

import torch

from lorafleet import env
from lorafleet.runner.lora.sgmv import SGMV, TorchSGMV

CUDA_DTYPES = (torch.float16, torch.bfloat16)


def sgmv_backend(device: torch.device | str, dtype: torch.dtype | None = None) -> SGMV:
    """The SGMV for `device` (and, when given, the model dtype), honouring LORAFLEET_SGMV.

    auto (default): CudaSGMV on a CUDA device with a float16/bfloat16 model, else TorchSGMV.
    cuda: CudaSGMV; an error on a non-CUDA device or an unsupported dtype.
    torch: TorchSGMV everywhere.
    """
    choice = env.sgmv_backend()
    if choice not in ("auto", "cuda", "torch"):
        raise ValueError(f"LORAFLEET_SGMV must be auto, cuda or torch, got {choice!r}")
    dev = torch.device(device)
    if choice == "torch":
        return TorchSGMV()
    if dev.type != "cuda":
        if choice == "cuda":
            raise RuntimeError(f"LORAFLEET_SGMV=cuda needs a CUDA device, but the model runs on {dev}")
        return TorchSGMV()
    if dtype is not None and dtype not in CUDA_DTYPES:
        if choice == "cuda":
            raise RuntimeError(f"LORAFLEET_SGMV=cuda supports float16 and bfloat16 models, not {dtype}")
        return TorchSGMV()
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    return CudaSGMV()

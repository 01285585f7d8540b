"""Chooses the SGMV implementation for a device: the CUDA kernels on CUDA, plain torch elsewhere."""

from __future__ import annotations

import torch

from lorafleet.runner.lora.sgmv import SGMV, TorchSGMV

CUDA_DTYPES = (torch.float16, torch.bfloat16)


def sgmv_backend(device: torch.device | str, dtype: torch.dtype | None = None, choice: str = "auto") -> SGMV:
    """The SGMV for `device` (and, when given, the model dtype), as `choice` (KernelChoices.sgmv) says.

    auto (default): CudaSGMV on a CUDA device with a float16/bfloat16 model, else TorchSGMV.
    cuda: CudaSGMV; an error on a non-CUDA device or an unsupported dtype.
    torch: TorchSGMV everywhere.
    """
    if choice not in ("auto", "cuda", "torch"):
        raise ValueError(f"the SGMV choice must be auto, cuda or torch, got {choice!r}")
    dev = torch.device(device)
    if choice == "torch":
        return TorchSGMV()
    if dev.type != "cuda":
        if choice == "cuda":
            raise RuntimeError(f"the CUDA SGMV kernels (LORAFLEET_SGMV=cuda) need a CUDA device, but the model runs on {dev}")
        return TorchSGMV()
    if dtype is not None and dtype not in CUDA_DTYPES:
        if choice == "cuda":
            raise RuntimeError(f"the CUDA SGMV kernels (LORAFLEET_SGMV=cuda) support float16 and bfloat16 models, not {dtype}")
        return TorchSGMV()
    from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

    return CudaSGMV()

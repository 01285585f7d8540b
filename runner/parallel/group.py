"""The tensor-parallel process group: NCCL between GPUs, gloo between CPU processes (tests).

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends are set before the group starts, also in
spawned ranks): the all-reduces here are NCCL's plain P2P algorithms.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    def __init__(self, rank: int, size: int, port: int, device: torch.device, timeout_s: float = 600.0):
        for k, v in NO_MULTICAST.items():
            os.environ[k] = v
        self.rank, self.size, self.device = rank, size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s), **kw)

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the group, in place (capturable in a CUDA graph with NCCL)."""
        dist.all_reduce(t)

    def min_int(self, x: int) -> int:
        t = torch.tensor([x], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        """Leave the group. With NCCL the group is left to the process's exit instead:
        destroy_process_group can hang once NCCL work was captured in CUDA graphs (PyTorch issue
        115388), so one NCCL tensor-parallel engine lives per process."""
        if dist.is_initialized() and self.device.type != "cuda":
            dist.destroy_process_group()

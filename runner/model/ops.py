"""The decoder's elementwise ops: plain torch (CPU, exact Hugging Face arithmetic) or flashinfer's fused
CUDA kernels (one launch each for add + RMSNorm, the gated activation, RoPE).

Both follow the model config: RMSNorm scaling by w (Llama: normalise in fp32, cast, then scale) or by
(1 + w) in fp32 (Gemma: `norm_offset`), SiLU or GELU-tanh gates, one RoPE per layer kind.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from lorafleet.models.contract import ModelConfig
from lorafleet.runner.model.rope import Rope, apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Hugging Face's RMSNorms, op for op: normalise in fp32; Llama casts back then scales by w, Gemma scales
    by (offset + w) in fp32 and then casts."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (xf * (offset + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


_LT_LOCK = threading.Lock()
_lt_state = {"depth": 0, "prev": None}


@contextlib.contextmanager
def prefer_cublaslt():
    """GEMMs called inside go to cuBLASLt. torch's preferred BLAS backend is process-wide: the first of
    any nested or concurrent holders (threads of engines in one process) saves it and sets cuBLASLt, the
    last one out restores it, so overlapping holders never leave cuBLASLt set. A GEMM of another thread
    that runs meanwhile also goes to cuBLASLt: the same product, another kernel. CUDA builds only; inside
    a CUDA-graph capture the captured kernels are cuBLASLt's."""
    with _LT_LOCK:
        if _lt_state["depth"] == 0:
            _lt_state["prev"] = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
        _lt_state["depth"] += 1
    try:
        yield
    finally:
        with _LT_LOCK:
            _lt_state["depth"] -= 1
            if _lt_state["depth"] == 0:
                torch.backends.cuda.preferred_blas_library(_lt_state["prev"])


class TorchOps:
    name = "torch"

    def __init__(self, cfg: ModelConfig, ropes: list[Rope]):
        self.eps, self.offset, self.activation = cfg.rms_norm_eps, cfg.norm_offset, cfg.activation
        self.ropes = ropes

    def rms_norm(self, x, w):
        return rms_norm(x, w, self.eps, self.offset)

    def add_rms_norm(self, x, residual, w):
        """(norm(residual + x), residual + x); the norm written into x where x has spare columns beside it (the
        previous projection's output on LoRA's dense path, whose K-extended GEMM reads them), as flashinfer's
        in-place kernel does."""
        h = residual + x
        out = rms_norm(h, w, self.eps, self.offset)
        if x.dim() == 2 and x.stride(0) > x.shape[1]:
            return x.copy_(out), h
        return out, h

    def head_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm of x [T, heads, D] (q/k norms) -> a new [T, heads, D] tensor."""
        return rms_norm(x, w, self.eps, self.offset)

    def act_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        gate, up = gate_up.split([inter, inter], dim=-1)
        if self.activation == "gelu_tanh":
            return F.gelu(gate, approximate="tanh") * up
        return F.silu(gate) * up

    def rope_cos_sin(self, positions, dtype):
        """Per RoPE of the model: (cos, sin) for these positions (None where a kernel computes its own)."""
        return [r.cos_sin(positions, dtype) for r in self.ropes]

    def apply_rope(self, rope: int, q, k, positions, cos_sin):
        """q [T, Hq, D], k [T, Hkv, D] -> rotated (new tensors, or the inputs rotated in place)."""
        cos, sin = cos_sin[rope]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


class FlashInferOps(TorchOps):
    name = "flashinfer"

    def __init__(self, cfg: ModelConfig, ropes: list[Rope], max_positions: int):
        super().__init__(cfg, ropes)
        import flashinfer

        self.fi = flashinfer
        self.caches = [r.cache(max_positions) for r in ropes]  # fp32 [P, R] per RoPE: cos | sin
        # flashinfer's RoPE kernel is built for these head sizes; others (Phi-3-mini's 96) rotate in torch
        self.torch_rope = cfg.head_dim not in (64, 128, 256, 512)

    def rms_norm(self, x, w):
        if self.offset:
            return self.fi.gemma_rmsnorm(x, w, self.eps)
        return self.fi.rmsnorm(x, w, self.eps)

    def add_rms_norm(self, x, residual, w):
        # in place: residual += x; x = rmsnorm(residual)
        if self.offset:
            self.fi.gemma_fused_add_rmsnorm(x, residual, w, self.eps)
        else:
            self.fi.fused_add_rmsnorm(x, residual, w, self.eps)
        return x, residual

    def head_norm(self, x, w):
        T, n, D = x.shape
        return self.rms_norm(x.reshape(T * n, D), w).view(T, n, D)

    def act_mul(self, gate_up, inter):
        if self.activation == "gelu_tanh":
            return self.fi.gelu_tanh_and_mul(gate_up)
        return self.fi.silu_and_mul(gate_up)

    def rope_cos_sin(self, positions, dtype):
        return super().rope_cos_sin(positions, dtype) if self.torch_rope else None

    def apply_rope(self, rope, q, k, positions, cos_sin):
        if self.torch_rope:
            return super().apply_rope(rope, q, k, positions, cos_sin)
        T, hq, D = q.shape
        hk = k.shape[1]
        q = q.reshape(T, hq * D).contiguous()
        k = k.reshape(T, hk * D).contiguous()
        self.fi.apply_rope_with_cos_sin_cache_inplace(positions, q, k, D, self.caches[rope], is_neox=True)
        return q.view(T, hq, D), k.view(T, hk, D)


def make_ops(cfg: ModelConfig, ropes: list[Rope], device: torch.device, max_positions: int, fused: bool = True):
    """flashinfer's fused ops on CUDA when importable and `fused` (KernelChoices.fused_ops), else torch ops."""
    if device.type == "cuda" and fused:
        try:
            return FlashInferOps(cfg, ropes, max_positions)
        except ImportError:
            pass
    return TorchOps(cfg, ropes)

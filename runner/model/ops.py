"""The model's elementwise ops: plain torch (CPU, exact Hugging Face arithmetic) or
flashinfer's fused CUDA kernels (one launch each for add+RMSNorm, SiLU*up, RoPE)."""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F

from lorafleet.runner.model.rope import Rope, apply_rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm, op for op: normalise in fp32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
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

    def __init__(self, rope: Rope):
        self.rope = rope

    def rms_norm(self, x, w, eps):
        return rms_norm(x, w, eps)

    def add_rms_norm(self, x, residual, w, eps):
        """(norm(residual + x), residual + x)."""
        h = residual + x
        return rms_norm(h, w, eps), h

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        gate, up = gate_up.split([inter, inter], dim=-1)
        return F.silu(gate) * up

    def rope_cos_sin(self, positions, dtype):
        return self.rope.cos_sin(positions, dtype)

    def apply_rope(self, q, k, positions, cos_sin, heads, kv_heads, head_dim):
        """q [T, Hq*D], k [T, Hkv*D] views -> rotated q [T, Hq, D], k [T, Hkv, D]."""
        cos, sin = cos_sin
        T = q.shape[0]
        return (apply_rope(q.view(T, heads, head_dim), cos, sin), apply_rope(k.view(T, kv_heads, head_dim), cos, sin))


class FlashInferOps(TorchOps):
    name = "flashinfer"

    def __init__(self, rope: Rope, max_positions: int):
        super().__init__(rope)
        import flashinfer

        self.fi = flashinfer
        pos = torch.arange(max_positions, device=rope.inv_freq.device, dtype=torch.float32)
        freqs = pos[:, None] * rope.inv_freq[None, :]  # [P, D/2]
        self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).contiguous()  # fp32 [P, D]

    def rms_norm(self, x, w, eps):
        return self.fi.rmsnorm(x, w, eps)

    def add_rms_norm(self, x, residual, w, eps):
        # in place: residual += x; x = rmsnorm(residual)
        self.fi.fused_add_rmsnorm(x, residual, w, eps)
        return x, residual

    def silu_mul(self, gate_up, inter):
        return self.fi.silu_and_mul(gate_up)

    def rope_cos_sin(self, positions, dtype):
        return None

    def apply_rope(self, q, k, positions, cos_sin, heads, kv_heads, head_dim):
        q = q.contiguous()
        k = k.contiguous()
        self.fi.apply_rope_with_cos_sin_cache_inplace(positions, q, k, head_dim, self.cos_sin_cache, is_neox=True)
        T = q.shape[0]
        return q.view(T, heads, head_dim), k.view(T, kv_heads, head_dim)


def make_ops(rope: Rope, device: torch.device, max_positions: int, prefer: str = "auto"):
    """flashinfer's fused ops on CUDA when importable (LORAFLEET_FUSED_OPS=0 keeps torch ops)."""
    from lorafleet import env

    if not env.fused_ops():
        prefer = "torch"
    if device.type == "cuda" and prefer in ("auto", "flashinfer"):
        try:
            return FlashInferOps(rope, max_positions)
        except ImportError:
            if prefer == "flashinfer":
                raise
    return TorchOps(rope)

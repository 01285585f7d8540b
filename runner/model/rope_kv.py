"""Rotary embedding of q and k plus the K/V cache write in one CUDA launch (csrc/rope_kv.cu).

Without it a decode layer spends five small launches between the qkv projection and attention
(two contiguous copies of the q and k views, flashinfer's RoPE, two index copies into the cache);
in a CUDA graph of ~600 launches each costs its own scheduling gap.
"""

from __future__ import annotations

import logging

import torch

from lorafleet import env

log = logging.getLogger(__name__)


class RopeKv:
    """`(q_out, k_flat, v_flat, qkv, positions, slots)`: q_out [T, Hq, D] = rope(q), cache[slots] =
    (rope(k), v), from the fused qkv rows [T, (Hq + 2 Hkv) * D]; angles from the model's fp32
    cos/sin cache (the one flashinfer's RoPE reads), computed in fp32 and rounded once."""

    def __init__(self, ext, cos_sin: torch.Tensor, num_heads: int, num_kv_heads: int):
        self.ext, self.cos_sin = ext, cos_sin
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads

    def __call__(self, q_out, k_flat, v_flat, qkv, positions, slots, lora=None) -> torch.Tensor:
        """`lora` = (v [T, 3, R] fp32, [b_q, b_k, b_v] pools, ranks [3, S] int32, row_slot [T] int32): the
        qkv rows' LoRA expand, added in the kernel before the rotation (the same bits as the SGMV expand
        run first)."""
        stream = torch.cuda.current_stream(qkv.device).cuda_stream
        if lora is None:
            self.ext.rope_kv(q_out, k_flat, v_flat, qkv, positions, slots, self.cos_sin, self.num_heads,
                             self.num_kv_heads, stream)
        else:
            v, b, ranks, row_slot = lora
            self.ext.rope_kv_lora(q_out, k_flat, v_flat, qkv, positions, slots, self.cos_sin, self.num_heads,
                                  self.num_kv_heads, stream, v, list(b), ranks, row_slot)
        return q_out


def fused_rope_kv(model) -> RopeKv | None:
    """The one-launch kernel for `model`, or None: not CUDA, not the fused ops (whose cos/sin cache it
    shares), a dtype other than fp16/bf16, LORAFLEET_ROPE_KV=0, or the extension does not build."""
    cos_sin = getattr(model.ops, "cos_sin_cache", None)
    if model.device.type != "cuda" or cos_sin is None or model.dtype not in (torch.float16, torch.bfloat16):
        return None
    if not env.rope_kv_kernel() or model.cfg.head_dim % 4:
        return None
    try:
        from lorafleet.runner.kernels import load

        ext = load()
    except Exception as exc:  # no compiler on this machine: the five-launch path stays
        log.warning("rope_kv kernel unavailable (%s); decode graphs use flashinfer's RoPE and index copies", exc)
        return None
    return RopeKv(ext, cos_sin, model.cfg.num_heads, model.cfg.num_kv_heads)

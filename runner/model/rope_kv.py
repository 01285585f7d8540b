"""The K/V writer of a layer: RoPE on q and k, then k and v into the layer's pages at the step's slots.

Two implementations of one contract, `writer(layer, qkv, io, expand) -> q [T, q_dim]` (rotated; in io.q for
static buffers):
- `TorchKvWriter`: the model's ops (torch or flashinfer's RoPE) and two index copies, any device, any RoPE;
- `FusedKvWriter`: one launch of the project's CUDA kernel (csrc/rope_kv.cu), which also takes the qkv rows'
  LoRA expand when the LoRA step leaves it (`expand`, decode graphs with KernelChoices.rope_kv_lora).

Without the fused kernel a decode layer spends five small launches between the qkv projection and
attention (two contiguous copies of the q and k views, RoPE, two index copies into the cache); in a CUDA
graph of ~600 launches each costs its own scheduling gap.
"""

from __future__ import annotations

import logging

import torch

from lorafleet.runner.model.fp8 import to_e4m3

log = logging.getLogger(__name__)


class TorchKvWriter:
    def __init__(self, model, flat):
        """`flat(layer)` -> (k, v) pages of a layer as [slots, kv_heads, head_dim] views."""
        self.model, self.flat = model, flat
        c = model.cfg
        self.split = [c.q_dim, c.kv_dim, c.kv_dim]

    def __call__(self, layer: int, qkv: torch.Tensor, io, expand=None) -> torch.Tensor:
        if expand is not None:
            raise RuntimeError("the LoRA expand can only be left to the fused K/V writer")
        c, m = self.model.cfg, self.model
        T = qkv.shape[0]
        q, k, v = qkv.split(self.split, dim=-1)  # strided views
        q, k = m.ops.apply_rope(c.layer_rope[layer], q.view(T, c.num_heads, c.head_dim),
                                k.view(T, c.num_kv_heads, c.head_dim), io.positions, io.cos_sin)
        k_flat, v_flat = self.flat(layer)
        v = v.view(T, c.num_kv_heads, c.head_dim)
        if k_flat.dtype != k.dtype:  # FP8 pages: saturating e4m3 (scale 1), copied as bytes
            k_flat, v_flat = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
            k, v = to_e4m3(k).view(torch.uint8), to_e4m3(v).view(torch.uint8)
        k_flat.index_copy_(0, io.slots, k)
        v_flat.index_copy_(0, io.slots, v)
        if io.static:
            io.q.view(T, c.num_heads, c.head_dim).copy_(q)
            return io.q
        return q.reshape(T, c.q_dim)


class FusedKvWriter:
    """`rope_kv(q_out, k_flat, v_flat, qkv, positions, slots, cos_sin, heads, kv_heads, stream)`: q_out
    [T, Hq, D] = rope(q), cache[slots] = (rope(k), v), from the qkv rows [T, (Hq + 2 Hkv) * D]; angles from
    the layer's fp32 cos/sin cache (the one flashinfer's RoPE reads), computed in fp32 and rounded once (for
    e4m3 pages then cast as TorchKvWriter's to_e4m3 does). Rows whose slot is negative write nothing.
    `pdl` (KernelChoices.rope_kv_pdl): launched with programmatic dependent launch, its blocks waiting for the
    kernel before (qkv's) first, so that they are resident when that kernel lets them start early."""

    def __init__(self, ext, model, flat, pdl: bool = False):
        self.ext, self.model, self.flat = ext, model, flat
        self.caches = model.ops.caches  # per RoPE: fp32 [P, D]
        self.launch = {"pdl": True} if pdl else {}  # (the kernel's argument only where taken)

    def __call__(self, layer: int, qkv: torch.Tensor, io, expand=None) -> torch.Tensor:
        """`expand` = (v [T, 3, R] fp32, [b_q, b_k, b_v] pools, ranks [3, S] int32, row_slot [T] int32): the
        qkv rows' LoRA expand, added in the kernel before the rotation (the same bits as the SGMV expand
        run first)."""
        c = self.model.cfg
        T = qkv.shape[0]
        q_out = io.q.view(-1, c.num_heads, c.head_dim)[:T] if io.static else torch.empty(
            T, c.num_heads, c.head_dim, dtype=qkv.dtype, device=qkv.device)
        k_flat, v_flat = self.flat(layer)
        cos_sin = self.caches[c.layer_rope[layer]]
        stream = torch.cuda.current_stream(qkv.device).cuda_stream
        if expand is None:
            self.ext.rope_kv(q_out, k_flat, v_flat, qkv, io.positions, io.slots, cos_sin, c.num_heads,
                             c.num_kv_heads, stream, **self.launch)
        else:
            v, b, ranks, row_slot = expand
            self.ext.rope_kv_lora(q_out, k_flat, v_flat, qkv, io.positions, io.slots, cos_sin, c.num_heads,
                                  c.num_kv_heads, stream, v, list(b), ranks, row_slot, **self.launch)
        return io.q if io.static else q_out.view(T, c.q_dim)


def make_kv_writer(model, flat, fused: bool = True, fp8_pages: bool = False, pdl: bool = False):
    """The fused writer where it can run (CUDA, flashinfer's ops whose cos/sin caches it shares, fp16/bf16,
    full rotary embeddings, head_dim a multiple of 4, pages in the model's dtype or, with `fp8_pages`
    (KernelChoices.rope_kv_fp8), e4m3 pages, `fused` i.e. KernelChoices.rope_kv, the extension builds), launched
    with programmatic dependent launch where `pdl` (KernelChoices.rope_kv_pdl), else the torch writer."""
    c = model.cfg
    page_dtype = flat(0)[0].dtype
    ok = (fused and model.device.type == "cuda" and hasattr(model.ops, "caches")
          and model.dtype in (torch.float16, torch.bfloat16) and c.head_dim % 4 == 0
          and all(r.rotary_dim == c.head_dim for r in c.ropes)
          and (page_dtype == model.dtype or (fp8_pages and page_dtype == torch.float8_e4m3fn)))
    if ok:
        try:
            from lorafleet.runner.kernels import load

            return FusedKvWriter(load(), model, flat, pdl)
        except Exception as exc:  # no compiler on this machine: the five-launch path stays
            log.warning("rope_kv kernel unavailable (%s); RoPE and the K/V write take flashinfer's RoPE and index copies", exc)
    return TorchKvWriter(model, flat)

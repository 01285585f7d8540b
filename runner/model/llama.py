"""Llama decoder (RMSNorm, RoPE, GQA, SwiGLU, tied or untied embeddings) over a flat batch.

The forward pass sees one flat batch `[num_tokens, hidden]` per step: prefill tokens of
several requests followed by decode tokens. Attention and the LoRA add-on get their
per-step metadata (page tables, segment table) from objects built once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from lorafleet import env
from lorafleet.runner.config import ModelConfig
from lorafleet.runner.model.ops import make_ops, prefer_cublaslt
from lorafleet.runner.model.rope import Rope
from lorafleet.runner.model.weights import WeightsError

# Group indices for LoraStep.add: projections that share an input run as one SGMV launch.
QKV, O, GATE_UP, DOWN = 0, 1, 2, 3


class AttentionStep(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq * D] (written into `out` when given);
        writes k/v to the paged cache."""


class LoraStep(Protocol):
    def add(self, layer: int, group: int, x: torch.Tensor, ys: tuple[torch.Tensor, ...]) -> None:
        """ys[g] += LoRA add-on of x for projection g of the group, per segment."""


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [q_dim + 2 * kv_dim, H]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor  # [H, q_dim]
    o_bias: torch.Tensor | None
    mlp_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 * I, H]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor  # [H, I]
    down_bias: torch.Tensor | None


class LlamaModel:
    """With tensor parallelism, `cfg` is this rank's part (its heads, KV heads and MLP width; see
    runner/parallel/shard.py), `tensors` hold this rank's slices, `full_cfg` is the whole model and
    `all_reduce(t)` sums a tensor over the group in place (after the o and down projections)."""

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 ops: str = "auto", full_cfg: ModelConfig | None = None, tp_rank: int = 0, all_reduce=None):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.full_cfg = full_cfg or cfg
        self.all_reduce = all_reduce
        self.rope = Rope(cfg, device)
        self.ops = make_ops(self.rope, device, cfg.max_position_embeddings, ops)
        # Steps of at most this many rows run the o and down GEMMs on cuBLASLt (env.blas_lt_rows: measured
        # on the H200 for the one-GPU Llama-2-7B shapes, so not with tensor parallelism).
        self.lt_rows = env.blas_lt_rows() if device.type == "cuda" and all_reduce is None else 0

        def take(name: str, required: bool = True) -> torch.Tensor | None:
            t = tensors.pop(name, None)
            if t is None:
                if required:
                    raise WeightsError(f"weights are missing tensor {name}")
                return None
            return t.to(device=device, dtype=dtype)

        def cat(names: list[str], required: bool = True) -> torch.Tensor | None:
            parts = [take(n, required) for n in names]
            return None if any(p is None for p in parts) else torch.cat(parts, 0).contiguous()

        self.embed = take("model.embed_tokens.weight")  # [V, H]
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv_names = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
            self.layers.append(
                LayerWeights(
                    attn_norm=take(p + "input_layernorm.weight"),
                    qkv=cat(qkv_names),
                    qkv_bias=cat([n.replace(".weight", ".bias") for n in qkv_names], cfg.attention_bias),
                    o=take(p + "self_attn.o_proj.weight"),
                    o_bias=take(p + "self_attn.o_proj.bias", cfg.attention_bias and tp_rank == 0),
                    mlp_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=cat([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    gate_up_bias=cat([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"], cfg.mlp_bias),
                    down=take(p + "mlp.down_proj.weight"),
                    down_bias=take(p + "mlp.down_proj.bias", cfg.mlp_bias and tp_rank == 0),
                )
            )
        self.norm = take("model.norm.weight")
        lm_head = take("lm_head.weight", required=not cfg.tie_word_embeddings)
        self.lm_head = self.embed if lm_head is None else lm_head  # [V, H]
        self._check_shapes()
        leftover = [n for n in tensors if "rotary_emb" not in n]
        if leftover:
            raise WeightsError(f"unexpected tensors in the weights, e.g. {leftover[:3]}")

    def _check_shapes(self) -> None:
        c = self.cfg
        want = {
            "embed": (self.embed, (c.vocab_size, c.hidden_size)),
            "lm_head": (self.lm_head, (c.vocab_size, c.hidden_size)),
        }
        l0 = self.layers[0]
        want["qkv"] = (l0.qkv, (c.q_dim + 2 * c.kv_dim, c.hidden_size))
        want["o"] = (l0.o, (c.hidden_size, c.q_dim))
        want["gate_up"] = (l0.gate_up, (2 * c.intermediate_size, c.hidden_size))
        want["down"] = (l0.down, (c.hidden_size, c.intermediate_size))
        for name, (t, shape) in want.items():
            if tuple(t.shape) != shape:
                raise WeightsError(f"{name} has shape {tuple(t.shape)}, config.json implies {shape}")

    # -- the forward pass in parts (whole steps and piecewise CUDA graphs share them) -------------
    def embed_tokens(self, input_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            return F.embedding(input_ids, self.embed)  # [T, H]
        return torch.index_select(self.embed, 0, input_ids, out=out)

    def qkv_proj(self, i: int, h: torch.Tensor, residual: torch.Tensor | None, lora: LoraStep | None,
                 defer_expand: bool = False):
        """Layer i's norm, fused qkv projection and its LoRA: (qkv [T, q_dim + 2 kv_dim], residual).
        `defer_expand` (the caller hands the result to a rope_kv kernel that can add it): returns
        (qkv, residual, expand), where expand is the LoRA expand the LoRA step left to that kernel
        (`add_qkv`), or None when it added it itself."""
        c, ops, lw = self.cfg, self.ops, self.layers[i]
        if residual is None:
            residual, x = h, ops.rms_norm(h, lw.attn_norm, c.rms_norm_eps)
        else:
            x, residual = ops.add_rms_norm(h, residual, lw.attn_norm, c.rms_norm_eps)
        qkv = F.linear(x, lw.qkv, lw.qkv_bias)
        expand = None
        if lora is not None:
            ys = qkv.split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)
            add_qkv = getattr(lora, "add_qkv", None) if defer_expand else None
            if add_qkv is not None:
                expand = add_qkv(i, x, ys)
            else:
                lora.add(i, QKV, x, ys)
        return (qkv, residual, expand) if defer_expand else (qkv, residual)

    def pre_attention(self, i: int, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                      cos_sin, lora: LoraStep | None, qkv_out: tuple[torch.Tensor, ...] | None = None):
        """Layer i up to attention: (norm, qkv, LoRA, RoPE) -> q [T, Hq, D], k, v [T, Hkv, D], residual.
        With `qkv_out`, q, k and v are written to those [T, dim] buffers."""
        c, ops = self.cfg, self.ops
        T = h.shape[0]
        qkv, residual = self.qkv_proj(i, h, residual, lora)
        q, k, v = qkv.split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)  # strided views
        if qkv_out is not None:
            for src, dst in zip((q, k, v), qkv_out):
                dst.copy_(src)
            q, k, v = qkv_out
        q, k = ops.apply_rope(q, k, positions, cos_sin, c.num_heads, c.num_kv_heads, c.head_dim)
        if qkv_out is not None and q.data_ptr() != qkv_out[0].data_ptr():  # ops that do not rotate in place
            qkv_out[0].view_as(q).copy_(q)
            qkv_out[1].view_as(k).copy_(k)
            q, k = qkv_out[0].view_as(q), qkv_out[1].view_as(k)
        return q, k, v.view(T, c.num_kv_heads, c.head_dim), residual

    def post_attention(self, i: int, o: torch.Tensor, residual: torch.Tensor, lora: LoraStep | None):
        """Layer i after attention: o-proj, LoRA, norm, MLP, LoRA -> (h, residual)."""
        c, ops, lw = self.cfg, self.ops, self.layers[i]
        out = self._linear_small(o, lw.o, lw.o_bias)  # [T, H] (a partial sum with tensor parallelism)
        if lora is not None:
            lora.add(i, O, o, (out,))
        if self.all_reduce is not None:
            self.all_reduce(out)
        x, residual = ops.add_rms_norm(out, residual, lw.mlp_norm, c.rms_norm_eps)
        gu = F.linear(x, lw.gate_up, lw.gate_up_bias)  # [T, 2 I]
        if lora is not None:
            gate, up = gu.split([c.intermediate_size, c.intermediate_size], dim=-1)
            lora.add(i, GATE_UP, x, (gate, up))
        a = ops.silu_mul(gu, c.intermediate_size)  # [T, I]
        h = self._linear_small(a, lw.down, lw.down_bias)  # [T, H] (a partial sum with tensor parallelism)
        if lora is not None:
            lora.add(i, DOWN, a, (h,))
        if self.all_reduce is not None:
            self.all_reduce(h)
        return h, residual

    def _linear_small(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """x @ w.T + b; on cuBLASLt for steps of at most `lt_rows` rows (the o and down projections)."""
        if 0 < x.shape[0] <= self.lt_rows:
            with prefer_cublaslt():
                return F.linear(x, w, b)
        return F.linear(x, w, b)

    def logits(self, h: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x, _ = self.ops.add_rms_norm(h.index_select(0, rows), residual.index_select(0, rows), self.norm,
                                     self.cfg.rms_norm_eps)
        return F.linear(x, self.lm_head).float()  # [B, V]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        attn: AttentionStep,
        lora: LoraStep | None,
        logit_rows: torch.Tensor,  # int64 [B] rows whose next-token logits are wanted
    ) -> torch.Tensor:  # fp32 [B, V]
        h = self.embed_tokens(input_ids)
        cos_sin = self.ops.rope_cos_sin(positions, self.dtype)
        residual = None
        # Attention that takes the raw qkv rows (decode graphs with the rope_kv kernel) rotates q/k
        # and writes the cache itself, in one launch.
        attend_qkv = getattr(attn, "attend_qkv", None)
        for i in range(len(self.layers)):
            if attend_qkv is not None:
                qkv, residual, expand = self.qkv_proj(i, h, residual, lora, defer_expand=True)
                o = attend_qkv(i, qkv, positions, expand)
            else:
                q, k, v, residual = self.pre_attention(i, h, residual, positions, cos_sin, lora)
                o = attn(i, q, k, v)  # [T, q_dim]
            h, residual = self.post_attention(i, o, residual, lora)
        return self.logits(h, residual, logit_rows)

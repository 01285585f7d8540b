"""Rotary position embeddings (rotate-half convention) from a RopeSpec: theta, scaling, partial rotary."""

from __future__ import annotations

import math

import torch

from lorafleet.models.contract import RopeSpec


def inv_frequencies(spec: RopeSpec) -> torch.Tensor:
    """fp32 [rotary_dim / 2] inverse frequencies, scaled as the spec's kind says (transformers' arithmetic)."""
    d = spec.rotary_dim
    inv = 1.0 / (spec.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if spec.kind == "linear":
        inv = inv / spec.factor
    elif spec.kind == "llama3":
        low, high, old_ctx = spec.low_freq_factor, spec.high_freq_factor, float(spec.original_max_position_embeddings)
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / spec.factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif spec.kind in ("longrope", "freq_factors"):  # each frequency divided by its factor
        ext = torch.tensor(spec.ext_factors, dtype=torch.float32)
        inv = 1.0 / (ext * spec.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    return inv


class Rope:
    """One rotary embedding on a device: cos/sin per position, `attention_factor` included."""

    def __init__(self, spec: RopeSpec, device: torch.device):
        self.spec = spec
        self.rotary_dim = spec.rotary_dim
        self.inv_freq = inv_frequencies(spec).to(device)  # fp32 [R/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R] for int positions [T], computed in fp32 then cast."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.spec.attention_factor != 1.0:
            cos, sin = cos * self.spec.attention_factor, sin * self.spec.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def cache(self, max_positions: int) -> torch.Tensor:
        """fp32 [P, R]: cos | sin halves per position (flashinfer's and the rope_kv kernel's layout)."""
        pos = torch.arange(max_positions, device=self.inv_freq.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]  # [P, R/2]
        return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self.spec.attention_factor).contiguous()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, R] with R <= D: the first R dimensions rotate, the rest pass."""
    c, s = cos[:, None, :], sin[:, None, :]
    R = cos.shape[-1]
    if R == x.shape[-1]:
        return x * c + _rotate_half(x) * s
    rot, rest = x[..., :R], x[..., R:]
    return torch.cat((rot * c + _rotate_half(rot) * s, rest), dim=-1)

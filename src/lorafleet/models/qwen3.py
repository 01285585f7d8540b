"""Qwen3 (dense): Llama's layers with a per-head RMSNorm of q and k before RoPE, no biases by default, and
`head_dim` independent of hidden / heads. Windows as Qwen2."""

from __future__ import annotations

import dataclasses

from lorafleet.models import llama, qwen2
from lorafleet.models.contract import Family, Gguf, ModelConfig, hf_bool


def config_from_hf(cfg: dict, name: str = "") -> ModelConfig:
    base = qwen2.config_from_hf(cfg, name, family="qwen3", head_dim=128)  # transformers' default head_dim
    bias = hf_bool(cfg, "attention_bias", False)
    return dataclasses.replace(base, qk_norm=True, qkv_bias=bias, o_bias=bias)


FAMILY = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    config=config_from_hf,
    checkpoint=llama.CHECKPOINT,
    gguf=Gguf(arch="qwen3", layer={**llama.GGUF_LAYER, "attn_q_norm": "self_attn.q_norm",
                                   "attn_k_norm": "self_attn.k_norm"}, globals=llama.GGUF_GLOBALS),
    notes="Qwen3 dense",
)

SHAPES = {
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     use_sliding_window=False, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
                     hidden_act="silu", attention_bias=False),
}

"""Mistral: Llama's layers, with sliding-window attention on every layer when the config sets a window
(v0.1) and full attention without (v0.2 and later, Mistral-Small); `head_dim` may differ from hidden / heads."""

from __future__ import annotations

import dataclasses

from lorafleet.models import llama
from lorafleet.models.contract import Family, ModelConfig


def config_from_hf(cfg: dict, name: str = "") -> ModelConfig:
    base = llama.config_from_hf(cfg, name)
    window = cfg.get("sliding_window", 4096)  # transformers' default when config.json has no such key
    w = int(window) if window else None
    return dataclasses.replace(base, family="mistral", layer_window=(w,) * base.num_layers)


FAMILY = Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    model_types=("mistral",),
    config=config_from_hf,
    checkpoint=llama.CHECKPOINT,
    notes="Mistral, with or without a sliding window",
)

SHAPES = {
    "mistral-7b": dict(architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=32000, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, hidden_act="silu"),
}

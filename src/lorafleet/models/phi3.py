"""Phi-3 and Phi-4-mini: fused `qkv_proj` and `gate_up_proj` in the checkpoint (and as LoRA targets),
partial rotary embeddings (Phi-4-mini rotates 3/4 of each head), LongRoPE, a sliding window when the config
sets one (Phi-3-mini-4k: 2047).

LongRoPE runs with the checkpoint's short factors, which transformers uses while a sequence stays within
`original_max_position_embeddings`; beyond that it switches every position of the sequence to the long
factors, which a paged KV cache cannot follow, so the context is capped there (`ModelConfig.__post_init__`;
the engine logs the cap at load: `ModelConfig.context_cap_note`)."""

from __future__ import annotations

import dataclasses

from lorafleet.models import llama
from lorafleet.models.contract import Family, Gguf, ModelConfig, check_activation, common_fields

MODULES = {**llama.MODULES, "q": "self_attn.qkv_proj", "k": "self_attn.qkv_proj", "v": "self_attn.qkv_proj",
           "gate": "mlp.gate_up_proj", "up": "mlp.gate_up_proj"}


def gguf_config(field, tensor, cfg: dict) -> None:
    """llama.cpp's Phi-3 metadata: the rotary dimension (partial rotary), the sliding window, and LongRoPE's
    factors, which it stores as tensors (the short ones are what the engine runs with)."""
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg.pop("head_dim", None)
    rot = field("rope.dimension_count", None)
    if rot:
        cfg["partial_rotary_factor"] = int(rot) / head_dim
    window = field("attention.sliding_window", None)
    if window:
        cfg["sliding_window"] = int(window)
    short, long = tensor("rope_factors_short.weight"), tensor("rope_factors_long.weight")
    if short is not None:
        omax = field("rope.scaling.original_context_length", None) or cfg["max_position_embeddings"]
        cfg["rope_scaling"] = {"rope_type": "longrope", "short_factor": [float(x) for x in short],
                               "long_factor": [float(x) for x in (long if long is not None else short)],
                               "original_max_position_embeddings": int(omax)}
        att = field("rope.scaling.attn_factor", None)
        if att:
            cfg["rope_scaling"]["attention_factor"] = float(att)


def config_from_hf(cfg: dict, name: str = "") -> ModelConfig:
    check_activation(cfg, ("silu",))
    f = common_fields(cfg, "phi3", name)
    rope = llama.single_rope(cfg, f["head_dim"], float(cfg.get("partial_rotary_factor", 1.0)))
    window = cfg.get("sliding_window")
    # (Phi-3's projections have no biases; LongRoPE's context cap is the contract's)
    return ModelConfig(**f, ropes=rope, layer_rope=(0,) * f["num_layers"],
                       layer_window=(int(window) if window else None,) * f["num_layers"])


FAMILY = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    config=config_from_hf,
    checkpoint=dataclasses.replace(llama.CHECKPOINT, modules=MODULES),
    gguf=Gguf(arch="phi3", layer={"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                                  "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                                  "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
              globals=llama.GGUF_GLOBALS, skip=("rope_factors_long.weight", "rope_factors_short.weight"),
              config=gguf_config),
    notes="Phi-3, Phi-3.5, Phi-4-mini",
)

SHAPES = {
    "phi-4-mini": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=200064, hidden_size=3072,
                       intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
                       max_position_embeddings=131072, original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=199999,
                       eos_token_id=199999, hidden_act="silu",
                       rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48}),
}

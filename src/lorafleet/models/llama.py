"""Llama 2 and 3.x (RMSNorm, RoPE with linear or llama3 scaling, GQA, SwiGLU, tied or untied embeddings).

Also the tables other families start from: the Hugging Face Llama tensor names and llama.cpp's GGUF names.
"""

from __future__ import annotations

from lorafleet.models.contract import (Checkpoint, Family, Gguf, ModelConfig, ModelConfigError, check_activation,
                                       common_fields, hf_bool, hf_float, hf_int, rope_from_hf)

MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
NORMS = {
    "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",  # unused (no sandwich norms)
    "post_mlp_norm": "post_feedforward_layernorm.weight",  # unused
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
CHECKPOINT = Checkpoint(modules=MODULES, norms=NORMS, layer="model.layers.{i}.", embed="model.embed_tokens.weight",
                        final_norm="model.norm.weight", lm_head="lm_head.weight", ignore=("rotary_emb.inv_freq",))

GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBALS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def rope_params(cfg: dict) -> tuple[dict, float]:
    """(rope dict, its theta): transformers 5 writes `rope_parameters` (with rope_theta inside), 4.x writes
    `rope_theta` and `rope_scaling`. Where a config has both, transformers (4.x and 5) reads `rope_scaling`, its theta
    its own or else the top-level one, and so does this (convert_rope_params_to_dict: `rope_scaling or
    rope_parameters`)."""
    theta = hf_float(cfg, "rope_theta", 10000.0, minimum=0.0)
    params = rope_dict(cfg, "rope_scaling") or rope_dict(cfg, "rope_parameters")
    return params, hf_float(params, "rope_theta", theta, minimum=0.0)


def rope_dict(cfg: dict, key: str) -> dict:
    """config.json's `key` (rope_parameters, rope_scaling) as a dict, {} when absent or null."""
    v = cfg.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ModelConfigError(f"the model's config: {key!r} must be an object, got {v!r}")
    return dict(v)


def single_rope(cfg: dict, head_dim: int, partial_rotary_factor: float = 1.0) -> tuple:
    params, theta = rope_params(cfg)
    return (rope_from_hf(params, head_dim, hf_int(cfg, "max_position_embeddings", 4096, minimum=1), theta,
                         partial_rotary_factor, cfg.get("original_max_position_embeddings")),)


def config_from_hf(cfg: dict, name: str = "") -> ModelConfig:
    check_activation(cfg, ("silu",))
    f = common_fields(cfg, "llama", name)
    bias = hf_bool(cfg, "attention_bias", False)
    return ModelConfig(
        **f, ropes=single_rope(cfg, f["head_dim"]), layer_rope=(0,) * f["num_layers"],
        layer_window=(None,) * f["num_layers"], qkv_bias=bias, o_bias=bias, mlp_bias=hf_bool(cfg, "mlp_bias", False))


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    config=config_from_hf,
    checkpoint=CHECKPOINT,
    gguf=Gguf(arch="llama", layer=GGUF_LAYER, globals=GGUF_GLOBALS, permute_qk=True),
    notes="Llama 2 and 3.x",
)

# Benchmark shapes (config.json of the published models; weights are drawn at random).
_LLAMA2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=4096,
               intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
               max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2, hidden_act="silu")
SHAPES = {
    "llama2-7b": _LLAMA2,
    "llama2-70b": dict(_LLAMA2, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8),
    "llama3-8b": dict(_LLAMA2, vocab_size=128256, intermediate_size=14336, num_key_value_heads=8,
                      max_position_embeddings=131072, rope_theta=500000.0, bos_token_id=128000,
                      eos_token_id=[128001, 128008, 128009],
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # a small GQA shape for the CPU tests of the benchmarks' own plumbing
    "tiny": dict(_LLAMA2, vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048),
}

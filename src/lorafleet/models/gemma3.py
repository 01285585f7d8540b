"""Gemma-3 text models (`Gemma3ForCausalLM`): RMSNorm scaling by (1 + w) computed in fp32, norms before and
after attention and the MLP, a GELU-tanh gate, embeddings times sqrt(hidden), per-head q/k norms, local
sliding-window layers and global layers each with their own RoPE, softmax scale `query_pre_attn_scalar`
** -0.5, optional logit soft-caps, tied lm_head."""

from __future__ import annotations

import dataclasses

from lorafleet.models import llama
from lorafleet.models.contract import (Family, Gguf, ModelConfig, ModelConfigError, check_activation,
                                       common_fields, hf_bool, hf_int, layer_types, rope_from_hf)

NORMS = {**llama.NORMS, "mlp_norm": "pre_feedforward_layernorm.weight",
         "post_attn_norm": "post_attention_layernorm.weight", "post_mlp_norm": "post_feedforward_layernorm.weight"}


def ropes(cfg: dict, head_dim: int) -> tuple:
    """(global RoPE, local RoPE): transformers 5 keeps one rope dict per layer type; 4.x has rope_theta and
    rope_scaling for global layers and rope_local_base_freq for local ones."""
    maxpos = int(cfg.get("max_position_embeddings", 131072))
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        return (rope_from_hf(full, head_dim, maxpos, 1_000_000.0), rope_from_hf(local, head_dim, maxpos, 10_000.0))
    full = dict(cfg.get("rope_scaling") or {})
    return (rope_from_hf(full, head_dim, maxpos, float(cfg.get("rope_theta", 1_000_000.0))),
            rope_from_hf({}, head_dim, maxpos, float(cfg.get("rope_local_base_freq", 10_000.0))))


def gguf_config(field, tensor, cfg: dict) -> None:
    """llama.cpp's Gemma-3 metadata: the window; GELU-tanh; tied embeddings unless the file has an output
    tensor; the local layers' RoPE base and the sliding-window pattern where the file has them. What it does
    not store, llama.cpp fixes for Gemma-3, and so does this: a local base of 10,000, every sixth layer
    global, and the softmax scale of head_dim ** -0.5 except for the 62-layer (27B) model, which scales by
    (hidden / heads) ** -0.5 (its query_pre_attn_scalar)."""
    window = field("attention.sliding_window", None)
    if window:
        cfg["sliding_window"] = int(window)
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg.pop("hidden_act", None)
    cfg["rope_local_base_freq"] = float(field("rope.freq_base_swa", 10000.0))
    pattern = field("attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, tuple)):  # per layer: true where the layer is local
        cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    else:
        cfg["sliding_window_pattern"] = int(pattern)
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"]
                                    if cfg["num_hidden_layers"] == 62 else cfg["head_dim"])


def config_from_hf(cfg: dict, name: str = "") -> ModelConfig:
    check_activation(cfg, ("gelu_pytorch_tanh", "gelu_tanh"), key="hidden_activation" if "hidden_activation" in cfg else "hidden_act")
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError("Gemma-3 with use_bidirectional_attention is an encoder; it is not supported")
    f = common_fields(cfg, "gemma3", name, head_dim=256)  # transformers' defaults where config.json is silent
    f["tie_word_embeddings"] = hf_bool(cfg, "tie_word_embeddings", True)
    f["max_position_embeddings"] = hf_int(cfg, "max_position_embeddings", 131072, minimum=1)
    L = f["num_layers"]
    lt = layer_types(cfg, L)
    if lt is None:
        pattern = int(cfg.get("sliding_window_pattern", 6))
        lt = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)]
    window = cfg.get("sliding_window", 4096)
    local = [t == "sliding_attention" for t in lt]  # the local RoPE follows the layer type, window or not
    bias = hf_bool(cfg, "attention_bias", False)
    soft = {k: (float(cfg[k]) if cfg.get(k) else None) for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    return ModelConfig(
        **f, ropes=ropes(cfg, f["head_dim"]), layer_rope=tuple(1 if s else 0 for s in local),
        layer_window=tuple(int(window) if s and window else None for s in local), qkv_bias=bias, o_bias=bias,
        qk_norm=True, norm_offset=1.0, sandwich_norms=True, activation="gelu_tanh",
        embed_scale=float(f["hidden_size"]) ** 0.5, attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=soft["attn_logit_softcapping"], final_softcap=soft["final_logit_softcapping"])


FAMILY = Family(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    config=config_from_hf,
    checkpoint=dataclasses.replace(llama.CHECKPOINT, norms=NORMS),
    gguf=Gguf(arch="gemma3", layer={**llama.GGUF_LAYER, "ffn_norm": "pre_feedforward_layernorm",
                                    "post_attention_norm": "post_attention_layernorm",
                                    "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
                                    "attn_k_norm": "self_attn.k_norm"},
              globals=llama.GGUF_GLOBALS, norm_shift=-1.0, config=gguf_config),
    notes="Gemma-3 text",
)

SHAPES = {
    "gemma-3-12b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262208,
                        hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                        sliding_window_pattern=6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=131072,
                        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                        bos_token_id=2, eos_token_id=[1, 106]),
}

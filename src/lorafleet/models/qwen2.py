"""Qwen2 / Qwen2.5: Llama's layers with biases on q, k and v (not o). The window applies only when the
config turns it on (`use_sliding_window`; the released configs say false) and then to the layers
`layer_types` (or, in older configs, `max_window_layers`) mark as sliding."""

from __future__ import annotations

from lorafleet.models import llama
from lorafleet.models.contract import (Family, Gguf, ModelConfig, check_activation, common_fields, layer_types)


def windows(cfg: dict, num_layers: int) -> tuple[int | None, ...]:
    """transformers' rule: a window only with use_sliding_window; sliding layers from layer_types, else layers
    from max_window_layers on."""
    w = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if not w:
        return (None,) * num_layers
    lt = layer_types(cfg, num_layers)
    if lt is None:
        first = int(cfg.get("max_window_layers", 28))  # transformers' default
        lt = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return tuple(int(w) if t == "sliding_attention" else None for t in lt)


def config_from_hf(cfg: dict, name: str = "", family: str = "qwen2", head_dim: int | None = None) -> ModelConfig:
    check_activation(cfg, ("silu",))
    f = common_fields(cfg, family, name, head_dim)
    return ModelConfig(**f, ropes=llama.single_rope(cfg, f["head_dim"]), layer_rope=(0,) * f["num_layers"],
                       layer_window=windows(cfg, f["num_layers"]), qkv_bias=True)


FAMILY = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    config=config_from_hf,
    checkpoint=llama.CHECKPOINT,
    gguf=Gguf(arch="qwen2", layer=llama.GGUF_LAYER, globals=llama.GGUF_GLOBALS),
    notes="Qwen2, Qwen2.5",
)

SHAPES = {
    "qwen2.5-7b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False,
                       sliding_window=131072, max_window_layers=28, tie_word_embeddings=False, bos_token_id=151643,
                       eos_token_id=151645, hidden_act="silu"),
}

"""Small random-weight models of every supported family, built by transformers' own config and model
classes, and PEFT adapters on them (import from here, not conftest).

Each family's config turns on what sets it apart: windows shorter than the test prompts, GQA, biases,
q/k norms, a head_dim that is not hidden / heads, sandwich norms, local and global RoPE, soft-caps,
fused checkpoint projections, partial rotary LongRoPE."""

from __future__ import annotations

from pathlib import Path

WINDOW = 8  # sliding windows shorter than the test prompts (which run 12 to 40 tokens)

# family -> (transformers config class name, model class name, config kwargs)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=WINDOW, head_dim=24)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_key_value_heads=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
        rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=32, attention_bias=False)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=20, sliding_window=WINDOW, sliding_window_pattern=2,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=WINDOW, original_max_position_embeddings=64,
        max_position_embeddings=256, tie_word_embeddings=False,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 2.0, 3.1], "long_factor": [4.0] * 4})),
}
# GPU-sized overrides (hidden 512, 4 heads): heads of 128 everywhere (the size the released checkpoints use);
# Gemma without the attention soft-cap (Gemma-3 has none; the CPU tests cover it); Phi-3's LongRoPE factors
# for its 64 rotary dimensions, and a context (original_max_position_embeddings, where the engine caps Phi-3)
# that holds the GPU tests' longest sequences (59-token prompts + 64 new tokens in the decode graph test).
GPU_OVERRIDES = {
    "mistral": dict(head_dim=128),
    "qwen3": dict(head_dim=128),
    "gemma3": dict(head_dim=128, query_pre_attn_scalar=96, attn_logit_softcapping=None),
    "phi3": dict(rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(32)],
                               "long_factor": [4.0] * 32}, original_max_position_embeddings=160),
}


def write_gpu_family_model(family: str, path: Path, **kw) -> Path:
    """The family's model at the GPU tests' width (heads of 128, 4 layers, a vocabulary of 4,096)."""
    return write_family_model(family, path, **{**dict(hidden=512, heads=4, inter=1024, vocab=4096, layers=4, seed=3,
                                                      std=0.05), **GPU_OVERRIDES.get(family, {}), **kw})


ALL_TARGETS = {  # every LoRA-able PEFT module of a family
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
}
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_family_model(family: str, path: Path, *, hidden=64, layers=3, heads=4, inter=96, vocab=256, seed=0,
                       std=0.08, **overrides) -> Path:
    """A random model of `family` saved as an HF directory (fp32 safetensors)."""
    import torch
    import transformers

    cfg_name, model_name, kw = FAMILIES[family]
    kw = {**dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                 num_attention_heads=heads, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0, initializer_range=std, tie_word_embeddings=False), **kw, **overrides}
    cfg = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).float().eval()
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # Gemma scales by (1 + w)
                p.uniform_(-0.2, 0.2) if gemma else p.uniform_(0.8, 1.2)
            elif n.endswith(".bias"):
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def family_targets(family: str, which: str = "all") -> tuple[str, ...]:
    full = ALL_TARGETS.get(family, DEFAULT_TARGETS)
    if which == "all":
        return full
    if which == "attn":
        return tuple(t for t in full if t in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"))
    return tuple(t for t in full if t in ("gate_proj", "up_proj", "down_proj", "gate_up_proj"))

"""Synthetic models: a Llama shape with seeded random weights, made on the device (no download).

A *synthetic model directory* holds `config.json` (HF layout), a tokenizer, and the marker
file `synthetic.json` ({"seed": int, "std": float}) instead of safetensors. A runner (or
`bench serve`'s offline engine) given such a directory builds the weights on its own device
with `random_model`, so two processes with the same directory and device get identical
weights. `lorafleet bench e2e` builds the same weights in-process.

    write_synthetic_model(dir, LLAMA2_7B, seed=0, tokenizer_from=demo_model_dir)   # no torch needed
    write_synthetic_adapter(dir, base_shape_dims, rank, seed)                       # PEFT, fp16, numpy
    is_synthetic(dir) -> bool
    random_model(device, dtype, seed, hf_config) -> LlamaModel          # [vocab, hidden] etc.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

MARKER = "synthetic.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                 eos_token_id=2, model_type="llama")


def is_synthetic(path: str | Path) -> bool:
    return (Path(path) / MARKER).is_file()


def write_synthetic_model(path: Path, hf_config: dict, *, seed: int = 0, std: float = 0.02,
                          tokenizer_from: Path | None = None, name: str = "llama-2-7b-shape") -> Path:
    """A model directory the runner turns into seeded random weights; tokenizer files copied from
    `tokenizer_from` (its vocabulary must cover `vocab_size`, e.g. SmolLM2's 49152 >= Llama-2's 32000)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**hf_config, "_name_or_path": name}, indent=1))
    (path / MARKER).write_text(json.dumps({"seed": seed, "std": std}))
    if tokenizer_from is not None:
        for f in TOKENIZER_FILES:
            if (Path(tokenizer_from) / f).is_file():
                shutil.copy(Path(tokenizer_from) / f, path / f)
    return path


def random_model(device, dtype, seed: int, hf_config: dict = LLAMA2_7B, std: float = 0.02, name: str = "llama-2-7b-shape"):
    """A LlamaModel with N(0, std) weights and unit norms, drawn on `device` from `seed`."""
    import torch

    from lorafleet.runner.config import ModelConfig
    from lorafleet.runner.model.llama import LlamaModel

    cfg = ModelConfig.from_hf(hf_config, name=name)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)

    def ones(n):
        return torch.ones(n, dtype=dtype, device=device)

    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    t = {"model.embed_tokens.weight": rnd(V, H), "model.norm.weight": ones(H)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = rnd(V, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rnd(cfg.q_dim, H)
        t[p + "self_attn.k_proj.weight"] = rnd(cfg.kv_dim, H)
        t[p + "self_attn.v_proj.weight"] = rnd(cfg.kv_dim, H)
        t[p + "self_attn.o_proj.weight"] = rnd(H, cfg.q_dim)
        t[p + "mlp.gate_proj.weight"] = rnd(I, H)
        t[p + "mlp.up_proj.weight"] = rnd(I, H)
        t[p + "mlp.down_proj.weight"] = rnd(H, I)
        t[p + "input_layernorm.weight"] = ones(H)
        t[p + "post_attention_layernorm.weight"] = ones(H)
    return LlamaModel(cfg, t, dtype, device)


def load_synthetic(path: str | Path, device, dtype):
    """The LlamaModel a synthetic model directory describes."""
    path = Path(path)
    marker = json.loads((path / MARKER).read_text())
    hf = json.loads((path / "config.json").read_text())
    name = str(hf.pop("_name_or_path", path.name)).rstrip("/").rsplit("/", 1)[-1]
    return random_model(device, dtype, int(marker.get("seed", 0)), hf, float(marker.get("std", 0.02)), name)


def write_synthetic_adapter(path: Path, hf_config: dict, rank: int, seed: int, targets=("q", "k", "v", "o", "gate", "up", "down"),
                            std: float = 0.01) -> Path:
    """A PEFT LoRA adapter (fp16, scaling 1) with N(0, std) A and B on `targets` of every layer; numpy only."""
    import numpy as np
    from safetensors.numpy import save_file

    from lorafleet.common.projections import HF_MODULE, proj_shape

    H, I = hf_config["hidden_size"], hf_config["intermediate_size"]
    heads = hf_config["num_attention_heads"]
    hd = hf_config.get("head_dim") or H // heads
    q, kv = heads * hd, (hf_config.get("num_key_value_heads") or heads) * hd
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for p in targets:
            i, o = proj_shape(p, H, I, q, kv)
            key = f"base_model.model.model.layers.{layer}.{HF_MODULE[p]}"
            tensors[key + ".lora_A.weight"] = (rng.standard_normal((rank, i), dtype=np.float32) * std).astype(np.float16)
            tensors[key + ".lora_B.weight"] = (rng.standard_normal((o, rank), dtype=np.float32) * std).astype(np.float16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none", "task_type": "CAUSAL_LM",
         "target_modules": sorted({HF_MODULE[p].split(".")[-1] for p in targets}),
         "base_model_name_or_path": hf_config.get("_name_or_path", "synthetic")}))
    return path

"""Load base-model weights from an HF directory (safetensors) or a GGUF file.

Both return `(ModelConfig, dict[name -> tensor])` with Hugging Face tensor names, so
one code path builds the model. Pickle checkpoints are refused, never unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import torch

from lorafleet.runner.config import ModelConfig, ModelConfigError

log = logging.getLogger(__name__)


class WeightsError(ValueError):
    """Missing, corrupt or unsupported base-model weights."""


def is_gguf(path: str | Path) -> bool:
    p = Path(path)
    return p.is_file() and p.suffix.lower() == ".gguf"


def load_hf_config(model_dir: Path) -> ModelConfig:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise WeightsError(f"{model_dir} has no config.json (expected a Hugging Face model directory or a .gguf file)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{cfg_path} is not valid JSON: {exc}") from None
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            g = json.loads(gen.read_text())
            if g.get("eos_token_id") is not None:
                cfg = {**cfg, "eos_token_id": g["eos_token_id"]}
        except json.JSONDecodeError:
            log.warning("ignoring unreadable %s", gen)
    return ModelConfig.from_hf(cfg, name=model_dir.name)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"{model_dir}: shards listed in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        if pickled:
            raise WeightsError(
                f"{model_dir} holds only pickle checkpoints ({pickled[0]}); they are never unpickled — convert to safetensors"
            )
        raise WeightsError(f"{model_dir} holds no *.safetensors weights")
    return files


def load_hf_dir(model_dir: str | Path, shard=None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """With a tensor-parallel `shard`, only this rank's slice of each weight is read from the files."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    config = load_hf_config(model_dir)
    if shard is not None:
        shard.check(config)
    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    if shard is None:
                        tensors[name] = sf.get_tensor(name)
                        continue
                    part = sf.get_slice(name)
                    where = shard.weight_slice(name, tuple(part.get_shape()))
                    if where is None:
                        tensors[name] = sf.get_tensor(name)
                    elif where[0] >= 0:
                        dim, lo, hi = where
                        tensors[name] = part[lo:hi] if dim == 0 else part[:, lo:hi]
        except Exception as exc:  # safetensors raises its own error types
            raise WeightsError(f"cannot read {f.name}: {exc}") from None
    return config, tensors


# --- GGUF ------------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
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


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def gguf_config(reader, name: str) -> dict:
    """An HF-style config dict from GGUF metadata (llama architecture only)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelConfigError(f"GGUF architecture {arch!r} is not supported (only llama)")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, "llama.context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
        "_name_or_path": name,
    }
    scaling_type = _field(reader, "llama.rope.scaling.type")
    if scaling_type and scaling_type != "none":
        cfg["rope_scaling"] = {"rope_type": scaling_type, "factor": float(_field(reader, "llama.rope.scaling.factor", 1.0))}
    return cfg


def _unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> rotate-half halves)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantize a llama GGUF file to float32 tensors with HF names."""
    import gguf
    from gguf.quants import dequantize

    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:
        raise WeightsError(f"cannot read GGUF file {path.name}: {exc}") from None
    cfg = gguf_config(reader, path.stem)
    config = ModelConfig.from_hf(cfg, name=path.stem)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _GGUF_NAMES:
            hf = _GGUF_NAMES[t.name]
        elif t.name.startswith("blk."):
            _, idx, kind, suffix = t.name.split(".", 3)
            if kind not in _GGUF_LAYER:
                raise WeightsError(f"unexpected GGUF tensor {t.name}")
            hf = f"model.layers.{idx}.{_GGUF_LAYER[kind]}.{suffix}"
        elif t.name == "rope_freqs.weight":
            continue  # llama3 frequency factors are recomputed from the rope config
        else:
            raise WeightsError(f"unexpected GGUF tensor {t.name}")
        arr = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = arr.reshape(shape)
        if hf.endswith("q_proj.weight"):
            arr = _unpermute_rope(arr, config.num_heads)
        elif hf.endswith("k_proj.weight"):
            arr = _unpermute_rope(arr, config.num_kv_heads)
        tensors[hf] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    return config, tensors


def load_weights(path: str | Path, shard=None, device="cpu", dtype=torch.float32):
    """Config (of the whole model) and HF-named tensors (this tensor-parallel rank's slices when
    `shard` is given) from an HF directory, a .gguf file or a synthetic model directory (seeded
    random weights drawn on `device` in `dtype`, see runner/synthetic.py)."""
    from lorafleet.runner.model import synthetic

    p = Path(path)
    if not p.exists():
        raise WeightsError(f"model path {p} does not exist")
    if is_gguf(p):
        config, tensors = load_gguf(p)
        if shard is not None:
            shard.check(config)
            tensors = {n: t for n, t in ((n, shard.apply(n, t)) for n, t in tensors.items()) if t is not None}
        return config, tensors
    if synthetic.is_synthetic(p):
        config = load_hf_config(p)
        declared = json.loads((p / "config.json").read_text()).get("_name_or_path")
        if isinstance(declared, str) and declared.strip("/"):  # a synthetic model keeps the name it was given
            config = dataclasses.replace(config, name=declared.rstrip("/").rsplit("/", 1)[-1])
        if shard is not None:
            shard.check(config)
        seed, std = synthetic.synthetic_marker(p)
        return config, synthetic.SyntheticWeights(config, seed, device, dtype, shard, std)
    if p.is_dir():
        return load_hf_dir(p, shard)
    raise WeightsError(f"{p} is neither a model directory nor a .gguf file")

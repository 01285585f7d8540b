"""Synthetic models for benchmarks: a family's checkpoint with seeded random weights, made on the device
that will hold them (no download).

A *synthetic model directory* holds `config.json` (HF layout, any supported family), optionally a
tokenizer, and the marker `synthetic.json` ({"seed": int, "std": float}) instead of safetensors;
`load_model` (and so every engine, runner and tensor-parallel rank) draws its weights here. Each tensor is
drawn whole from its own seed (from its checkpoint name) and then sliced, so every process, and TP = 1 and
TP = G, get the same model.

    write_synthetic_model(dir, shape_config("llama2-7b"), seed=0, tokenizer_from=demo_model_dir)  # no torch
    random_model(device, dtype, seed, hf_config) -> Decoder                                        # in-process
    write_synthetic_adapter(dir, hf_config, rank, seed)                                            # PEFT files
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

MARKER = "synthetic.json"
STD = 0.02
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


def draw(shape: tuple[int, ...], seed: int, name: str, device, dtype, std: float = STD):
    import torch

    g = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)


class SyntheticReader:
    """A checkpoint reader (runner/model/weights.py) that draws each tensor on `device` when read: norms are
    ones (zeros where the family scales by 1 + w), everything else N(0, std)."""

    def __init__(self, family, cfg, seed: int, device, dtype, std: float = STD):
        import torch

        from lorafleet.models.contract import checkpoint_shapes

        self.seed, self.device, self.dtype, self.std = seed, torch.device(device), dtype, std
        self.shapes = checkpoint_shapes(family, cfg)
        self.norm_value = 0.0 if cfg.norm_offset else 1.0

    def names(self) -> set[str]:
        return set(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, name: str, rows=None, cols=None):
        import torch

        shape = self.shapes.get(name)
        if shape is None:
            return None
        if "norm" in name.rsplit(".", 2)[-2]:
            t = torch.full(shape, self.norm_value, dtype=self.dtype, device=self.device)
        else:
            t = draw(shape, self.seed, name, self.device, self.dtype, self.std)
        from lorafleet.runner.model.weights import take_slice

        return take_slice(t, rows, cols).contiguous()

    def close(self) -> None:
        pass


def write_synthetic_model(path: Path, hf_config: dict, seed: int = 0, *, std: float = STD,
                          tokenizer_from: Path | None = None, name: str | None = None) -> Path:
    """A model directory (config.json + marker, no weights) that loads as seeded random weights;
    tokenizer files copied from `tokenizer_from` (its vocabulary must cover `vocab_size` for text prompts;
    token-id prompts need none)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(hf_config)
    if name is not None:
        cfg["_name_or_path"] = name
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / MARKER).write_text(json.dumps({"seed": seed, "std": std}))
    if tokenizer_from is not None:
        for f in TOKENIZER_FILES:
            if (Path(tokenizer_from) / f).is_file():
                shutil.copy(Path(tokenizer_from) / f, path / f)
    return path


def is_synthetic(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / MARKER).is_file()


def synthetic_marker(path: str | Path) -> tuple[int, float]:
    """(seed, std) of a synthetic model directory."""
    m = json.loads((Path(path) / MARKER).read_text())
    return int(m.get("seed", 0)), float(m.get("std", STD))


def random_model(device, dtype, seed: int, hf_config: dict, std: float = STD, name: str = "synthetic", kernels=None,
                 fp8: bool = False):
    """A whole Decoder of `hf_config` with the weights a synthetic directory of this seed gives (`fp8`: its
    projection weights quantized to FP8 with per-row scales)."""
    from lorafleet.models import registry
    from lorafleet.runner.model.decoder import Decoder
    from lorafleet.runner.model.weights import Params

    fam = registry.family_for(hf_config)
    cfg = fam.config(hf_config, name)
    params = Params(fam, cfg, SyntheticReader(fam, cfg, seed, device, dtype, std), None, device, dtype, fp8)
    return Decoder(cfg, params, dtype, device, kernels=kernels)


def write_synthetic_adapter(path: Path, hf_config: dict, rank: int, seed: int,
                            targets=("q", "k", "v", "o", "gate", "up", "down"), std: float = 0.01) -> Path:
    """A PEFT LoRA adapter (fp16, scaling 1) with N(0, std) A and B on the modules behind `targets` in every
    layer (a fused checkpoint module takes one pair for all its projections); numpy only."""
    import numpy as np
    from safetensors.numpy import save_file

    from lorafleet.models import registry

    fam = registry.family_for(hf_config)
    base = fam.config(hf_config, "").base_shape()
    ck = fam.checkpoint
    rng = np.random.default_rng(seed)
    tensors, modules = {}, []
    for module, projs in ck.peft_modules().items():
        if not any(p in targets for p in projs):
            continue
        modules.append(module.rsplit(".", 1)[-1])
        i, o = base.shape(projs[0])[0], sum(base.shape(p)[1] for p in projs)
        for layer in range(base.num_layers):
            key = "base_model.model." + ck.layer.format(i=layer) + module
            tensors[key + ".lora_A.weight"] = (rng.standard_normal((rank, i), dtype=np.float32) * std).astype(np.float16)
            tensors[key + ".lora_B.weight"] = (rng.standard_normal((o, rank), dtype=np.float32) * std).astype(np.float16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none", "task_type": "CAUSAL_LM",
         "target_modules": sorted(set(modules)), "base_model_name_or_path": hf_config.get("_name_or_path", "synthetic")}))
    return path

"""Synthetic models and adapters for benchmarks: a Llama shape with seeded random weights, made
on the device that will hold them (no download).

A *synthetic model directory* holds `config.json` (HF layout), optionally a tokenizer, and the
marker `synthetic.json` ({"seed": int, "std": float}) instead of safetensors; `load_weights`
(and so every engine, runner and tensor-parallel rank) draws its weights here. Each tensor is
drawn whole from its own seed and then sliced, so every process, and TP = 1 and TP = G, get the
same model.

    write_synthetic_model(dir, LLAMA2_7B, seed=0, tokenizer_from=demo_model_dir)   # no torch needed
    random_model(device, dtype, seed, hf_config) -> LlamaModel                      # in-process
    write_synthetic_adapter(dir, hf_config, rank, seed)                             # PEFT files, numpy
    synthetic_adapter(name, "synthetic://SEED?rank=R", base, dtype)                 # in memory

Adapter sources `synthetic://SEED` are accepted only by engines that allow them
(`EngineConfig.allow_synthetic`, set by the benchmarks), never from the network.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

MARKER = "synthetic.json"
STD = 0.02
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                 eos_token_id=2, model_type="llama")


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


def draw(shape: tuple[int, ...], seed: int, name: str, device, dtype, std: float = STD):
    import torch

    g = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)


def expected_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """HF names and full shapes of a Llama checkpoint of this config."""
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (cfg.q_dim, H), p + "self_attn.k_proj.weight": (cfg.kv_dim, H),
                    p + "self_attn.v_proj.weight": (cfg.kv_dim, H), p + "self_attn.o_proj.weight": (H, cfg.q_dim),
                    p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I), p + "input_layernorm.weight": (H,),
                    p + "post_attention_layernorm.weight": (H,)})
    return out


class SyntheticWeights:
    """A lazy name -> tensor mapping: `pop(name)` draws the tensor on `device` (norms are ones) and
    keeps this rank's slice; iteration lists the names not drawn yet."""

    def __init__(self, cfg, seed: int, device, dtype, shard=None, std: float = STD):
        import torch

        self.cfg, self.seed, self.device, self.dtype, self.shard = cfg, seed, torch.device(device), dtype, shard
        self.std = std
        self._left = expected_shapes(cfg)

    def pop(self, name: str, default=None):
        shape = self._left.pop(name, None)
        if shape is None:
            return default
        if name.endswith("norm.weight"):
            import torch

            t = torch.ones(shape, dtype=self.dtype, device=self.device)
        else:
            t = draw(shape, self.seed, name, self.device, self.dtype, self.std)
        return self.shard.apply(name, t) if self.shard is not None else t

    def __iter__(self):
        return iter(list(self._left))

    def __len__(self) -> int:
        return len(self._left)


def write_synthetic_model(path: Path, hf_config: dict, seed: int = 0, *, std: float = STD,
                          tokenizer_from: Path | None = None, name: str | None = None) -> Path:
    """A model directory (config.json + marker, no weights) that loads as seeded random weights;
    tokenizer files copied from `tokenizer_from` (its vocabulary must cover `vocab_size`, e.g.
    SmolLM2's 49152 >= Llama-2's 32000; token-id prompts need none)."""
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


def synthetic_seed(path: str | Path) -> int:
    return synthetic_marker(path)[0]


def random_model(device, dtype, seed: int, hf_config: dict = LLAMA2_7B, std: float = STD,
                 name: str = "llama-2-7b-shape"):
    """A whole LlamaModel of `hf_config` with the weights a synthetic directory of this seed gives."""
    from lorafleet.runner.config import ModelConfig
    from lorafleet.runner.model.llama import LlamaModel

    cfg = ModelConfig.from_hf(hf_config, name=name)
    return LlamaModel(cfg, SyntheticWeights(cfg, seed, device, dtype, std=std), dtype, device)


def write_synthetic_adapter(path: Path, hf_config: dict, rank: int, seed: int,
                            targets=("q", "k", "v", "o", "gate", "up", "down"), std: float = 0.01) -> Path:
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


_ADAPTERS: dict = {}  # (source, shapes, dtype) -> LoadedAdapter: a population of weight sets, drawn once


def synthetic_adapter(name: str, source: str, base, dtype, pin: bool = False, max_cached: int = 64):
    """`synthetic://SEED[?rank=R]`: rank-R (default 16) LoRA on all seven projections of every layer,
    A and B^T ~ N(0, 0.01^2), drawn on the CPU from SEED (the same on every rank and every run)."""
    from lorafleet.common.peft_config import AdapterError, AdapterSpec, ModuleLora
    from lorafleet.common.projections import PROJ_INDEX, PROJECTIONS
    import torch

    from lorafleet.runner.lora.adapter import LoadedAdapter, Packed

    spec_text = source[len("synthetic://"):]
    seed_text, _, query = spec_text.partition("?")
    params = dict(kv.split("=", 1) for kv in query.split("&") if "=" in kv)
    try:
        seed, rank = int(seed_text), int(params.get("rank", 16))
    except ValueError:
        raise AdapterError(name, f"bad synthetic adapter source {source!r}") from None
    key = (seed, rank, base, dtype, pin)
    hit = _ADAPTERS.get(key)
    L = base.num_layers
    if hit is None:
        ranks = torch.zeros(L, len(PROJECTIONS), dtype=torch.int32, pin_memory=pin)
        pa, pb = {}, {}
        for proj in PROJECTIONS:
            i, o = base.shape(proj)
            p = PROJ_INDEX[proj]
            for dim, dst, what in ((i, pa, "a"), (o, pb, "b")):
                g = torch.Generator().manual_seed(tensor_seed(seed, f"{proj}.{what}"))
                t = torch.empty(L, rank, dim, dtype=dtype, pin_memory=pin)
                t.copy_((torch.randn(L, rank, dim, generator=g) * 0.01).to(dtype))
                dst[p] = t
            ranks[:, p] = rank
        mods = tuple(ModuleLora(layer, proj, rank, 1.0, "", "") for layer in range(L) for proj in PROJECTIONS)
        nbytes = sum(t.numel() * t.element_size() for t in (*pa.values(), *pb.values()))
        # one Packed per weight set: every adapter drawn from it shares it, and with it the
        # tensor-parallel slices cached on it (a fresh Packed per name re-sliced ~GBs per rank)
        hit = (Packed(pa, pb, ranks, ranks.tolist()), mods, nbytes)
        if len(_ADAPTERS) >= max_cached:
            _ADAPTERS.pop(next(iter(_ADAPTERS)))
        _ADAPTERS[key] = hit
    packed, mods, nbytes = hit
    weights = {(layer, proj): (packed.a[PROJ_INDEX[proj]][layer], packed.bt[PROJ_INDEX[proj]][layer])
               for layer in range(L) for proj in PROJECTIONS}
    spec = AdapterSpec(name, Path("."), None, mods, nbytes, "BF16")
    return LoadedAdapter(spec, weights, packed)

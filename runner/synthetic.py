"""Seeded random weights for benchmarks: a Llama model and LoRA adapters of any shape, made on
the device that will hold them, identical on every tensor-parallel rank (each tensor is drawn whole
from its own seed, then sliced), so TP = 1 and TP = G run the same model.

A model directory is synthetic when it holds `synthetic.json` ({"seed": N}) beside config.json
and no weights; `load_weights` then draws the weights here. Adapter sources `synthetic://SEED`
(rank and targets from the engine's request) are accepted only by engines that allow them
(`EngineConfig.allow_synthetic`, set by the benchmarks), never from the network.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from lorafleet.runner.config import ModelConfig

MARKER = "synthetic.json"
STD = 0.02


def tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little") >> 1


def draw(shape: tuple[int, ...], seed: int, name: str, device, dtype, std: float = STD) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    return (torch.randn(*shape, generator=g, device=device) * std).to(dtype)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
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

    def __init__(self, cfg: ModelConfig, seed: int, device, dtype, shard=None):
        self.cfg, self.seed, self.device, self.dtype, self.shard = cfg, seed, torch.device(device), dtype, shard
        self._left = expected_shapes(cfg)

    def pop(self, name: str, default=None):
        shape = self._left.pop(name, None)
        if shape is None:
            return default
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=self.dtype, device=self.device)
        else:
            t = draw(shape, self.seed, name, self.device, self.dtype)
        return self.shard.apply(name, t) if self.shard is not None else t

    def __iter__(self):
        return iter(list(self._left))

    def __len__(self) -> int:
        return len(self._left)


def write_synthetic_model(path: Path, hf_config: dict, seed: int = 0) -> Path:
    """A model directory (config.json + marker, no weights) that loads as seeded random weights."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config))
    (path / MARKER).write_text(json.dumps({"seed": seed}))
    return path


def is_synthetic(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / MARKER).is_file()


def synthetic_seed(path: str | Path) -> int:
    return int(json.loads((Path(path) / MARKER).read_text()).get("seed", 0))


_ADAPTERS: dict = {}  # (source, shapes, dtype) -> LoadedAdapter: a population of weight sets, drawn once


def synthetic_adapter(name: str, source: str, base, dtype, pin: bool = False, max_cached: int = 64):
    """`synthetic://SEED[?rank=R]`: rank-R (default 16) LoRA on all seven projections of every layer,
    A and B^T ~ N(0, 0.01^2), drawn on the CPU from SEED (the same on every rank and every run)."""
    from lorafleet.common.peft_config import AdapterError, AdapterSpec, ModuleLora
    from lorafleet.common.projections import PROJ_INDEX, PROJECTIONS
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

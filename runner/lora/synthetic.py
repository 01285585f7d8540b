"""`synthetic://SEED[?rank=R]` adapters for benchmarks: rank-R LoRA on all seven projections of every layer,
drawn from SEED (the same on every rank and every run). Accepted only by engines that allow them
(`EngineConfig.allow_synthetic`, set by the benchmarks), never from the network."""

from __future__ import annotations

from pathlib import Path

import torch

from lorafleet.common.peft_config import AdapterError, AdapterSpec, ModuleLora
from lorafleet.models.contract import PROJ_INDEX, PROJECTIONS
from lorafleet.runner.lora.adapter import LoadedAdapter, Packed
from lorafleet.runner.model.synthetic import tensor_seed

_ADAPTERS: dict = {}  # (source, shapes, dtype) -> LoadedAdapter: a population of weight sets, drawn once


def synthetic_adapter(name: str, source: str, base, dtype, pin: bool = False, max_cached: int = 64):
    """`synthetic://SEED[?rank=R]`: rank-R (default 16) LoRA on all seven projections of every layer,
    A and B^T ~ N(0, 0.01^2), drawn on the CPU from SEED (the same on every rank and every run)."""
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

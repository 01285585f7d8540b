"""Load a validated PEFT LoRA adapter into per-module (A, scaled B^T) tensors."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from lorafleet.common.peft_config import AdapterError, AdapterSpec, BaseShape, inspect_adapter, scrub_paths
from lorafleet.common.projections import PROJ_INDEX, PROJECTIONS


@dataclass
class Packed:
    """An adapter stacked over layers, one tensor pair per projection, for few large copies.

    `a[p]` [L, r_p, in_p] and `bt[p]` [L, r_p, out_p] for every projection p the adapter touches
    (r_p: its largest rank over layers; rows beyond a layer's rank are zero), `ranks` int32 [L, 7].
    """

    a: dict[int, torch.Tensor]
    bt: dict[int, torch.Tensor]
    ranks: torch.Tensor
    host_ranks: list[list[int]]  # [L][7]


def pack(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], num_layers: int,
         pin: bool = False) -> Packed:
    """Stack per-(layer, proj) tensors into per-projection [L, r_p, dim] tensors."""
    per_proj: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, proj), (a, bt) in weights.items():
        if not 0 <= layer < num_layers:
            raise ValueError(f"adapter weights name layer {layer}; the base model has {num_layers}")
        per_proj.setdefault(PROJ_INDEX[proj], []).append((layer, a, bt))
    ranks = torch.zeros(num_layers, len(PROJECTIONS), dtype=torch.int32, pin_memory=pin)
    pa, pb = {}, {}
    for p, items in per_proj.items():
        r = max(a.shape[0] for _, a, _ in items)
        a0, b0 = items[0][1], items[0][2]
        A = torch.zeros(num_layers, r, a0.shape[1], dtype=a0.dtype, pin_memory=pin)
        B = torch.zeros(num_layers, r, b0.shape[1], dtype=b0.dtype, pin_memory=pin)
        for layer, a, bt in items:
            A[layer, : a.shape[0]] = a
            B[layer, : bt.shape[0]] = bt
            ranks[layer, p] = a.shape[0]
        pa[p], pb[p] = A, B
    return Packed(pa, pb, ranks, ranks.tolist())


@dataclass
class LoadedAdapter:
    """Host-side weights: for each (layer, proj), A [r, in] and B^T * scaling [r, out].

    `packed` holds the same numbers stacked per projection (see `pack`); when it is set,
    `weights` are views into it. The pool copies an adapter in from `packed`.
    """

    spec: AdapterSpec
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    packed: Packed | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @functools.cached_property
    def nbytes(self) -> int:
        if self.packed is not None:
            return sum(t.numel() * t.element_size() for t in (*self.packed.a.values(), *self.packed.bt.values()))
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())

    def packed_for(self, num_layers: int) -> Packed:
        if self.packed is None or self.packed.ranks.shape[0] != num_layers:
            self.packed = pack(self.weights, num_layers)
        return self.packed

    def shard_for(self, shard, full: BaseShape) -> Packed:
        """This tensor-parallel rank's part of the packed weights (cached on the packed tensors, so
        adapters that share weights share their slices too)."""
        pk = self.packed_for(full.num_layers)
        cache = pk.__dict__.setdefault("_shards", {})
        hit = cache.get(shard)
        if hit is None:
            hit = cache[shard] = shard_packed(pk, shard, full)
        return hit


    @classmethod
    def stacked(cls, spec: AdapterSpec, weights, num_layers: int, pin: bool = False) -> "LoadedAdapter":
        """Pack `weights` (pinned when asked) and keep only views into the packed tensors."""
        pk = pack(weights, num_layers, pin)
        views = {(layer, proj): (pk.a[PROJ_INDEX[proj]][layer, : a.shape[0]], pk.bt[PROJ_INDEX[proj]][layer, : a.shape[0]])
                 for (layer, proj), (a, _) in weights.items()}
        return cls(spec, views, pk)


def shard_packed(pk: Packed, shard, full: BaseShape) -> Packed:
    """Slice a packed adapter for a rank (see runner/parallel/shard.py): B by output for
    column-parallel projections, A by input for row-parallel ones; contiguous (and pinned when the
    source is) so that a slot write stays a few large copies."""
    from lorafleet.runner.parallel.shard import lora_slice

    def part(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(*t.shape[:-1], hi - lo, dtype=t.dtype, pin_memory=t.is_pinned())
        out.copy_(t[..., lo:hi])
        return out

    a, bt = {}, {}
    for p, A in pk.a.items():
        proj = PROJECTIONS[p]
        sl = lora_slice(proj, *full.shape(proj), shard)
        B = pk.bt[p]
        a[p] = part(A, sl[1], sl[2]) if sl and sl[0] == "a" else A
        bt[p] = part(B, sl[1], sl[2]) if sl and sl[0] == "b" else B
    return Packed(a, bt, pk.ranks, pk.host_ranks)


def load_adapter(
    name: str, path: str | Path, base: BaseShape, max_rank: int, dtype: torch.dtype, pin: bool = False,
    allow_synthetic: bool = False,
) -> LoadedAdapter:
    """Validate (see `inspect_adapter`) and load; raises AdapterError naming the adapter.
    `synthetic://SEED` sources (benchmarks only) are drawn by runner/synthetic.py when allowed."""
    from safetensors import safe_open

    if str(path).startswith("synthetic://"):
        if not allow_synthetic:
            raise AdapterError(name, "synthetic adapter sources are only for benchmarks")
        from lorafleet.runner.synthetic import synthetic_adapter

        return synthetic_adapter(name, str(path), base, dtype, pin)

    spec = inspect_adapter(name, path, base=base, max_rank=max_rank)
    weights = {}
    try:
        with safe_open(str(Path(path) / "adapter_model.safetensors"), framework="pt") as f:
            for m in spec.modules:
                a = f.get_tensor(m.a_key).float()  # [r, in]
                b = f.get_tensor(m.b_key).float()  # [out, r]
                if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                    raise AdapterError(name, f"layer {m.layer} {m.proj}: weights contain NaN or Inf")
                bt = (b.t() * m.scaling).to(dtype).contiguous()  # [r, out]
                weights[(m.layer, m.proj)] = (a.to(dtype).contiguous(), bt)
    except AdapterError:
        raise
    except Exception as exc:
        raise AdapterError(name, f"cannot read adapter_model.safetensors: {scrub_paths(str(exc))}") from None
    return LoadedAdapter.stacked(spec, weights, base.num_layers, pin=pin)

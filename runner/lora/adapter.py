"""Load a validated PEFT LoRA adapter into per-module (A, scaled B^T) tensors."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from lorafleet.common.peft_config import AdapterError, AdapterSpec, BaseShape, inspect_adapter, scrub_paths
from lorafleet.models.contract import PROJ_INDEX, PROJECTIONS
from lorafleet.runner.lora.ref import AdapterRef  # noqa: F401 (re-exported)
from lorafleet.runner.model.weights import all_finite


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
    """Stack per-(layer, proj) (A [r, in], B^T [r, out]) into per-projection [L, r_p, dim] tensors."""
    dtype = next(iter(weights.values()))[0].dtype
    return pack_peft("adapter", {k: (a, bt.t(), 1.0) for k, (a, bt) in weights.items()}, num_layers, dtype, pin)


class LoadedAdapter:
    """Host-side weights: for each (layer, proj), A [r, in] and B^T * scaling [r, out].

    Built from per-module `weights`, or from `packed` (the same numbers stacked per projection, see
    `pack`), or both; `weights` is then derived on first use as views into the packed tensors. The
    pool copies an adapter in from `packed`.
    """

    def __init__(self, spec: AdapterSpec, weights: dict | None = None, packed: Packed | None = None):
        if weights is None and packed is None:
            raise ValueError("a LoadedAdapter needs its weights or its packed tensors")
        self.spec, self._weights, self.packed = spec, weights, packed

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def weights(self) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        if self._weights is None:
            pk = self.packed
            self._weights = {(layer, PROJECTIONS[p]): (pk.a[p][layer, :r], pk.bt[p][layer, :r])
                             for layer, row in enumerate(pk.host_ranks) for p, r in enumerate(row) if r}
        return self._weights

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
    `synthetic://SEED` sources (benchmarks only) are drawn by runner/lora/synthetic.py when allowed."""
    from safetensors import safe_open

    if str(path).startswith("synthetic://"):
        if not allow_synthetic:
            raise AdapterError(name, "synthetic adapter sources are only for benchmarks")
        from lorafleet.runner.lora.synthetic import synthetic_adapter

        return synthetic_adapter(name, str(path), base, dtype, pin)

    spec = inspect_adapter(name, path, base=base, max_rank=max_rank)
    try:
        with safe_open(str(Path(path) / "adapter_model.safetensors"), framework="pt") as f:
            cache: dict[str, torch.Tensor] = {}  # a fused module's A and B serve several projections

            def get(key: str) -> torch.Tensor:
                if key not in cache:
                    cache[key] = f.get_tensor(key)
                return cache[key]

            raw = {(m.layer, m.proj): (get(m.a_key), get(m.b_key)[m.b_rows[0]:m.b_rows[1]] if m.b_rows else get(m.b_key),
                                       m.scaling) for m in spec.modules}
    except Exception as exc:
        raise AdapterError(name, f"cannot read adapter_model.safetensors: {scrub_paths(str(exc))}") from None
    keys = {(m.layer, m.proj): (m.a_key, m.b_key) for m in spec.modules}
    return LoadedAdapter(spec, packed=pack_peft(name, raw, base.num_layers, dtype, pin, keys))


def pack_peft(name: str, raw: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]], num_layers: int,
              dtype: torch.dtype, pin: bool = False,
              keys: dict[tuple[int, str], tuple[str, str]] | None = None) -> Packed:
    """Pack PEFT tensors, (layer, proj) -> (A [r, in], B [out, r], scaling), into `Packed` in `dtype`:
    B is transposed and scaled in float32 and rounded once, straight into the packed tensor (one pass
    over the weights; the cost of a load from disk is mostly this).
    Raises AdapterError when a weight is NaN or Inf, in the file or after the conversion, naming the tensor
    by its key in the file (`keys`: (layer, proj) -> (lora_A key, lora_B key); without, layer and projection)."""
    per_proj: dict[int, list] = {}
    for (layer, proj), item in raw.items():
        if not 0 <= layer < num_layers:
            raise AdapterError(name, f"weights name layer {layer}; the base model has {num_layers}")
        per_proj.setdefault(PROJ_INDEX[proj], []).append((layer, *item))
    host_ranks = [[0] * len(PROJECTIONS) for _ in range(num_layers)]
    pa, pb = {}, {}
    for p, items in sorted(per_proj.items()):
        r = max(a.shape[0] for _, a, _, _ in items)
        A = torch.zeros(num_layers, r, items[0][1].shape[1], dtype=dtype)
        Bt = torch.zeros(num_layers, r, items[0][2].shape[0], dtype=dtype)
        for layer, a, b, s in items:
            k = a.shape[0]
            A[layer, :k].copy_(a)
            # As b.float().t() * s rounded into `dtype`: a product in b's own half dtype would be rounded
            # (or overflow) before the cast, so widen a half b unless it is already `dtype` (whose product is
            # computed in float32 and rounded once); a float32 or float64 b is multiplied in its own precision
            # and rounded once into `dtype`.
            if b.dtype not in (torch.float32, torch.float64, dtype):
                b = b.float()
            torch.mul(b.t(), s, out=Bt[layer, :k])
            host_ranks[layer][p] = k
        for which, t in enumerate((A, Bt)):  # after the conversion: an overflow to Inf counts too
            if all_finite(t):
                continue
            layer = int((~torch.isfinite(t)).flatten(1).any(1).nonzero()[0])
            raise AdapterError(name, _not_finite(layer, PROJECTIONS[p], which, raw[(layer, PROJECTIONS[p])], dtype,
                                                 keys))
        pa[p], pb[p] = (A.pin_memory(), Bt.pin_memory()) if pin else (A.contiguous(), Bt.contiguous())
    ranks = torch.tensor(host_ranks, dtype=torch.int32)
    return Packed(pa, pb, ranks.pin_memory() if pin else ranks, host_ranks)


def _not_finite(layer: int, proj: str, which: int, item: tuple, dtype: torch.dtype, keys: dict | None) -> str:
    """Why (layer, proj)'s lora_A (`which` 0) or lora_B (1) is refused, naming it as the adapter's file does:
    NaN or Inf in the file, or a finite value that overflows to Inf in the serving dtype (B: once scaled)."""
    a, b, scaling = item
    key = (keys or {}).get((layer, proj), (f"lora_A of layer {layer} {proj}", f"lora_B of layer {layer} {proj}"))[which]
    if not all_finite((a, b)[which]):
        return f"tensor {key} contains NaN or Inf values"
    scaled = f" once scaled by {scaling:g}" if which and scaling != 1.0 else ""
    return f"tensor {key} overflows to Inf in {str(dtype).removeprefix('torch.')}{scaled}"

"""Load a validated PEFT LoRA adapter into per-module (A, scaled B^T) tensors."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from lorafleet.common.peft_config import AdapterError, AdapterSpec, BaseShape, inspect_adapter


@dataclass
class LoadedAdapter:
    """Host-side weights: for each (layer, proj), A [r, in] and B^T * scaling [r, out]."""

    spec: AdapterSpec
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def name(self) -> str:
        return self.spec.name

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def load_adapter(
    name: str, path: str | Path, base: BaseShape, max_rank: int, dtype: torch.dtype, pin: bool = False
) -> LoadedAdapter:
    """Validate (see `inspect_adapter`) and load; raises AdapterError naming the adapter."""
    from safetensors import safe_open

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
                a = a.to(dtype).contiguous()
                if pin:
                    a, bt = a.pin_memory(), bt.pin_memory()
                weights[(m.layer, m.proj)] = (a, bt)
    except AdapterError:
        raise
    except Exception as exc:
        raise AdapterError(name, f"cannot read adapter_model.safetensors: {exc}") from None
    return LoadedAdapter(spec, weights)

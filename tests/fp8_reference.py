"""The FP8 path's semantics written independently of the engine, on HF transformers + PEFT (import from here).

- `rounded_copy`: the checkpoint with every projection weight rounded through e4m3 with one scale per output
  row (row absmax / 448): the weights the FP8 path multiplies by.
- `emulate_fp8(model, activations=..., kv=...)`: on a loaded HF (+ PEFT) model, inputs of the base projections
  rounded per token through e4m3 (each row by its absmax / 448: the GPU's dynamic activation quantization;
  LoRA still sees the unrounded input), and K and V rounded through e4m3 with scale 1, saturating, after RoPE
  (FP8 K/V pages), by wrapping the eager attention of the model's own modeling module."""

from __future__ import annotations

import contextlib
import sys

import torch
from safetensors.torch import load_file, save_file

E4M3 = torch.float8_e4m3fn
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")


def is_proj(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJ


def round_e4m3(x: torch.Tensor, scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """x rounded through e4m3 at `scale` (saturating at +-448), back in x's dtype; computed in fp32."""
    xf = x.float() / scale
    return (xf.clamp(-448.0, 448.0).to(E4M3).float() * scale).to(x.dtype)


def round_rows(w: torch.Tensor) -> torch.Tensor:
    """Each row (the last dimension) through e4m3 at its own scale, absmax / 448."""
    scale = (w.float().abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    return round_e4m3(w, scale)


def block_quantize(w: torch.Tensor, br: int, bc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, [ceil(N / br), ceil(K / bc)] scales): one scale per block, by loops."""
    n, k = w.shape
    s = torch.zeros(-(-n // br), -(-k // bc))
    q = torch.zeros_like(w)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            s[i, j] = (blk.abs().amax() / 448).clamp(min=1e-12)
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = blk / s[i, j]
    return q.clamp(-448, 448).to(E4M3), s


def rounded_copy(model, out):
    """The HF directory with every projection weight rounded through e4m3 per output row (fp32)."""
    out.mkdir()
    sd = load_file(str(model / "model.safetensors"))
    sd = {k: (round_rows(v.float()) if is_proj(k) else v).contiguous() for k, v in sd.items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((model / "config.json").read_text())
    return out


def _base_projections(model):
    """The plain nn.Linear of every projection: the module itself, or PEFT's `base_layer` under it."""
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        parts = name.split(".")
        if parts[-1] in PROJ or (parts[-1] == "base_layer" and len(parts) > 1 and parts[-2] in PROJ):
            yield mod


@contextlib.contextmanager
def emulate_fp8(model, activations: bool = True, kv: bool = False):
    hooks, patched = [], []
    try:
        if activations:
            for lin in _base_projections(model):
                hooks.append(lin.register_forward_pre_hook(lambda _m, args: (round_rows(args[0]),) + args[1:]))
            assert hooks, "no projections found"
        if kv:
            mods = {sys.modules[type(m).__module__] for m in model.modules() if hasattr(sys.modules[type(m).__module__],
                                                                                     "eager_attention_forward")}
            assert mods, "no eager attention found"
            for mod in mods:
                orig = mod.eager_attention_forward

                def rounded(module, query, key, value, *args, _orig=orig, **kwargs):
                    return _orig(module, query, round_e4m3(key), round_e4m3(value), *args, **kwargs)

                mod.eager_attention_forward = rounded
                patched.append((mod, orig))
        yield model
    finally:
        for h in hooks:
            h.remove()
        for mod, orig in patched:
            mod.eager_attention_forward = orig

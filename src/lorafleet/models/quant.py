"""Quantized checkpoints: what a config.json's `quantization_config` says, parsed into a `QuantScheme` or
refused naming what is not supported. Torch-free (the operator checks base models with it too).

Supported: FP8 (e4m3) weights of the seven projections with
- `compressed-tensors` `float-quantized` checkpoints: weights `strategy` channel (one scale per output
  row, `weight_scale` [out, 1]) or tensor (one scale per tensor); input activations dynamic per token, or
  none (weight-only);
- transformers' `fp8` checkpoints ("fine-grained"): 128 x 128 block scales (`weight_scale_inv`), dynamic
  activations.
The engine runs every one of them as per-row-scaled FP8 weights (block scales are re-rounded to per-row ones
at load) with dynamic per-token FP8 activations on GPUs with FP8 tensor cores, weight-only elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafleet.models.contract import ModelConfigError


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's projection weights are stored: `method` compressed-tensors | fp8; `scale_name` the
    tensor beside each weight; `strategy` channel | tensor | block; `block` (rows, cols) for block scales."""

    method: str
    scale_name: str
    strategy: str
    block: tuple[int, int] | None = None
    activations: str = "dynamic"  # dynamic (per token) | none (weight-only)
    ignore: tuple[str, ...] = ()  # modules left unquantized (e.g. lm_head)


def quant_scheme(cfg: dict) -> QuantScheme | None:
    """The scheme of an HF config.json's `quantization_config`, None when it has none."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise ModelConfigError("quantization_config must be an object")
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ModelConfigError(f"fp8 checkpoints with activation_scheme {q.get('activation_scheme')!r} are not "
                                   "supported (only dynamic)")
        block = q.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2 or not all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ModelConfigError(f"fp8 weight_block_size {block!r} is not supported (two positive integers)")
        return QuantScheme("fp8", "weight_scale_inv", "block" if block else "tensor",
                           tuple(int(b) for b in block) if block else None,
                           ignore=tuple(q.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        fmt = q.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ModelConfigError(f"compressed-tensors format {fmt!r} is not supported (only float-quantized FP8)")
        groups = q.get("config_groups") or {}
        if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
            raise ModelConfigError(f"compressed-tensors config_groups must map group names to objects, got {groups!r}")
        groups = list(groups.values())
        if len(groups) != 1:
            raise ModelConfigError(f"compressed-tensors checkpoints with {len(groups)} config groups are not supported "
                                   "(one group of FP8 Linear weights)")
        g = groups[0]
        w = g.get("weights") or {}
        if not isinstance(w, dict):
            raise ModelConfigError(f"compressed-tensors weights {w!r} must be an object")
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ModelConfigError(f"compressed-tensors weights of type {w.get('type')!r} with {w.get('num_bits')} bits "
                                   "are not supported (only 8-bit float)")
        if w.get("strategy") not in ("channel", "tensor"):
            raise ModelConfigError(f"compressed-tensors weight strategy {w.get('strategy')!r} is not supported "
                                   "(channel, tensor)")
        if w.get("dynamic"):
            raise ModelConfigError("compressed-tensors dynamic weight quantization is not supported")
        a = g.get("input_activations")
        if a is None:
            act = "none"
        elif not isinstance(a, dict):
            raise ModelConfigError(f"compressed-tensors input activations {a!r} are not supported (dynamic per-token "
                                   "FP8 or none)")
        elif a.get("dynamic") and a.get("strategy") in ("token", None) and a.get("type", "float") == "float" \
                and a.get("num_bits", 8) == 8:
            act = "dynamic"
        else:
            raise ModelConfigError(f"compressed-tensors input activations {a!r} are not supported (dynamic per-token "
                                   "FP8 or none)")
        return QuantScheme("compressed-tensors", "weight_scale", w["strategy"], activations=act,
                           ignore=tuple(q.get("ignore") or ()))
    raise ModelConfigError(f"quantization method {method!r} is not supported (supported: fp8, compressed-tensors FP8)")

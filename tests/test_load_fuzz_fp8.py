"""Pre-quantized FP8 checkpoints whose scales or quantization_config do not fit: refused at load naming the tensor
or setting (was: scales of the wrong shape broadcast silently or failed with torch errors, malformed configs
with AttributeErrors)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_reference import block_quantize
from model_helpers import write_random_llama

from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.model.fp8 import from_checkpoint
from lorafleet.runner.model.weights import WeightsError, load_model

E4M3 = torch.float8_e4m3fn
UP = "model.layers.1.mlp.up_proj.weight"  # [96, 64]
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CT = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                                  "symmetric": True, "dynamic": False},
                              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                    "dynamic": True}}}}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_random_llama(tmp_path_factory.mktemp("small"), hidden=64, layers=2, heads=4, kv_heads=2, inter=96,
                              vocab=256)


def quantized(small, dst, strategy, qc, block=(128, 128), change=None):
    """The small model's projections as FP8 with `strategy` scales, `qc` its quantization_config."""
    dst.mkdir()
    sd = load_file(str(small / "model.safetensors"))
    out = {}
    for k, v in sd.items():
        if not any(p in k for p in PROJ):
            out[k] = v
            continue
        if strategy == "channel":
            s = (v.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
            out[k], out[k + "_scale"] = (v / s).clamp(-448, 448).to(E4M3), s
        elif strategy == "tensor":
            s = (v.abs().amax() / 448).reshape(1)
            out[k], out[k + "_scale"] = (v / s).clamp(-448, 448).to(E4M3), s
        else:
            out[k], out[k + "_scale_inv"] = block_quantize(v, *block)
    out.update(change or {})
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((small / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    return dst


def load(d):
    return Engine(str(d), EngineConfig(device="cpu", num_pages=16))


def ct(strategy):
    g = json.loads(json.dumps(CT))
    g["config_groups"]["g"]["weights"]["strategy"] = strategy
    return g


FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


@pytest.mark.parametrize("strategy, qc, scale, words", [
    ("channel", ct("channel"), torch.tensor([0.01]), r"has shape \[1\]; channel scales of a \[96, 64\] weight have "
                                                      r"shape \[96\] or \[96, 1\]"),
    ("channel", ct("channel"), torch.full((10, 1), 0.01), r"has shape \[10, 1\]; channel scales"),
    ("tensor", ct("tensor"), torch.full((96,), 0.01), r"has shape \[96\]; tensor scales of a \[96, 64\] weight have "
                                                      "shape one value"),
    ("block", FP8_BLOCK, torch.full((5, 5), 0.01), r"has shape \[5, 5\]; block scales of a \[96, 64\] weight have "
                                                   r"shape \[1, 1\] \(128 x 128 blocks\)"),
    ("block", FP8_BLOCK, torch.full((1,), 0.01), r"has shape \[1\]; block scales"),
])
def test_an_fp8_scale_of_the_wrong_shape_for_its_strategy_is_refused_naming_it(small, tmp_path, strategy, qc, scale,
                                                                               words):
    suffix = "_scale_inv" if strategy == "block" else "_scale"
    d = quantized(small, tmp_path / "q", strategy, qc, change={UP + suffix: scale})
    with pytest.raises(WeightsError, match=f"FP8 scale {UP}{suffix} " + words):
        load(d)


def test_an_fp8_scale_that_is_not_plain_floating_point_is_refused(small, tmp_path):
    d = quantized(small, tmp_path / "q", "channel", CT, change={UP + "_scale": torch.ones(96, 1, dtype=torch.int32)})
    with pytest.raises(WeightsError, match=f"tensor {UP}_scale has dtype int32"):
        load(d)


def test_fp8_weights_of_another_fp8_format_are_refused(small, tmp_path):
    w = load_file(str(small / "model.safetensors"))[UP]
    d = quantized(small, tmp_path / "q", "channel", CT, change={UP: w.to(torch.float8_e5m2)})
    with pytest.raises(WeightsError, match=f"tensor {UP} has dtype float8_e5m2"):
        load(d)


def test_fp8_blocks_of_another_size_load_as_their_scales_say(small, tmp_path):
    """64 x 32 blocks (not transformers' default 128 x 128): each weight stands for its blocks' values, re-rounded to
    per-row scales (within one more e4m3 rounding), as for 128 x 128; the reference dequantizes the blocks by
    repeating each scale over its block."""
    qc = {**FP8_BLOCK, "weight_block_size": [64, 32]}
    d = quantized(small, tmp_path / "q", "block", qc, block=(64, 32))
    params = load_model(d).params
    got = params.pop("layers.1.gate_up")
    sd = load_file(str(d / "model.safetensors"))
    want = []
    for name in ("model.layers.1.mlp.gate_proj.weight", UP):
        q, s = sd[name].float(), sd[name + "_scale_inv"]
        want.append(q * s.repeat_interleave(64, 0)[: q.shape[0]].repeat_interleave(32, 1)[:, : q.shape[1]])
    # one more e4m3 rounding: relative, or one subnormal step (2^-9) of the row's scale near zero
    torch.testing.assert_close(got.dequant(), torch.cat(want), rtol=0.07, atol=float(got.scale.max()) * 2 ** -9)


@pytest.mark.parametrize("qc, words", [
    ({**FP8_BLOCK, "weight_block_size": ["a", 128]}, r"weight_block_size \['a', 128\] is not supported"),
    ({**FP8_BLOCK, "weight_block_size": [0, 128]}, r"weight_block_size \[0, 128\] is not supported"),
    ({**CT, "config_groups": [1]}, "config_groups must map group names to objects"),
    ({**CT, "config_groups": {"g": "x"}}, "config_groups must map group names to objects"),
    ({**CT, "config_groups": {"g": {"weights": [1]}}}, r"compressed-tensors weights \[1\] must be an object"),
    ({**CT, "config_groups": {"g": {**CT["config_groups"]["g"], "input_activations": [1]}}},
     r"input activations \[1\] are not supported"),
])
def test_a_malformed_quantization_config_is_refused_naming_the_setting(small, tmp_path, qc, words):
    d = quantized(small, tmp_path / "q", "channel", CT)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(WeightsError, match=words):
        load_model(d)

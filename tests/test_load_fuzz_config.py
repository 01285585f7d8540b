"""config.json settings of the wrong kind or out of range: refused at load naming the setting, never a traceback
and never read as something else (64.7 as 64, "false" as true, a negative epsilon or context)."""

from __future__ import annotations

import json

import pytest

from model_helpers import write_random_llama

from lorafleet.runner.model.weights import WeightsError, load_model


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_random_llama(tmp_path_factory.mktemp("small"), hidden=64, layers=2, heads=4, kv_heads=2, inter=96,
                              vocab=256)


@pytest.mark.parametrize("change, words", [
    ({"hidden_size": 64.7}, "'hidden_size' must be an integer, got 64.7"),
    ({"num_hidden_layers": True}, "'num_hidden_layers' must be an integer, got True"),
    ({"head_dim": "x"}, "'head_dim' must be an integer, got 'x'"),
    ({"num_attention_heads": 0}, "'num_attention_heads' must be at least 1, got 0"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"max_position_embeddings": -5}, "'max_position_embeddings' must be at least 1, got -5"),
    ({"rms_norm_eps": "abc"}, "'rms_norm_eps' must be a number, got 'abc'"),
    ({"rms_norm_eps": -1.0}, "'rms_norm_eps' must be a finite number of at least 0"),
    ({"tie_word_embeddings": "false"}, "'tie_word_embeddings' must be true or false, got 'false'"),
    ({"attention_bias": "false"}, "'attention_bias' must be true or false, got 'false'"),
    ({"rope_parameters": None, "rope_theta": "big"}, "'rope_theta' must be a number, got 'big'"),
    ({"rope_parameters": None, "rope_scaling": "linear"}, "'rope_scaling' must be an object, got 'linear'"),
    ({"rope_parameters": [1, 2]}, "'rope_parameters' must be an object"),
    ({"architectures": 5}, "'architectures' must be a list of class names, got 5"),
    ({"architectures": [{"a": 1}]}, "'architectures' must be a list of class names"),
    # was: the per-layer tables built first (10**9 layers: minutes and gigabytes), then the weights lacked layer 2
    ({"num_hidden_layers": 100_000}, "'num_hidden_layers' must be at most 4,096, got 100,000"),
    # was: loaded as Llama, while transformers builds the model_type's class (Qwen3: q/k norms; Mistral: a window)
    ({"model_type": "qwen3"}, "contradicts itself: architectures ['LlamaForCausalLM'] name a llama model but "
                              "model_type is 'qwen3'"),
    ({"model_type": "mistral"}, "name a llama model but model_type is 'mistral'"),
    # was: loaded, then every request's output was not finite
    ({"rope_parameters": None, "rope_theta": 0}, "RoPE setting 'rope_theta' must be a finite positive number, got 0"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 0.0, "rope_theta": 10000.0}},
     "RoPE setting 'factor' must be a finite positive number, got 0.0"),
    ({"rope_parameters": {"rope_type": "linear", "factor": float("nan"), "rope_theta": 10000.0}},
     "RoPE setting 'factor' must be a finite positive number, got nan"),
])
def test_a_setting_of_the_wrong_kind_or_out_of_range_is_refused_naming_it(small, tmp_path, change, words):
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").symlink_to(small / "model.safetensors")
    cfg = json.loads((small / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(WeightsError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_model(d)


@pytest.mark.parametrize("change, attr, value", [
    ({"hidden_size": 64.0}, "hidden_size", 64),
    ({"hidden_size": "64"}, "hidden_size", 64),
    ({"rms_norm_eps": None}, "rms_norm_eps", 1e-6),
])
def test_integral_floats_numeric_strings_and_nulls_still_read_as_before(small, tmp_path, change, attr, value):
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").symlink_to(small / "model.safetensors")
    cfg = json.loads((small / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    assert getattr(load_model(d).config, attr) == value

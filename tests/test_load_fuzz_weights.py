"""Bad HF checkpoints: every tensor is held to the shape and dtype the config implies, and a checkpoint that
could be read two ways is refused, each with a WeightsError naming the tensor (never a traceback mid-step,
never a silently broadcast or reinterpreted weight)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_helpers import write_random_llama

from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import SamplingParams, Sequence
from lorafleet.runner.model.weights import WeightsError, load_model

L1 = "model.layers.1."


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_random_llama(tmp_path_factory.mktemp("small"), hidden=64, layers=2, heads=4, kv_heads=2, inter=96,
                              vocab=256)


def copy_with(small, dst, change=None, cfg=None):
    """A copy of the small model with tensors replaced (`change`: name -> tensor, None drops it) and config
    settings replaced (`cfg`)."""
    dst.mkdir()
    sd = load_file(str(small / "model.safetensors"))
    for k, v in (change or {}).items():
        if v is None:
            sd.pop(k)
        else:
            sd[k] = v
    save_file(sd, str(dst / "model.safetensors"))
    c = json.loads((small / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**c, **(cfg or {})}))
    return dst


def engine(path, **kw):
    return Engine(str(path), EngineConfig(device="cpu", num_pages=16, **kw))


def greedy(eng) -> list[int]:
    return eng.run_to_completion([Sequence("a", [1, 5, 9, 20], SamplingParams(max_tokens=6))])["a"].output_ids


@pytest.mark.parametrize("name, shape", [
    (L1 + "self_attn.q_proj.weight", (64, 48)),  # was: a torch.cat error at load
    (L1 + "self_attn.o_proj.weight", (64, 32)),  # was: a matmul error in the first step
    (L1 + "mlp.down_proj.weight", (64, 64)),
    ("model.layers.0.self_attn.k_proj.weight", (64, 32)),  # transposed
    ("model.layers.0.input_layernorm.weight", (1,)),  # was: broadcast, silently other tokens
    (L1 + "post_attention_layernorm.weight", (1, 64)),
    ("model.norm.weight", (1,)),
])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_tensor_of_another_shape_than_the_config_implies_is_refused_naming_it(small, tmp_path, name, shape,
                                                                                 quantization):
    d = copy_with(small, tmp_path / "m", {name: torch.ones(shape)})
    with pytest.raises(WeightsError, match=rf"tensor {name} has shape \[{', '.join(map(str, shape))}\]; the model's "
                                           r"config implies"):
        engine(d, quantization=quantization)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.bool, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_a_weight_that_is_not_plain_floating_point_is_refused_naming_its_dtype(small, tmp_path, dtype):
    """Integers and booleans would be cast to floats that stand for nothing; FP8 without a quantization_config has
    no scales (was: int8 weights loaded and answered, FP8 ones failed with a NotImplementedError traceback)."""
    name = "model.layers.0.self_attn.q_proj.weight"
    w = load_file(str(small / "model.safetensors"))[name]
    d = copy_with(small, tmp_path / "m", {name: (w * 100).to(dtype)})
    with pytest.raises(WeightsError, match=rf"tensor {name} has dtype {str(dtype).removeprefix('torch.')}; weights "
                                           "must be float32, float16, bfloat16 or float64"):
        engine(d)


def test_float64_and_float16_weights_load_as_the_numbers_they_hold(small, tmp_path):
    sd = load_file(str(small / "model.safetensors"))
    d = copy_with(small, tmp_path / "m", {"model.embed_tokens.weight": sd["model.embed_tokens.weight"].double(),
                                          L1 + "mlp.up_proj.weight": sd[L1 + "mlp.up_proj.weight"].half().float()})
    ref = copy_with(small, tmp_path / "ref", {L1 + "mlp.up_proj.weight": sd[L1 + "mlp.up_proj.weight"].half().float()})
    assert greedy(engine(d)) == greedy(engine(ref))


def test_a_tensor_in_two_safetensors_files_is_refused(small, tmp_path):
    """Which copy would win depends on file order (was: the later file's zeros, silently)."""
    d = copy_with(small, tmp_path / "m")
    save_file({"model.norm.weight": torch.zeros(64)}, str(d / "extra.safetensors"))
    with pytest.raises(WeightsError, match="tensor model.norm.weight is in both extra.safetensors and model.safetensors"):
        engine(d)


@pytest.mark.parametrize("weight_map", [[1], {"model.norm.weight": "../elsewhere.safetensors"},
                                        {"model.norm.weight": 3}])
def test_an_index_that_does_not_map_tensors_to_shard_files_in_the_directory_is_refused(small, tmp_path, weight_map):
    d = copy_with(small, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightsError, match="is not a valid safetensors index"):
        load_model(d)


def test_tied_embeddings_with_a_different_lm_head_in_the_file_are_refused(small, tmp_path):
    """Some transformers versions use such an lm_head, others drop it: refused rather than one picked silently
    (was: the file's lm_head dropped, other tokens than transformers 5 gives)."""
    d = copy_with(small, tmp_path / "m", cfg={"tie_word_embeddings": True})
    with pytest.raises(WeightsError, match="ties the output head to the embeddings .* different lm_head.weight"):
        engine(d)


def test_tied_embeddings_with_the_embedding_saved_again_as_lm_head_load(small, tmp_path):
    embed = load_file(str(small / "model.safetensors"))["model.embed_tokens.weight"]
    tied = copy_with(small, tmp_path / "tied", {"lm_head.weight": embed.clone()}, cfg={"tie_word_embeddings": True})
    untied = copy_with(small, tmp_path / "untied", {"lm_head.weight": embed.clone()})
    assert greedy(engine(tied)) == greedy(engine(untied))


def test_a_config_json_that_is_not_utf8_is_refused(small, tmp_path):
    d = copy_with(small, tmp_path / "m")
    (d / "config.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(WeightsError, match="config.json is not valid JSON"):
        load_model(d)


def test_weights_that_are_a_named_pipe_are_refused_without_opening_them(small, tmp_path):
    """Opening a FIFO blocks until a writer comes, inside safetensors where no signal reaches (was: the load hung for
    good). A helper process (safetensors holds the GIL while it waits: a thread would never run) opens the pipe's
    write end whenever a reader waits, so that the unfixed load ends, reading nothing, instead of hanging the test."""
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(small / "config.json", d / "config.json")
    os.mkfifo(d / "model.safetensors")
    release = subprocess.Popen([sys.executable, "-c", f"""
import os, time
while True:
    try:
        os.close(os.open({str(d / "model.safetensors")!r}, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # ENXIO: no reader waits
        pass
    time.sleep(0.05)
"""])
    try:
        with pytest.raises(WeightsError, match="model.safetensors is not a regular file"):
            engine(d)
    finally:
        release.kill()
        release.wait()

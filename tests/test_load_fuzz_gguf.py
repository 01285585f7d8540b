"""Bad GGUF files: missing metadata, tensor types the gguf library cannot dequantize, tensor names that are not
`blk.N.<name>.<kind>` and tensors of the wrong shape are refused naming what is wrong (was: TypeError,
KeyError, NotImplementedError or ValueError tracebacks, and a torch error mid-load)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from model_helpers import write_random_llama

from lorafleet.runner.model.weights import WeightsError, load_model

META = dict(block_count=2, context_length=512, embedding_length=64, feed_forward_length=96, head_count=4,
            head_count_kv=2, vocab_size=256)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_random_llama(tmp_path_factory.mktemp("small"), hidden=64, layers=2, heads=4, kv_heads=2, inter=96,
                              vocab=256)


def write(small, path, drop=(), tensors=None, extra=None):
    """The small model as a llama GGUF (tensor names from the gguf library's own map), metadata `drop`ped,
    tensors replaced (`tensors`: GGUF name -> array) or added (`extra`)."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in META.items():
        if k not in drop:
            getattr(w, f"add_{k}")(v)
    for name, t in load_file(str(small / "model.safetensors")).items():
        module, kind = name.rsplit(".", 1)
        g = f"{names.get_name(module)}.{kind}"
        w.add_tensor(g, (tensors or {}).get(g, t.float().numpy()))
    for g, arr in (extra or {}).items():
        w.add_tensor(g, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load(path):
    loaded = load_model(path)
    for name in list(loaded.params.plan):
        loaded.params.pop(name)


def test_the_writer_makes_a_gguf_that_loads(small, tmp_path):
    load(write(small, tmp_path / "m.gguf"))


@pytest.mark.parametrize("key", ["head_count", "block_count", "feed_forward_length", "embedding_length"])
def test_gguf_metadata_the_model_needs_is_refused_naming_the_key_when_missing(small, tmp_path, key):
    gguf_key = {"head_count": "attention.head_count"}.get(key, key)
    with pytest.raises(WeightsError, match=f"the GGUF metadata lacks llama.{gguf_key}"):
        load(write(small, tmp_path / "m.gguf", drop=(key,)))


def test_a_gguf_without_vocab_size_or_tokens_is_refused(small, tmp_path):
    with pytest.raises(WeightsError, match="neither llama.vocab_size nor tokenizer.ggml.tokens"):
        load(write(small, tmp_path / "m.gguf", drop=("vocab_size",)))


@pytest.mark.parametrize("arr, kind", [(np.ones((96, 64), np.int8), "I8"), (np.ones((96, 64), np.float64), "F64"),
                                       (np.ones((96, 64), np.int32), "I32")])
def test_a_gguf_tensor_type_that_cannot_be_dequantized_is_refused_naming_the_tensor(small, tmp_path, arr, kind):
    with pytest.raises(WeightsError, match=f"GGUF tensor blk.0.ffn_up.weight has type {kind}, which cannot be loaded"):
        load(write(small, tmp_path / "m.gguf", tensors={"blk.0.ffn_up.weight": arr}))


@pytest.mark.parametrize("name", ["blk.0", "blk.x.attn_q.weight"])
def test_a_gguf_tensor_name_that_is_not_a_layer_tensor_is_refused(small, tmp_path, name):
    with pytest.raises(WeightsError, match=f"unexpected GGUF tensor {name} for architecture llama"):
        load(write(small, tmp_path / "m.gguf", extra={name: np.ones(4, np.float32)}))


def test_a_gguf_tensor_of_the_wrong_shape_is_refused_naming_it(small, tmp_path):
    with pytest.raises(WeightsError, match=r"tensor model.layers.1.input_layernorm.weight has shape \[1\]"):
        load(write(small, tmp_path / "m.gguf", tensors={"blk.1.attn_norm.weight": np.ones(1, np.float32)}))

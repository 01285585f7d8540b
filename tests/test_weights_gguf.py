"""GGUF loading: dequantized weights equal transformers' own GGUF loader; the engine runs from either."""

from __future__ import annotations

import pytest
import torch

from lorafleet.runner.config import EngineConfig
from lorafleet.runner.demo import find_gguf
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import SamplingParams, Sequence
from lorafleet.runner.model.weights import WeightsError, load_gguf, load_model


@pytest.fixture(scope="module")
def gguf_path():
    return find_gguf()


def test_gguf_weights_equal_transformers(gguf_path):
    from transformers import AutoModelForCausalLM

    fam, hf, ours = load_gguf(gguf_path)
    cfg = fam.config(hf, "smol")
    assert fam.name == "llama"
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ropes[0].theta, cfg.tie_word_embeddings) == (9, 3, 64, 100000.0, True)
    ref = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    sd = ref.state_dict()
    for name, t in ours.items():
        assert torch.equal(sd[name].float(), t), name  # bit-exact, q/k row permutation undone
    assert set(sd) - set(ours) == {"lm_head.weight"}  # tied to the embedding


def test_engine_from_gguf_equals_engine_from_hf_dir(gguf_path, demo_model):
    ids = [504, 3575, 282, 4649, 314]
    outs = []
    for path in (gguf_path, demo_model):
        eng = Engine(str(path), EngineConfig(kv_cache_gb=0.05, enable_lora=False))
        outs.append(eng.run_to_completion([Sequence("a", ids, SamplingParams(max_tokens=12))])["a"].output_ids)
    assert outs[0] == outs[1]


def test_pickle_checkpoints_are_refused(tmp_path, demo_model):
    (tmp_path / "config.json").write_text((demo_model / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(WeightsError, match="never unpickled"):
        load_model(tmp_path)
    with pytest.raises(WeightsError, match="does not exist"):
        load_model(tmp_path / "nope")

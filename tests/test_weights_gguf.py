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


def write_qwen2_gguf(model_dir, path):
    """A Qwen2 GGUF (F32) as llama.cpp writes one: its metadata keys and tensor names, q/k not permuted
    (llama.cpp rotates Qwen2 in the rotate-half layout), biases on q, k and v."""
    import json

    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    sd = load_file(str(model_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    for name, t in sd.items():
        if name in glob:
            g = glob[name]
        else:
            _, _, idx, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            g = f"blk.{idx}.{names[module]}.{kind}"
        w.add_tensor(g, t.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_qwen2_gguf_loads_like_transformers_and_runs_like_the_hf_directory(tmp_path):
    from family_models import write_family_model

    model = write_family_model("qwen2", tmp_path / "hf", seed=9, use_sliding_window=False)
    path = write_qwen2_gguf(model, tmp_path / "q.gguf")
    fam, hf, ours = load_gguf(path)
    assert fam.name == "qwen2" and fam.config(hf, "q").qkv_bias
    from safetensors.torch import load_file

    sd = load_file(str(model / "model.safetensors"))
    assert set(ours) == set(sd)
    for name, t in ours.items():
        assert torch.equal(sd[name].float(), t), name
    # transformers' own GGUF reader agrees on the file's conventions (names, no q/k permutation for qwen2)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).state_dict()
    assert set(ref) == set(ours) and all(torch.equal(ref[k].float(), v) for k, v in ours.items())
    ids = [5, 17, 33, 2, 90, 41, 7, 7, 120, 3]
    outs = []
    for p in (path, model):
        eng = Engine(str(p), EngineConfig(device="cpu", kv_cache_gb=0.02, enable_lora=False))
        outs.append(eng.run_to_completion([Sequence("a", ids, SamplingParams(max_tokens=10, ignore_eos=True))])["a"].output_ids)
    assert outs[0] == outs[1]


def test_gguf_of_an_unsupported_architecture_is_refused(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma3")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(WeightsError, match=r"GGUF architecture 'gemma3' is not supported \(supported: llama, qwen2, qwen3\)"):
        load_model(tmp_path / "g.gguf")

"""GGUF loading: dequantized weights equal transformers' own GGUF loader; the engine runs from either."""

from __future__ import annotations

import json

import pytest
import torch

from lorafleet.models import registry
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


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_checkpoint_with_nan_or_inf_is_refused_naming_the_tensor(tmp_path, tiny_llama, quantization):
    """A NaN or Inf in a weight would load and answer with garbage: refused at load, naming the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    from lorafleet.runner.config import EngineConfig
    from lorafleet.runner.engine.engine import Engine

    for name, value in (("model.layers.0.mlp.up_proj.weight", float("nan")),
                        ("model.layers.1.input_layernorm.weight", float("inf"))):
        d = tmp_path / name
        shutil.copytree(tiny_llama, d)
        sd = load_file(str(d / "model.safetensors"))
        sd[name] = sd[name].clone()
        sd[name].view(-1)[3] = value
        save_file(sd, str(d / "model.safetensors"))
        with pytest.raises(WeightsError, match=f"tensor {name} of the checkpoint contains NaN or Inf"):
            Engine(str(d), EngineConfig(device="cpu", num_pages=16, quantization=quantization))


def write_gguf(model_dir, path, arch: str):
    """A GGUF (F32) of an HF directory as llama.cpp writes one, named by the gguf library's own tensor-name
    map (the reference, independent of lorafleet's tables): its metadata keys, q/k not permuted (these
    architectures rotate in the rotate-half layout), Gemma's norms stored as 1 + w, Phi-3's rotary dimension
    and LongRoPE factors as llama.cpp stores them."""
    import json

    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    sd = load_file(str(model_dir / "model.safetensors"))
    L, H, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), L)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg.get("pad_token_id") or 0)
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma3":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch == "phi3":
        head_dim = H // heads
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))))
        if rope.get("rope_type") == "longrope":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            import numpy as np

            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    if arch == "llama" and rope.get("rope_type") == "llama3":
        # llama.cpp's Llama-3.x conversion: no scaling metadata, one divisor per frequency in rope_freqs
        import numpy as np
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        plain = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters", "architectures")}
        base = LlamaRotaryEmbedding(LlamaConfig(**plain, rope_theta=rope["rope_theta"])).inv_freq
        scaled = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})).inv_freq
        w.add_tensor("rope_freqs.weight", (base / scaled).float().numpy().astype(np.float32))
    if cfg.get("eot_token_id") is not None:
        w.add_eot_token_id(cfg["eot_token_id"])
    for name, t in sd.items():
        module, kind = name.rsplit(".", 1)
        g = names.get_name(module)
        assert g is not None, name
        arr = t.float().numpy()
        if arch == "gemma3" and "norm" in module:
            arr = arr + 1.0
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):  # llama.cpp's interleaved rotary rows
            n = heads if module.endswith("q_proj") else cfg["num_key_value_heads"]
            arr = arr.reshape(n, 2, arr.shape[0] // n // 2, *arr.shape[1:]).swapaxes(1, 2).reshape(arr.shape)
        w.add_tensor(f"{g}.{kind}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# family, config overrides that the format can carry, whether transformers' own GGUF reader takes it
GGUF_CASES = {
    "qwen2": (dict(use_sliding_window=False), True),
    "llama3": (dict(tie_word_embeddings=False), False),  # llama3 RoPE as llama.cpp's rope_freqs: transformers drops it
    "phi3": (dict(rope_scaling=None, partial_rotary_factor=1.0, sliding_window=None, max_position_embeddings=512), True),
    "phi3-longrope": (dict(), False),  # partial rotary and LongRoPE factors: transformers' reader drops both
    "gemma3": (dict(layers=6, sliding_window_pattern=6, query_pre_attn_scalar=24, final_logit_softcapping=None,
                    attn_logit_softcapping=None,
                    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), True),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_loads_like_transformers_and_runs_like_the_hf_directory(case, tmp_path):
    """A GGUF of each architecture llama.cpp and transformers share with us (Llama: the demo tests above)
    holds the HF directory's tensors under our names (Gemma's norms shifted back, Phi-3's fused projections
    whole), transformers' own GGUF reader agrees where it takes the file, and the engine runs it token for
    token like the HF directory."""
    from family_models import write_family_model
    from safetensors.torch import load_file

    family = case.split("-")[0]
    arch = "llama" if family == "llama3" else family
    overrides, hf_reads = GGUF_CASES[case]
    overrides = dict(overrides)
    layers = overrides.pop("layers", 3)
    model = write_family_model(family, tmp_path / "hf", seed=9, layers=layers, **overrides)
    path = write_gguf(model, tmp_path / "m.gguf", arch)
    fam, hf, ours = load_gguf(path)
    assert fam.name == arch
    sd = load_file(str(model / "model.safetensors"))
    assert set(ours) == set(sd) - ({"lm_head.weight"} if fam.config(hf, "x").tie_word_embeddings else set())
    if arch == "llama":
        assert fam.config(hf, "x").ropes[0].kind == "freq_factors"
    for name, t in ours.items():
        torch.testing.assert_close(t, sd[name].float(), rtol=0, atol=1e-6, msg=name)  # Gemma's norms: (1 + w) - 1
    if hf_reads:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).state_dict()
        assert set(ours) <= set(ref)
        for k, v in ours.items():
            assert torch.equal(ref[k].float(), v), k
    ids = [5, 17, 33, 2, 90, 41, 7, 7, 120, 3, 55, 61, 8]
    outs = []
    for p in (path, model):
        eng = Engine(str(p), EngineConfig(device="cpu", kv_cache_gb=0.02, enable_lora=False))
        want = registry.config_from_hf(json.loads((model / "config.json").read_text()))
        assert eng.model_config.layer_window == want.layer_window
        outs.append(eng.run_to_completion([Sequence("a", ids, SamplingParams(max_tokens=10, ignore_eos=True))])["a"].output_ids)
    assert outs[0] == outs[1]


def test_gguf_of_an_unsupported_architecture_is_refused(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "falcon")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(WeightsError, match=r"GGUF architecture 'falcon' is not supported \(supported: llama, qwen2, qwen3, gemma3, phi3\)"):
        load_model(tmp_path / "g.gguf")


def test_gguf_end_of_turn_tokens_stop_like_eos(tmp_path):
    """A chat model's end-of-turn token (tokenizer.ggml.eot_token_id: Gemma's <end_of_turn>, Phi-3's <|end|>)
    ends generation as the generation_config of its HF directory does."""
    from family_models import write_family_model

    model = write_family_model("qwen2", tmp_path / "hf", seed=2, use_sliding_window=False)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "eot_token_id": 7}))
    fam, hf, _ = load_gguf(write_gguf(model, tmp_path / "m.gguf", "qwen2"))
    assert fam.config(hf, "x").eos_token_ids == (cfg["eos_token_id"], 7)

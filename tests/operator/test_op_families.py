"""The operator's base-model check knows every supported family: a pool's config.json gives the family and
the shape adapters must fit, an unsupported architecture is refused naming the supported ones, and an
adapter is checked against its base model's own module names (Phi-3's fused projections)."""

from __future__ import annotations

import json

import pytest

from lorafleet.common.peft_config import AdapterError, inspect_adapter
from lorafleet.models import registry
from lorafleet.operator.spec import SpecError, base_shape_from_config, base_shape_from_status, base_shape_status
from model_helpers import write_safetensors


@pytest.mark.parametrize("shape", ["llama3-8b", "mistral-7b", "qwen2.5-7b", "qwen3-8b", "gemma-3-12b", "phi-4-mini"])
def test_pool_base_shape_carries_the_family(shape):
    cfg = registry.shapes()[shape]
    got = base_shape_from_config(cfg)
    assert got.family == registry.family_for(cfg).name
    assert got.q_dim == cfg["num_attention_heads"] * (cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    status = base_shape_status(got, "https://models.example/x")
    assert json.loads(json.dumps(status))["family"] == got.family  # what the status subresource stores
    assert base_shape_from_status({"baseModel": status}) == got


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(SpecError, match=r"base model: architectures \['FalconForCausalLM'\] is not supported.*"
                                        r"Qwen2ForCausalLM.*Gemma3ForCausalLM"):
        base_shape_from_config({"architectures": ["FalconForCausalLM"], "hidden_size": 8})
    with pytest.raises(SpecError, match="multimodal"):
        base_shape_from_config({"architectures": ["Gemma3ForConditionalGeneration"]})


def _phi_adapter(folder, module_names, rank=4):
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8,
                                                            "target_modules": [m.rsplit(".", 1)[-1] for m in module_names]}))
    phi = base_shape_from_config(registry.shapes()["phi-4-mini"])
    outs = {"self_attn.qkv_proj": phi.q_dim + 2 * phi.kv_dim, "mlp.gate_up_proj": 2 * phi.intermediate_size,
            "self_attn.q_proj": phi.q_dim}
    tensors = {}
    for m in module_names:
        key = f"base_model.model.model.layers.0.{m}"
        tensors[key + ".lora_A.weight"] = (rank, phi.hidden_size)
        tensors[key + ".lora_B.weight"] = (outs[m], rank)
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    return phi


def test_fused_lora_targets_split_into_the_engines_projections(tmp_path):
    phi = _phi_adapter(tmp_path / "fused", ["self_attn.qkv_proj", "mlp.gate_up_proj"])
    spec = inspect_adapter("fused", tmp_path / "fused", base=phi)
    rows = {m.proj: m.b_rows for m in spec.modules}
    q, kv, inter = phi.q_dim, phi.kv_dim, phi.intermediate_size
    assert rows == {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), "gate": (0, inter), "up": (inter, 2 * inter)}
    assert spec.target_modules == ("q", "k", "v", "gate", "up")
    # a module Phi-3 checkpoints do not have
    _phi_adapter(tmp_path / "split", ["self_attn.q_proj"])
    with pytest.raises(AdapterError, match="only lora_A/lora_B weights of .*qkv_proj.* on phi3 models"):
        inspect_adapter("split", tmp_path / "split", base=phi)


def test_a_fused_module_the_config_targets_without_weights_is_refused(tmp_path):
    """Phi-3 names its fused modules in target_modules; one with no tensors in the file is refused by that name."""
    phi = _phi_adapter(tmp_path / "half", ["self_attn.qkv_proj"])
    cfg = json.loads((tmp_path / "half" / "adapter_config.json").read_text())
    (tmp_path / "half" / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["qkv_proj",
                                                                                                  "gate_up_proj"]}))
    with pytest.raises(AdapterError, match="targets gate_up_proj but adapter_model.safetensors holds no LoRA weights"):
        inspect_adapter("half", tmp_path / "half", base=phi)
    # without a base, the file's modules name the family: Phi-3's gate_up_proj is asked for too
    with pytest.raises(AdapterError, match="targets gate_up_proj"):
        inspect_adapter("half", tmp_path / "half")

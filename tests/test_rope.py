"""RoPE frequencies and cos/sin (default, linear, llama3, partial-rotary LongRoPE) equal transformers' own."""

from __future__ import annotations

import pytest
import torch

from lorafleet.models.contract import ModelConfigError
from lorafleet.models.registry import config_from_hf
from lorafleet.runner.model.rope import Rope, inv_frequencies

BASE = dict(vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=4096, rope_theta=500000.0)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}])
def test_inv_freq_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(**BASE, rope_scaling=scaling)
    ref = LlamaRotaryEmbedding(hf_cfg).inv_freq
    ours = inv_frequencies(config_from_hf(hf_cfg.to_dict()).ropes[0])
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)


def test_partial_longrope_cos_sin_match_transformers():
    """Phi-4-mini's kind: 3/4 of each head rotates, short factors, cos and sin scaled by the attention factor."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    short = [1.0 + 0.1 * i for i in range(24)]
    hf_cfg = Phi3Config(**{**BASE, "num_attention_heads": 4}, partial_rotary_factor=0.75, original_max_position_embeddings=512,
                        rope_scaling={"type": "longrope", "short_factor": short, "long_factor": [2.0] * 24})
    cfg = config_from_hf({**hf_cfg.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    spec = cfg.ropes[0]
    assert spec.rotary_dim == 48 and spec.kind == "longrope" and spec.attention_factor > 1.0
    assert cfg.max_position_embeddings == 512  # LongRoPE runs within its original context
    pos = torch.arange(0, 500, 7)
    cos_ref, sin_ref = Phi3RotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), pos[None])
    cos, sin = Rope(spec, torch.device("cpu")).cos_sin(pos, torch.float32)
    torch.testing.assert_close(cos, cos_ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, sin_ref[0], rtol=1e-6, atol=1e-6)


def test_unsupported_rope_is_refused():
    with pytest.raises(ModelConfigError, match="yarn"):
        config_from_hf({**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})

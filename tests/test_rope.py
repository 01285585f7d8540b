"""RoPE frequencies (default, linear, llama3 scaling) equal transformers' own."""

from __future__ import annotations

import pytest
import torch

from lorafleet.runner.config import ModelConfig, ModelConfigError
from lorafleet.runner.model.rope import inv_frequencies

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
    ours = inv_frequencies(ModelConfig.from_hf(hf_cfg.to_dict()))
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)


def test_unsupported_rope_is_refused():
    with pytest.raises(ModelConfigError, match="yarn"):
        ModelConfig.from_hf({**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})

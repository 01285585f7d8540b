"""CPU checks of the end-to-end benchmark's building blocks (the benchmark itself needs a GPU)."""

from __future__ import annotations

import numpy as np
import torch

from lorafleet.common.peft_config import BaseShape
from lorafleet.runner.bench_e2e import random_adapters, sharegpt_requests, write_peft_adapter
from lorafleet.runner.lora.adapter import load_adapter


def test_sharegpt_lengths_match_the_documented_means():
    reqs = sharegpt_requests(1000, 0, 32000)
    assert 235 <= np.mean([len(p) for p, _ in reqs]) <= 265
    assert 220 <= np.mean([o for _, o in reqs]) <= 250
    assert reqs == sharegpt_requests(1000, 0, 32000)  # seeded


def test_cold_start_files_load_back_to_the_same_weights(tmp_path):
    base = BaseShape(num_layers=2, hidden_size=64, intermediate_size=96, q_dim=64, kv_dim=32)
    (adapter,) = random_adapters(base, 1, 4, torch.float32, torch.device("cpu"), seed=1)
    write_peft_adapter(tmp_path / "a0", adapter, 4)
    back = load_adapter("a0", tmp_path / "a0", base, max_rank=8, dtype=torch.float32)
    assert set(back.weights) == set(adapter.weights)
    for key, (a, bt) in adapter.weights.items():
        assert torch.equal(back.weights[key][0], a) and torch.equal(back.weights[key][1], bt)

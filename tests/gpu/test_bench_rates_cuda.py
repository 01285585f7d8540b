"""The memory floor's rates measured on the card (src/lorafleet/bench/rates.py): plausible for any GPU this project
runs on (an A100's ~1.5 TB/s to an H200's ~4.3 TB/s; bf16 products of ~0.2 to ~1 PFLOP/s), measured once per device,
and the memory the measurement took given back."""

from __future__ import annotations

import pytest
import torch

from lorafleet.bench import rates

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_card_is_measured_once_and_its_memory_given_back():
    rates._measured.clear()
    torch.mm(*torch.ones(2, 8, 8, dtype=torch.bfloat16, device="cuda"))  # cuBLAS's workspace is made before `before`
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    r = rates.card_rates(torch.device("cuda", 0))
    assert r["measured"] is True and torch.cuda.get_device_name(0) in r["source"]
    assert 1e12 < r["bandwidth"] < 1e13 and 1e14 < r["matmul"] < 3e15, r
    assert torch.cuda.memory_allocated() == before
    assert rates.card_rates("cuda") == r  # the current device, from the cache
    assert rates.card_rates(torch.device("cuda", 0)) is not rates._measured[0]  # a copy

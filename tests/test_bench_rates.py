"""The rates a memory floor is computed at (src/lorafleet/bench/rates.py): the card's own where there is a CUDA
device (measured on the GPU machine, tests/gpu), the H200's measured figures elsewhere, said so in the record."""

from __future__ import annotations

import torch

from lorafleet.bench import rates


def test_without_a_cuda_device_the_reference_rates_stand_in_and_say_so():
    for dev in (None, "cpu", torch.device("cpu")):
        if dev is None and torch.cuda.is_available():
            continue
        r = rates.card_rates(dev)
        assert r == rates.REFERENCE and r is not rates.REFERENCE  # a copy: a caller's edit cannot leak
        assert r["measured"] is False and "no CUDA device" in r["source"]
    r["bandwidth"] = 1.0
    assert rates.card_rates("cpu")["bandwidth"] == 4.2e12


def test_the_description_gives_both_rates_and_their_source():
    line = rates.describe({"bandwidth": 3.02e12, "matmul": 7.9e14, "source": "measured on X"})
    assert line == "3.02 TB/s, 790 TFLOP/s (measured on X)"

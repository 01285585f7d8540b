"""Which kernels `CudaSGMV.add` launches for each (mma, fused) choice, checked on the CPU against a stub
of the compiled extension: the decode steps' call is two CUDA-core launches, never the fused kernel."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lorafleet.runner.lora.sgmv_cuda import CudaSGMV

BIG = 1 << 30


class StubExt:
    MAX_SEGMENTS = 4

    def __init__(self):
        self.calls = []

    def shrink(self, *args):
        self.calls.append(("shrink", args[6], args[9]))  # mma_min_rows, max_blocks

    def expand(self, *args):
        self.calls.append(("expand", args[6]))  # mma_min_rows

    def add(self, *args):
        self.calls.append(("add", args[9], args[10]))  # shrink / expand mma_min_rows


@pytest.fixture
def sgmv(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    sg = CudaSGMV(shrink_mma_min_rows=64, expand_mma_min_rows=128)
    sg._mod = StubExt()
    sg._counters[torch.device("cpu")] = torch.zeros(8, dtype=torch.int32)
    return sg


def call(sg, **kw):
    fake = SimpleNamespace(is_cuda=True, device=torch.device("cpu"))
    seg = SimpleNamespace(indptr=None, slots=None)
    sg._mod.calls.clear()
    sg.add([fake], None, fake, [None], [None], None, None, seg, **kw)
    return sg._mod.calls


def test_decode_call_is_two_cuda_core_launches(sgmv):
    assert call(sgmv, mma=False, fused=False) == [("shrink", BIG, 0), ("expand", BIG)]


def test_fused_calls_hand_the_thresholds_to_the_one_launch_path(sgmv):
    assert call(sgmv, mma=False) == [("add", BIG, BIG)]
    assert call(sgmv) == [("add", 64, 128)]
    assert call(sgmv, mma_rows=(129, 512)) == [("add", 129, 512)]


def test_unfused_calls_keep_the_tensor_core_thresholds(sgmv):
    assert call(sgmv, fused=False) == [("shrink", 64, 0), ("expand", 128)]
    assert call(sgmv, mma_rows=(129, 512), fused=False) == [("shrink", 129, 0), ("expand", 512)]


def test_shrink_passes_the_grid_cap(sgmv):
    fake = SimpleNamespace(is_cuda=True, device=torch.device("cpu"))
    sgmv.shrink(None, fake, [None], None, None, SimpleNamespace(indptr=None, slots=None), max_blocks=16)
    assert sgmv._mod.calls == [("shrink", 64, 16)]


def test_cpu_tensors_are_refused_with_a_pointer_to_torch_sgmv():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="TorchSGMV"):
        CudaSGMV().add([x], None, x, [None], [None], None, None, None, mma=False, fused=False)

"""The o / down expand a decode step leaves to the norm after it (runner/lora/step.py LoraStepImpl.add with
defer, norm_shrink, settle; KernelChoices.norm_lora): never lost, never applied to another tensor, never applied
twice. On the CPU the norm's launch does not exist, so every deferred expand is settled on its own, which must give
the add-on of an fp32 per-row loop."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lorafleet.runner.lora.segments import build_segments
from lorafleet.runner.lora.sgmv import TorchSGMV, fp32_loop_reference
from lorafleet.runner.lora.step import LoraStepImpl
from lorafleet.runner.model.norm import NormOperands

K, N, R, S = 16, 8, 4, 3


class KwTorchSGMV(TorchSGMV):
    """TorchSGMV that takes (and ignores) the CUDA kernels' launch-shape arguments, as decode steps pass them."""

    def shrink(self, v, x, a, ranks, host_ranks, seg, **launch):
        super().shrink(v, x, a, ranks, host_ranks, seg)

    def expand(self, ys, v, b, ranks, host_ranks, seg, **launch):
        super().expand(ys, v, b, ranks, host_ranks, seg)


def _step(row_slots):
    gen = torch.Generator().manual_seed(len(row_slots))
    host = [[4, 2, 0]]  # one projection (o or down): slot 2 does not adapt it
    a, b = [torch.randn(S, R, K, generator=gen)], [torch.randn(S, R, N, generator=gen)]
    ranks = torch.tensor(host, dtype=torch.int32)
    args = (a, b, ranks, host)
    pool = SimpleNamespace(group_args=[[None, args, None, args]], device=torch.device("cpu"), max_rank=R)
    impl = LoraStepImpl(pool, KwTorchSGMV(), build_segments(row_slots), mma=False)
    impl.cluster_norm = True  # as decode graphs on a GPU with thread-block clusters set it
    impl.views[1] = torch.empty(len(row_slots), 1, R)
    return impl, a, b, host, gen


@pytest.mark.parametrize("group", [1, 3])
def test_a_deferred_expand_is_settled_once_onto_its_own_output(group):
    row_slots = [0, 1, -1, 2, 0]
    impl, a, b, host, gen = _step(row_slots)
    x = torch.randn(len(row_slots), K, generator=gen)
    y0 = torch.randn(len(row_slots), N, generator=gen)
    y = y0.clone()
    impl.add(0, group, x, (y,), defer=True)
    assert torch.equal(y, y0)  # only the shrink so far
    with pytest.raises(RuntimeError, match="never done"):  # nothing else may run before the norm takes it
        impl.add(0, group, x, (y.clone(),))
    impl.settle()
    want = y0.double() + fp32_loop_reference(x, a, b, host, row_slots)[0].double()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    impl.settle()  # nothing pending: a no-op
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


def test_the_norm_settles_a_deferred_expand_and_refuses_another_tensor():
    row_slots = [1, 0, 0]
    impl, a, b, host, gen = _step(row_slots)
    x = torch.randn(3, K, generator=gen)
    y0 = torch.randn(3, N, generator=gen)
    y = y0.clone()
    impl.add(0, 1, x, (y,), defer=True)
    w = torch.ones(N)
    other = NormOperands(torch.randn(3, N, generator=gen), None, None, w, 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="another tensor"):
        impl.norm_shrink(0, 2, torch.empty(3, N), other)
    impl.add(0, 1, x, (y,), defer=True)
    # a norm whose launch cannot take the expand (here: one that also quantizes its rows, for FP8 weights) settles
    # it on its own launch and leaves the norm to the caller
    quant = (torch.empty(3, N), torch.empty(3))
    assert impl.norm_shrink(0, 2, torch.empty(3, N), NormOperands(y, None, None, w, 1e-6, 0.0), quant) is False
    want = y0.double() + fp32_loop_reference(x, a, b, host, row_slots)[0].double()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


def test_without_cluster_norm_add_ignores_defer():
    row_slots = [0, 1]
    impl, a, b, host, gen = _step(row_slots)
    impl.cluster_norm = False
    x = torch.randn(2, K, generator=gen)
    y0 = torch.randn(2, N, generator=gen)
    y = y0.clone()
    impl.add(0, 1, x, (y,), defer=True)  # the whole add-on at once
    want = y0.double() + fp32_loop_reference(x, a, b, host, row_slots)[0].double()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)

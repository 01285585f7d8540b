"""LoRA beside the base GEMM (KernelChoices.lora_branch) on the GPU.

- Kernel: the expand's write mode (csrc/sgmv.h ExpandArgs::write_f32) writes exactly the fp32 sums the
  accumulating expand adds: y_bf16 + the written add-on is the accumulating expand's y bit for bit, on CUDA-core
  and tensor-core items; rows without an adapter and projections a slot does not adapt are not written; the add-on
  against an fp64 reference.
- Engine: a decode step replayed from graphs captured with the branch (addon: shrink and writing expand on a second
  stream, the add-on added after the GEMM; shrink: the shrink there, the expand after the GEMM) gives the logits of the
  engine's own graphs bit for bit, on a model with base rows, a rank-16 adapter on every projection and a rank-4
  MLP-only one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import teacher
from lorafleet.runner.config import KernelChoices
from lorafleet.runner.lora.sgmv_cuda import CudaSGMV
from test_shrink_early_cuda import DEV, K, OUT, R, TABLES, case

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("table", list(TABLES))
def test_written_addon_plus_y_is_the_accumulating_expand_bit_for_bit(dtype, table):
    row_slots, T, (a, b, ranks, host), seg, g = case(table, dtype, 21)
    x = torch.randn(T, K, generator=g, device=DEV).to(dtype)
    y0 = torch.randn(T, sum(OUT), generator=g, device=DEV).to(dtype)
    v = torch.zeros(T, 3, R, device=DEV)
    sg = CudaSGMV()
    rows = None if table == "mma" else 1 << 30  # "mma": the 150-row segment on tensor-core items
    sg.shrink(v, x, a, ranks, host, seg, mma_min_rows=rows)
    y = y0.clone()
    sg.expand(list(y.split(OUT, dim=1)), v, b, ranks, host, seg, mma_min_rows=rows)
    addon = torch.full((T, sum(OUT)), float("nan"), device=DEV)
    sg.expand(list(addon.split(OUT, dim=1)), v, b, ranks, host, seg, mma_min_rows=rows, write=True)
    torch.cuda.synchronize()
    for p, part in enumerate(addon.split(OUT, dim=1)):
        for t, s in enumerate(row_slots):
            r = host[p][s] if s >= 0 else 0
            if r == 0:
                assert torch.isnan(part[t]).all(), (table, p, t)  # not written
                continue
            assert torch.isfinite(part[t]).all(), (table, p, t)
            # tensor-core items round v to the pool's dtype first; CUDA-core items use it in fp32
            vt = v[t, p, :r].to(dtype) if (table == "mma" and t < 150) else v[t, p, :r]
            want = vt.double() @ b[p][s, :r].double()
            scale = (vt.double().abs() @ b[p][s, :r].double().abs()).max()
            assert (part[t].double() - want).abs().max() <= 1e-5 * scale, (table, p, t)
    summed = y0.clone().add_(addon.nan_to_num(nan=0.0))
    assert torch.equal(summed, y), f"{table}: y + written add-on differs from the accumulating expand"
    assert not torch.equal(y, y0)

    with pytest.raises(RuntimeError, match="expand_write writes fp32 outputs"):
        sg.expand(list(y.split(OUT, dim=1)), v, b, ranks, host, seg, write=True)


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return teacher.family_with_two_adapters("llama3", tmp_path_factory.mktemp("gpu-branch"))


@pytest.mark.parametrize("mode", ["addon", "shrink"])
def test_decode_graph_with_lora_beside_the_gemm_gives_the_same_logits(fam, monkeypatch, mode):
    """`mode` addon: the shrink and the writing expand on the second stream; shrink: the shrink there, the expand
    after the GEMM. Either way the engine's own graphs' logits, bit for bit, and the shrinks ran on another stream."""
    from lorafleet.runner.executor.executor import make_graphs

    model, _, reqs = fam
    writes, streams = [], []
    real_expand, real_shrink = CudaSGMV.expand, CudaSGMV.shrink

    def expanding(self, *args, **kw):
        writes.append(bool(kw.get("write", False)))
        return real_expand(self, *args, **kw)

    def shrinking(self, *args, **kw):
        streams.append(torch.cuda.current_stream().cuda_stream)
        return real_shrink(self, *args, **kw)

    monkeypatch.setattr(CudaSGMV, "expand", expanding)
    monkeypatch.setattr(CudaSGMV, "shrink", shrinking)
    # (cuBLAS's products: with bf16_sm90 the expand is inside the wgmma product and no branch is captured)
    eng, batch = teacher.decode_step(model, reqs[:6] + reqs[:2], kernels=KernelChoices(bf16_sm90=False))
    assert (eng.config.kernels or KernelChoices()).lora_branch == "off" and not any(writes)
    d = batch.to_device(eng.device)
    plain = [eng.runner.graphs.run(batch, d).clone() for _ in range(2)]
    assert torch.equal(plain[0], plain[1])
    writes.clear()
    streams.clear()
    beside = make_graphs(eng.model, eng.attention, eng.lora_pool, eng.sgmv,
                         dataclasses.replace(eng.config, kernels=dataclasses.replace(
                             eng.config.kernels or KernelChoices(), lora_branch=mode)),
                         eng.runner.graphs.scratch_page)
    assert len(writes) >= 4 * eng.model.num_layers  # captured with the branch
    assert all(writes) if mode == "addon" else not any(writes)
    sides = {st.lora._side.cuda_stream for st in beside.static.values()}
    assert streams and set(streams) <= sides  # every shrink on a second stream
    for _ in range(2):
        assert torch.equal(beside.run(batch, d), plain[0])
    assert torch.equal(eng.runner.graphs.run(batch, d), plain[0])

"""Piecewise steps (everything but attention replayed from static buffers, rows padded to a
bucket) against the whole-step forward pass, on the CPU without graph capture: the padding,
static buffers, segment table and attention `out` plumbing that the CUDA graphs replay."""

from __future__ import annotations

import pytest
import torch

from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.step_batch import to_device
from lorafleet.runner.engine.step_batch import build_step_batch
from lorafleet.runner.executor.piecewise import PiecewiseGraphs, default_buckets
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
from model_helpers import write_random_adapter

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("pw-adapters")
    return {
        "a8": write_random_adapter(tiny_llama, d / "a8", r=8, alpha=16, targets=ALL, seed=11),
        "a2": write_random_adapter(tiny_llama, d / "a2", r=2, alpha=4, targets=("v_proj", "down_proj"), seed=12),
    }


def make_requests(adapters, n, seed, prefix):
    g = torch.Generator().manual_seed(seed)
    names = [None, "a8", "a2"]
    out = []
    for i in range(n):
        ids = torch.randint(3, 512, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
        name = names[i % 3]
        ref = AdapterRef(name, str(adapters[name])) if name else None
        out.append(Sequence(f"{prefix}{i}", ids, SamplingParams(max_tokens=6, ignore_eos=True), ref, arrival=float(i)))
    return out


def engine(tiny_llama, piecewise: bool):
    eng = Engine(str(tiny_llama), EngineConfig(device="cpu", max_batch_size=8, page_size=4, num_pages=300,
                                                max_lora_rank=8))
    if piecewise:
        eng.runner.mixed = PiecewiseGraphs(eng.model, eng.attention, eng.lora_pool, eng.sgmv, 8, [16, 48, 128],
                                           eng.executor.num_pages * eng.config.page_size, use_graphs=False)
    return eng


def test_default_buckets():
    b = default_buckets(8224)
    assert b[0] == 64 and b[-2:] == [8192, 8224] and len(b) <= 20
    assert all(y > x for x, y in zip(b, b[1:]))
    assert all((y - x) / y <= 1 / 3 for x, y in zip(b, b[1:]) if x >= 256)  # padding wastes <= 1/3 past 256
    assert default_buckets(100) == [64, 100]
    assert default_buckets(64) == [64]


def test_mixed_step_logits_equal_the_whole_step(tiny_llama, adapters):
    eng = engine(tiny_llama, piecewise=True)
    first = make_requests(adapters, 4, seed=1, prefix="a")
    for s in first:
        eng.submit(s)
    eng.step()
    eng.step()  # now decoding
    for s in make_requests(adapters, 3, seed=2, prefix="b"):
        eng.submit(s)
    eng._drain_inbox()
    plan = eng.batcher.schedule()
    assert plan.prefill_tokens and plan.num_decode
    batch = build_step_batch(plan.work, eng.config.page_size, 8)
    T = batch.num_tokens
    assert T not in (16, 48, 128)  # really padded
    ref = eng.runner.forward(batch, to_device(batch, eng.device, None))
    got = eng.runner.mixed.run(batch, to_device(batch, eng.device, None))
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # a step larger than every bucket is refused (and then runs whole)
    assert eng.runner.mixed.bucket(129, 1, 1) is None and eng.runner.mixed.bucket(10, 9, 1) is None


def test_generation_with_piecewise_steps_equals_whole_steps(tiny_llama, adapters):
    outs = []
    for pw in (False, True):
        eng = engine(tiny_llama, pw)
        eng.runner.phases = {}
        done = eng.run_to_completion(make_requests(adapters, 14, seed=3, prefix="r"))
        outs.append({k: v.output_ids for k, v in done.items()})
        if pw:
            assert eng.runner.phases["piecewise"][3] > 0  # steps really went through the pieces
        assert eng.blocks.free_pages == eng.blocks.num_pages
    assert outs[0] == outs[1]


def test_a_smaller_step_after_a_larger_one_reads_no_stale_rows(tiny_llama):
    """Six 15-token prompts (90 rows, bucket 128), four finish at once, then two decode rows in
    bucket 16: logit rows left over from the large step must not be read."""
    eng = engine(tiny_llama, piecewise=True)
    g = torch.Generator().manual_seed(8)
    seqs = [Sequence(f"s{i}", torch.randint(3, 512, (15,), generator=g).tolist(),
                     SamplingParams(max_tokens=1 if i < 4 else 3, ignore_eos=True), arrival=float(i)) for i in range(6)]
    done = eng.run_to_completion(seqs)
    ref = engine(tiny_llama, piecewise=False).run_to_completion(
        [Sequence(s.id, s.prompt_ids, s.params, arrival=s.arrival) for s in seqs])
    assert {k: v.output_ids for k, v in done.items()} == {k: v.output_ids for k, v in ref.items()}


def _step_with_adapters(tiny_llama, adapters, seed: int, prefix: str):
    """An engine after one step of six requests with adapters, its next step batch, the batch's device
    copy and the ordinary forward pass's logits of it."""
    eng = engine(tiny_llama, piecewise=False)
    for s in make_requests(adapters, 6, seed=seed, prefix=prefix):
        eng.submit(s)
    eng.step()
    eng._drain_inbox()
    plan = eng.batcher.schedule()
    batch = build_step_batch(plan.work, eng.config.page_size, 8)
    d = to_device(batch, eng.device, None)
    assert d.seg.any_adapter
    return eng, batch, d, eng.runner.forward(batch, d)


class _ExpandingWriter:
    """A K/V writer that takes the qkv LoRA expand the LoRA step leaves to it (as the fused CUDA writer does
    in decode graphs with rope_kv_lora), adds it with the torch expand over the handed-over v, B, ranks and
    per-row slots, then rotates and writes like the torch writer."""

    def __init__(self, eng):
        from lorafleet.runner.model.rope_kv import TorchKvWriter

        self.eng, self.inner, self.handed = eng, TorchKvWriter(eng.model, eng.kv.flat), []

    def __call__(self, layer, qkv, io, expand=None):
        from lorafleet.runner.lora.segments import SegmentTable

        assert expand is not None  # left to the writer: added before the rotation
        c, eng = self.eng.model.cfg, self.eng
        v, b, ranks, row_slot = expand
        rows = row_slot.tolist()
        self.handed.append(rows)
        host = eng.lora_pool.group_args[layer][0][3]
        # the rows' own one-row segments, from the handed-over slots: the add-on must not depend on them
        indptr = torch.arange(len(rows) + 1, dtype=torch.int32)
        seg = SegmentTable(indptr, torch.tensor(rows, dtype=torch.int32), tuple(range(len(rows) + 1)), tuple(rows),
                           len(rows))
        eng.sgmv.expand(list(qkv.split([c.q_dim, c.kv_dim, c.kv_dim], dim=-1)), v, b, ranks, host, seg)
        return self.inner(layer, qkv, io, None)


def test_qkv_expand_left_to_the_kv_writer_gives_the_same_logits(tiny_llama, adapters):
    """The LoRA step of a decode graph with the fused K/V writer (`qkv_expand_in_rope`) hands the qkv
    expand's operands to the writer instead of adding it; the writer adding it before the rotation gives the
    logits of the ordinary forward pass bit for bit."""
    from lorafleet.runner.lora.step import LoraStepImpl
    from lorafleet.runner.model.decoder import StepIO

    eng, batch, d, ref = _step_with_adapters(tiny_llama, adapters, seed=5, prefix="e")
    writer = _ExpandingWriter(eng)
    plain = eng.model.kv_write
    eng.model.attach_kv(writer)
    try:
        lora = LoraStepImpl(eng.lora_pool, eng.sgmv, d.seg, None, mma=False, qkv_expand_in_rope=True)
        io = StepIO(d.input_ids, d.positions, d.slot_mapping, d.logit_rows)
        got = eng.model.forward(io, eng.attention.begin(d.attn_meta(batch)), lora)
    finally:
        eng.model.attach_kv(plain)
    assert len(writer.handed) == eng.model.cfg.num_layers
    want_slots = [s for s, n in zip(batch.seg_slots, (b - a for a, b in zip(batch.seg_indptr, batch.seg_indptr[1:])))
                  for _ in range(n)]
    assert writer.handed[0] == want_slots
    assert torch.equal(got, ref)

"""Tensor parallelism on the CPU with gloo: a small GQA Llama split over 2 (and 4 and 8) ranks, with
mixed adapters swapping through two slots (every rank mirrors rank 0's slots), chunked prefill and
overlapped steps, gives exactly the greedy tokens of one rank (fp32). A rank that dies fails the
engine with its reason instead of hanging it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from lorafleet.runner.config import EngineConfig, ModelConfigError
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.tp_workers import TPFailure
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
from model_helpers import write_random_adapter, write_random_llama

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    model = write_random_llama(d / "model", hidden=128, layers=2, heads=16, kv_heads=8, inter=256, vocab=512, seed=3)
    ads = {
        "all8": write_random_adapter(model, d / "all8", r=8, alpha=16, seed=5,
                                     targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj")),
        "vd4": write_random_adapter(model, d / "vd4", r=4, alpha=8, targets=("v_proj", "down_proj"), seed=6),
        "qou16": write_random_adapter(model, d / "qou16", r=16, alpha=16, targets=("q_proj", "o_proj", "up_proj"),
                                      seed=7, use_rslora=True),
    }
    return model, ads


# every rank samples each step (its next inputs read the samples on its own device): the logit changes and the
# sampling draws must reach every rank
SAMPLING = [dict(), dict(repetition_penalty=1.5, frequency_penalty=0.5, prompt_logprobs=2, logprobs=1),
            dict(temperature=0.8, min_p=0.05, seed=4),
            dict(logit_bias=((7, 4.0),), min_tokens=3, stop_token_ids=(9,), presence_penalty=-1.0)]


def requests(ads, n=12, new=10):
    g = torch.Generator().manual_seed(11)
    names = [None, "all8", "vd4", "qou16"]
    return [Sequence(f"r{i}", torch.randint(3, 512, (int(torch.randint(4, 30, (1,), generator=g)),),
                                             generator=g).tolist(),
                     SamplingParams(max_tokens=new, ignore_eos=True, **SAMPLING[i % 3 if i % 4 == 0 else i % 4]),
                     AdapterRef(names[i % 4], str(ads[names[i % 4]])) if names[i % 4] else None, arrival=float(i))
            for i in range(n)]


def generate(model, ads, tp, n=12, new=10, parts=None, **cfg):
    """The requests' (finish reason, tokens); `parts`: a list given the number of parts of each step launched."""
    eng = Engine(str(model), EngineConfig(device="cpu", tp=tp, max_batch_size=6, page_size=4, num_pages=300,
                                          max_lora_rank=16, lora_slots=2, **cfg))
    if parts is not None:
        launch = eng.runner.launch_parts
        eng.runner.launch_parts = lambda batches, *a: parts.append(len(batches)) or launch(batches, *a)
    try:
        done = eng.run_to_completion(requests(ads, n, new))
        assert eng.blocks.free_pages == eng.blocks.num_pages
        procs = list(eng.tp.procs) if eng.tp else []
    finally:
        eng.close()
    assert all(not p.is_alive() for p in procs)  # no rank left behind
    return {k: (v.finish_reason, v.output_ids) for k, v in done.items()}


@pytest.fixture(scope="module")
def tp1(gqa):
    return generate(*gqa, tp=1)


def test_tp2_gives_the_tokens_of_one_rank(gqa, tp1):
    assert all(r == "length" for r, _ in tp1.values())
    assert generate(*gqa, tp=2, overlap=True, chunked_prefill=True, max_step_tokens=16) == tp1


def test_tp2_with_steps_in_two_passes_gives_the_tokens_of_one_rank(gqa, tp1):
    """EngineConfig.batch_invariant: every rank runs a step's decode rows and prompt rows as two passes (the
    step's parts reach the ranks together), reading pending ids from both parts of the step before."""
    parts = []
    got = generate(*gqa, tp=2, overlap=True, chunked_prefill=True, max_step_tokens=16, batch_invariant=True,
                   parts=parts)
    assert got == tp1 and parts.count(2) >= 3


@pytest.mark.parametrize("tp", [4, 8])
def test_bigger_groups_give_the_tokens_of_one_rank(gqa, tp):
    """The code path of 4 and 8 ranks (fewer, shorter requests: 8 processes share the CI's cores)."""
    assert generate(*gqa, tp=tp, n=5, new=4) == generate(*gqa, tp=1, n=5, new=4)


def test_tp2_on_the_dense_lora_path_gives_the_tokens_of_one_rank(tmp_path, monkeypatch):
    """Prompts of 1,100-1,300 tokens, one per step, the work floor lowered: LoRA's dense path (runner/lora/step.py),
    its calls counted on rank 0 (this process; the spawned rank decides from the same batch and config, not
    counted here), and the all-reduced partial sums of o and down (each rank's add-on written before its base
    product) give one rank's tokens."""
    from lorafleet.runner.config import KernelChoices
    from lorafleet.runner.lora.step import LoraStepImpl

    model = write_random_llama(tmp_path / "model", hidden=128, layers=2, heads=16, kv_heads=8, inter=256, vocab=512,
                               seed=3, max_positions=2048)
    ads = {"all8": write_random_adapter(model, tmp_path / "all8", r=8, alpha=16, seed=5,
                                        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj")),
           "vd4": write_random_adapter(model, tmp_path / "vd4", r=4, alpha=8, targets=("v_proj", "down_proj"), seed=6),
           "qou16": write_random_adapter(model, tmp_path / "qou16", r=16, alpha=16,
                                         targets=("q_proj", "o_proj", "up_proj"), seed=7)}
    calls, kcalls = [], []
    real, kreal = LoraStepImpl.dense_linear, LoraStepImpl._kext_linear

    def counted(self, layer, group, x, w, bias, **kw):
        calls.append(group)
        return real(self, layer, group, x, w, bias, **kw)

    monkeypatch.setattr(LoraStepImpl, "dense_linear", counted)
    # the K-extended GEMM (KernelChoices.dense_lora_kext's default) on one rank; with two, the o and down outputs
    # are all-reduced as contiguous tensors: no room beside the next input, the add-on written first
    monkeypatch.setattr(LoraStepImpl, "_kext_linear", staticmethod(lambda *args: kcalls.append(1) or kreal(*args)))
    g = torch.Generator().manual_seed(13)
    names = ["all8", "qou16", None, "vd4"]

    def run(tp):
        eng = Engine(str(model), EngineConfig(device="cpu", tp=tp, max_batch_size=1, page_size=16, num_pages=400,
                                              max_lora_rank=16, max_step_tokens=1400,
                                              kernels=KernelChoices(dense_lora_rows=256, dense_lora_min_work=1)))
        try:
            lw = eng.executor.model.layers[0]  # spare columns for the K-extended GEMM on one rank only
            assert (lw.qkv.stride(0) > lw.qkv.shape[1]) == (tp == 1)
            seqs = [Sequence(f"d{i}", p, SamplingParams(max_tokens=4, ignore_eos=True),
                             AdapterRef(n, str(ads[n])) if n else None) for i, (p, n) in enumerate(zip(prompts, names))]
            out = eng.run_to_completion(seqs)
            assert all(v.finish_reason == "length" for v in out.values()), out
            return {k: v.output_ids for k, v in out.items()}
        finally:
            eng.close()

    prompts = [torch.randint(3, 512, (int(torch.randint(1100, 1300, (1,), generator=g)),), generator=g).tolist()
               for _ in names]
    one = run(1)
    assert set(calls) == {0, 1, 2, 3} and kcalls
    calls.clear()
    kcalls.clear()
    assert run(2) == one
    assert set(calls) == {0, 1, 2, 3} and not kcalls


def test_a_model_that_does_not_split_is_refused(gqa, tmp_path, monkeypatch):
    """Refused from its config.json before any other rank's process starts (--tp 64 started 64 processes first)."""
    from lorafleet.runner.engine import tp_workers

    def no_ranks(*args, **kwargs):
        raise AssertionError("the ranks were started before the split was checked")

    monkeypatch.setattr(tp_workers.TPWorkers, "__init__", no_ranks)
    model = write_random_llama(tmp_path / "m", hidden=96, layers=1, heads=6, kv_heads=3, inter=128, vocab=64)
    with pytest.raises(ModelConfigError, match="KV heads"):
        Engine(str(model), EngineConfig(device="cpu", tp=2, num_pages=50))


def test_a_dead_rank_fails_the_engine_with_its_reason(gqa):
    model, ads = gqa
    eng = Engine(str(model), EngineConfig(device="cpu", tp=2, max_batch_size=4, page_size=4, num_pages=200))
    try:
        for s in requests(ads, 4):
            eng.submit(Sequence(s.id, s.prompt_ids, SamplingParams(max_tokens=200, ignore_eos=True)))
        eng.step()
        os.kill(eng.tp.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises((TPFailure, RuntimeError)) as err:
            while eng.has_work():
                eng.step()
        assert time.monotonic() - t0 < 60
        assert "rank 1" in str(err.value) or "Connection" in str(err.value) or "closed" in str(err.value), err.value
    finally:
        eng.close()


def test_adapters_sharing_weights_share_their_rank_slices():
    """Synthetic adapters of one seed (a benchmark's population) are sliced for a rank once, not
    once per adapter name: the slices are cached on the shared packed weights."""
    from lorafleet.common.peft_config import BaseShape
    from lorafleet.runner.parallel.shard import Shard
    from lorafleet.runner.lora.synthetic import synthetic_adapter

    base = BaseShape(num_layers=2, hidden_size=64, intermediate_size=96, q_dim=64, kv_dim=32)
    a = synthetic_adapter("x", "synthetic://3?rank=4", base, torch.float32)
    b = synthetic_adapter("y", "synthetic://3?rank=4", base, torch.float32)
    c = synthetic_adapter("z", "synthetic://4?rank=4", base, torch.float32)
    sa, sb = a.shard_for(Shard(1, 2), base), b.shard_for(Shard(1, 2), base)
    assert sa is sb and c.shard_for(Shard(1, 2), base) is not sa
    # rank 1 of 2: column-parallel B keeps the upper half of the output, row-parallel A the upper
    # half of the input; the other factor whole
    q, down = 0, 6
    assert torch.equal(sa.bt[q], a.packed.bt[q][..., 32:]) and torch.equal(sa.a[q], a.packed.a[q])
    assert torch.equal(sa.a[down], a.packed.a[down][..., 48:]) and torch.equal(sa.bt[down], a.packed.bt[down])

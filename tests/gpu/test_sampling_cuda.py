"""Sampling options on the CUDA engine (decode graphs, overlapped steps: a request's newest token still on the
device when the next step's logits are changed): log-probabilities, prompt log-probabilities, penalties,
logit_bias and min_tokens.

Exact checks where bf16 cannot blur them (a +100 bias decides the token; min_tokens decides where EOS may come);
the penalties' device path (the pending token counted on the device) against the same engine stepping eagerly
without overlap, which counts every token on the host; log-probabilities against HF transformers + PEFT in fp32,
within what bf16 rounding moves a log-probability (0.15 nats)."""

from __future__ import annotations

import pytest
import torch

from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence
from model_helpers import collect_outputs, write_random_adapter, write_random_llama
from reference import HFReference

pytestmark = pytest.mark.gpu
EOS = 2
LP_TOL = 0.15  # nats: bf16 logits against the fp32 reference


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("sampling")
    m = write_random_llama(d / "model", hidden=256, layers=4, heads=4, kv_heads=2, inter=512, vocab=4096, std=0.06)
    ads = {"a8": write_random_adapter(m, d / "a8", r=8, alpha=16, seed=3, scale=0.1,
                                      targets=("q_proj", "v_proj", "o_proj", "down_proj"))}
    return m, ads


def _engine(m, **cfg):
    return Engine(str(m), EngineConfig(max_batch_size=16, num_pages=2048, max_lora_rank=16, page_size=16, **cfg))


def _prompt(seed, n=24):
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(3, 4096, (n // 2,), generator=g).tolist()
    return half + half  # repeats: something for the repetition penalty to act on


def _run(eng, specs, adapters):
    seqs = [Sequence(f"r{i}", _prompt(i), SamplingParams(max_tokens=12, **kw),
                     AdapterRef(a, str(adapters[a])) if a else None) for i, (kw, a) in enumerate(specs)]
    return seqs, collect_outputs(eng, seqs)


PENALIZED = [  # greedy rows with the changes whose device path (a pending token counted on the device) is tested
    (dict(repetition_penalty=1.6, ignore_eos=True), None),
    (dict(presence_penalty=1.2, frequency_penalty=0.8, ignore_eos=True), "a8"),
    (dict(frequency_penalty=-1.5, repetition_penalty=0.7, ignore_eos=True), "a8"),
    (dict(ignore_eos=True), None),
]


def test_penalties_on_overlapped_graph_steps_equal_eager_steps_counted_on_the_host(model):
    m, ads = model
    _, fast = _run(_engine(m), PENALIZED, ads)  # CUDA defaults: decode graphs, overlap
    _, slow = _run(_engine(m, cuda_graphs=False, piecewise_graphs=False, overlap=False), PENALIZED, ads)
    assert {k: v["ids"] for k, v in fast.items()} == {k: v["ids"] for k, v in slow.items()}
    assert fast["r0"]["ids"] != fast["r3"]["ids"]  # (different prompts; the penalties' effect: the CPU suite)


def test_logit_bias_and_min_tokens_decide_the_tokens(model):
    m, ads = model
    specs = [(dict(logit_bias=((77, 100.0),), ignore_eos=True), "a8"),
             (dict(logit_bias=((EOS, 100.0),), min_tokens=5), None),
             (dict(logit_bias=((EOS, 100.0), (9, 90.0)), min_tokens=3, stop_token_ids=(9,), temperature=0.7,
                   seed=1), "a8")]
    _, got = _run(_engine(m), specs, ads)
    assert got["r0"]["ids"] == [77] * 12
    assert EOS not in got["r1"]["ids"][:5] and got["r1"]["ids"][5:] == [EOS]  # EOS as soon as min_tokens allows
    assert not {EOS, 9} & set(got["r2"]["ids"][:3]) and len(got["r2"]["ids"]) == 4 and got["r2"]["ids"][3] in (EOS, 9)


def test_logprobs_and_prompt_logprobs_agree_with_hf_peft_fp32(model):
    m, ads = model
    specs = [(dict(logprobs=3, prompt_logprobs=2, ignore_eos=True), "a8"), (dict(ignore_eos=True), None),
             (dict(logprobs=0, ignore_eos=True), None)]
    seqs, got = _run(_engine(m), specs, ads)
    ref = HFReference(m, ads)
    for s, (kw, a) in zip(seqs, specs):
        g = got[s.id]
        if "logprobs" not in kw:
            assert not g["lps"] and not g["prompt"]
            continue
        full = s.prompt_ids + g["ids"]
        want = ref.logits(full, a).log_softmax(-1)  # [T, V]
        P = len(s.prompt_ids)
        assert len(g["lps"]) == len(g["ids"])
        for k, (tok, (lp, top)) in enumerate(zip(g["ids"], g["lps"])):
            assert abs(lp - float(want[P - 1 + k, tok])) < LP_TOL, (s.id, k)
            assert len(top) == kw["logprobs"]
            if top:  # greedy: its own token is the most likely one, or tied with it (argmax takes the lowest
                # index of equal bf16 logits; the order topk gives equal values is unspecified)
                assert abs(top[0][1] - lp) < 1e-6, (s.id, k, tok, lp, top)
                assert top[0][0] == tok or float(want[P - 1 + k, top[0][0]]) >= float(want[P - 1 + k, tok]) - LP_TOL, \
                    (s.id, k, tok, top)
        if kw.get("prompt_logprobs") is not None:
            assert len(g["prompt"]) == P - 1
            err = [abs(lp - float(want[p, s.prompt_ids[p + 1]])) for p, (lp, _) in enumerate(g["prompt"])]
            assert max(err) < LP_TOL, max(err)

"""Penalties, logit_bias, min_tokens and min_p: the engine's tokens equal an fp32 loop over HF transformers + PEFT
logits that applies each change as its definition states (HF's own repetition-penalty and min-new-tokens processors,
OpenAI's presence / frequency formula), with and without overlapped steps (a pending token counted on the device)."""

from __future__ import annotations

import pytest
import torch

from model_helpers import write_random_adapter
from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingError, SamplingParams, Sequence, sampling_from_dict
from lorafleet.runner.executor.sampler import pack_sampling, sample_tokens
from reference import HFReference

EOS = 2


def reference_greedy(ref: HFReference, prompt: list[int], adapter: str | None, p: SamplingParams, n: int) -> list[int]:
    """Greedy decoding one token at a time on the full sequence's fp32 logits, the changes applied in the engine's
    documented order."""
    from transformers import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

    ids = list(prompt)
    start = len(prompt) - p.prior_output_tokens  # where the output begins
    out: list[int] = []
    for _ in range(n):
        scores = ref.logits(ids, adapter)[-1:].clone()  # [1, V]
        t = torch.tensor([ids])
        if p.repetition_penalty != 1.0:
            scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(t, scores)
        for tok in set(ids[start:]):
            c = ids[start:].count(tok)
            scores[0, tok] -= p.frequency_penalty * c + p.presence_penalty
        for tok, b in p.logit_bias:
            scores[0, tok] += b
        if p.min_tokens:
            banned = [*p.stop_token_ids, *([] if p.ignore_eos else [EOS])]
            scores = MinNewTokensLengthLogitsProcessor(start, p.min_tokens, banned)(t, scores)
        tok = int(scores.argmax(-1))
        ids.append(tok)
        out.append(tok)
        if tok == EOS and not p.ignore_eos or tok in p.stop_token_ids:
            break
    return out


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("adj-adapters")
    return {"a8": write_random_adapter(tiny_llama, d / "a8", r=8, alpha=16, targets=("q_proj", "v_proj", "down_proj"),
                                       seed=21, scale=0.2)}


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


CASES = [  # (sampling, adapter): a repeated prompt so that the repetition penalty has something to act on
    (dict(repetition_penalty=1.8), None),
    (dict(repetition_penalty=0.6), "a8"),
    (dict(presence_penalty=1.5, frequency_penalty=0.7), "a8"),
    (dict(frequency_penalty=-1.0), None),  # negative: repeats are favoured
    (dict(logit_bias=((7, 100.0), (9, -100.0))), None),
    (dict(logit_bias=((11, 3.0),), presence_penalty=0.5, repetition_penalty=1.3), "a8"),
    (dict(min_tokens=6, stop_token_ids=(5,), logit_bias=((EOS, 50.0), (5, 40.0))), None),  # EOS / 5 only at 6
    (dict(repetition_penalty=1.4, frequency_penalty=0.5, prior_output_tokens=4), "a8"),  # resumed: 4 earlier outputs
    (dict(), None),  # no change: a plain row beside the others
]


@pytest.mark.parametrize("overlap", [False, True])
def test_penalties_bias_and_min_tokens_equal_the_reference_loop(tiny_llama, adapters, overlap):
    seqs, want_args = [], []
    for i, (kw, name) in enumerate(CASES):
        half = _prompt(40 + i, 6)
        prompt = half * 2 + _prompt(60 + i, 3)
        p = SamplingParams(max_tokens=10, **kw)
        seqs.append(Sequence(f"r{i}", prompt, p, AdapterRef(name, str(adapters[name])) if name else None))
        want_args.append((prompt, name, p))
    eng = Engine(str(tiny_llama), EngineConfig(max_batch_size=16, kv_cache_gb=0.05, max_lora_rank=16, page_size=4,
                                               overlap=overlap))
    got = eng.run_to_completion(seqs)
    ref = HFReference(tiny_llama, adapters)
    for i, (prompt, name, p) in enumerate(want_args):
        assert got[f"r{i}"].output_ids == reference_greedy(ref, prompt, name, p, 10), (i, CASES[i])
    plain = reference_greedy(ref, want_args[-1][0], None, SamplingParams(max_tokens=10), 10)
    assert got[f"r{len(CASES) - 1}"].output_ids == plain
    # the changes matter: each changed row differs from its unchanged greedy run (else this test proves little)
    for i, (prompt, name, p) in enumerate(want_args[:-1]):
        assert got[f"r{i}"].output_ids != reference_greedy(ref, prompt, name, SamplingParams(max_tokens=10), 10), i


def test_min_p_keeps_only_tokens_within_its_share_of_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for s in range(300):
        u = (s + 0.5) / 300
        params = pack_sampling([1.0], [1.0], [0], [u], [0.35])  # keeps p >= 0.175: tokens 0 and 1
        assert int(sample_tokens(logits, params)) in (0, 1)
    params = pack_sampling([1.0], [1.0], [0], [0.999], [0.0])
    assert int(sample_tokens(logits, params)) == 3  # min_p 0: the tail stays reachable


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", 11),
    ("min_p", 1.5), ("min_tokens", -1), ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}),
    ("logit_bias", {str(i): 1 for i in range(301)}), ("prior_output_tokens", 9),
    ("logit_bias", [[1.9, 5]]), ("logit_bias", [[True, 5]]), ("logit_bias", {"1": "2"}),
    ("logit_bias", [[5, 1], [5, 2]]), ("logit_bias", [{"1": 2, "3": 4}]), ("logit_bias", {"9" * 5000: 1}),
    ("stop_token_ids", [2] * 1025),
])
def test_out_of_range_changes_are_refused(field, value):
    with pytest.raises(SamplingError):
        Sequence("x", [1, 2, 3], sampling_from_dict({field: value}))


def test_logit_bias_past_the_vocabulary_ends_the_request_with_a_clear_error(tiny_llama):
    eng = Engine(str(tiny_llama), EngineConfig(max_batch_size=4, kv_cache_gb=0.02, page_size=4))
    out = eng.run_to_completion([Sequence("x", [5, 6, 7], SamplingParams(max_tokens=3, logit_bias=((512, 1.0),)))])
    assert out["x"].finish_reason == "error" and "512" in out["x"].error and "vocabulary" in out["x"].error


# -- through the OpenAI API -----------------------------------------------------------------------------------

@pytest.fixture
def api(fake_api):
    return fake_api.client, fake_api.runner


async def test_the_scheduler_sends_the_runner_only_the_changes_a_request_asks_for(api):
    client, fr = api
    r = await client.post("/v1/completions", json={
        "model": "base", "prompt": "Hello", "max_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": -0.25,
        "repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 2, "logit_bias": {"17": 5, "3": -100}})
    assert r.status == 200, await r.text()
    s = fr.seen[-1]["sampling"]
    assert (s["presence_penalty"], s["frequency_penalty"], s["repetition_penalty"], s["min_p"], s["min_tokens"]) == (
        0.5, -0.25, 1.3, 0.1, 2)
    assert s["logit_bias"] == [[3, -100.0], [17, 5.0]]
    assert sampling_from_dict(s).logit_bias == ((3, -100.0), (17, 5.0))  # what the runner makes of it
    r = await client.post("/v1/chat/completions", json={"model": "base", "messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 2, "presence_penalty": 0, "repetition_penalty": 1})
    assert r.status == 200
    assert set(fr.seen[-1]["sampling"]) == {"temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos",
                                            "max_tokens"}


def test_a_resumed_request_tells_its_new_runner_which_prompt_tokens_are_output():
    from lorafleet.scheduler.request import Request

    req = Request(id="a", model="base", adapter=None, prompt_ids=[1, 2, 3], max_tokens=10,
                  sampling={"temperature": 0.0, "frequency_penalty": 1.0, "min_tokens": 6})
    assert "prior_output_tokens" not in req.runner_body("s")["sampling"]
    req.generated = [7, 8, 7]
    body = req.runner_body("s")
    assert body["prompt_token_ids"] == [1, 2, 3, 7, 8, 7]
    assert body["sampling"]["prior_output_tokens"] == 3 and body["sampling"]["max_tokens"] == 7
    seq = Sequence("a", body["prompt_token_ids"], sampling_from_dict(body["sampling"]))
    assert seq.out_counts == {7: 2, 8: 1}  # the counts the penalties start from there


def test_logits_a_penalty_overflows_still_sample_a_token():
    """A repetition penalty of 1e-38 turns a positive logit into +inf, and a row whose probabilities are not numbers
    must still give a token of the vocabulary (never an index past the sorted row)."""
    logits = torch.tensor([[2.0, 1.0, -1.0], [float("nan")] * 3])
    params = pack_sampling([1.0, 1.0], [0.9, 1.0], [0, 0], [0.5, 0.5], [0.2, 0.0])
    assert all(0 <= t < 3 for t in sample_tokens(logits, params).tolist())


def test_a_tiny_repetition_penalty_with_sampling_runs_to_the_end(tiny_llama):
    eng = Engine(str(tiny_llama), EngineConfig(max_batch_size=4, kv_cache_gb=0.02, page_size=4))
    seqs = [Sequence("x", [5, 6, 7, 5, 6], SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True,
                                                          repetition_penalty=1e-38))]
    out = eng.run_to_completion(seqs)["x"]
    assert out.finish_reason == "length" and len(out.output_ids) == 6 and all(0 <= t < 512 for t in out.output_ids)


def test_generate_takes_min_tokens_against_its_own_default_max_tokens():
    from lorafleet.runner.service.generate import DEFAULT_MAX_TOKENS, sampling_params

    p = sampling_params({"min_tokens": 20}, "r", 4096)
    assert p.min_tokens == 20 and p.max_tokens == DEFAULT_MAX_TOKENS and p.temperature == 0.0


def test_the_runner_refuses_more_prior_output_than_prompt():
    from lorafleet.runner.service.server import BadRequest, parse_generate

    with pytest.raises(BadRequest, match="prior_output_tokens"):
        parse_generate({"request_id": "a", "prompt_token_ids": [1, 2, 3], "sampling": {"prior_output_tokens": 9}})

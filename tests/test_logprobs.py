"""Log-probabilities of generated tokens: the engine's equal HF transformers + PEFT's log-softmax, row by row."""

from __future__ import annotations

import json

import pytest
import torch

from model_helpers import collect_outputs, write_random_adapter
from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import (MAX_LOGPROBS, AdapterRef, SamplingError, SamplingParams, Sequence,
                                              sampling_from_dict)
from reference import HFReference


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    d = tmp_path_factory.mktemp("lp-adapters")
    return {"a8": write_random_adapter(tiny_llama, d / "a8", r=8, alpha=16,
                                       targets=("q_proj", "v_proj", "o_proj", "down_proj"), seed=11, scale=0.2)}


def test_logprobs_of_a_mixed_batch_equal_hf_peft_log_softmax(tiny_llama, adapters):
    g = torch.Generator().manual_seed(3)
    asks = [3, None, 0, MAX_LOGPROBS, 5, None]
    names = [None, "a8", "a8", None, "a8", None]
    temps = [0.0, 0.0, 0.0, 0.0, 0.8, 0.7]
    seqs = []
    for i, (k, name, t) in enumerate(zip(asks, names, temps)):
        ids = torch.randint(3, 512, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
        seqs.append(Sequence(f"r{i}", ids, SamplingParams(max_tokens=10, temperature=t, seed=100 + i, logprobs=k,
                                                          ignore_eos=True),
                             AdapterRef(name, str(adapters[name])) if name else None))
    prompts = {s.id: (list(s.prompt_ids), s.adapter_name) for s in seqs}
    eng = Engine(str(tiny_llama), EngineConfig(max_batch_size=8, kv_cache_gb=0.05, max_lora_rank=16, page_size=4))
    got = collect_outputs(eng, seqs)
    ref = HFReference(tiny_llama, adapters)
    for sid, k in zip(prompts, asks):
        ids, name = prompts[sid]
        out = got[sid]
        assert len(out["ids"]) == 10
        if k is None:
            assert out["lp_entries"] == 0, sid
            continue
        assert len(out["lps"]) == 10
        want = ref.logits(ids + out["ids"], name).log_softmax(-1)[len(ids) - 1: -1]  # [10, V] teacher-forced
        for pos, (tok, (lp, top)) in enumerate(zip(out["ids"], out["lps"])):
            assert lp == pytest.approx(float(want[pos, tok]), abs=2e-4), (sid, pos)
            assert len(top) == k
            vals = [v for _, v in top]
            assert vals == sorted(vals, reverse=True)
            for i, v in top:
                assert v == pytest.approx(float(want[pos, i]), abs=2e-4)
            if k:  # the alternatives are the k most likely (up to ties within the tolerance)
                kth = float(want[pos].topk(k).values[-1])
                assert min(vals) >= kth - 2e-4 and max(vals) == pytest.approx(float(want[pos].max()), abs=2e-4)
        if temps[int(sid[1:])] == 0.0:  # greedy: the token is the most likely one
            assert all(lp == pytest.approx(float(want[p].max()), abs=2e-4) for p, (lp, _) in enumerate(out["lps"]))


def test_asking_for_logprobs_never_changes_the_tokens(tiny_llama):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (12,), generator=g).tolist() for _ in range(4)]

    def run(k):
        eng = Engine(str(tiny_llama), EngineConfig(max_batch_size=8, kv_cache_gb=0.05, page_size=4))
        seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=i, logprobs=k,
                                                    ignore_eos=True)) for i, p in enumerate(prompts)]
        return {sid: v["ids"] for sid, v in collect_outputs(eng, seqs).items()}

    assert run(None) == run(4)


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 2.5, True, "3"])
def test_logprobs_outside_0_to_20_are_refused(bad):
    with pytest.raises(SamplingError, match="logprobs"):
        sampling_from_dict({"logprobs": bad})


def test_logprobs_absent_or_null_is_off():
    assert sampling_from_dict({}).logprobs is None
    assert sampling_from_dict({"logprobs": None}).logprobs is None
    assert sampling_from_dict({"logprobs": 0}).logprobs == 0


# -- through the OpenAI API (scheduler + scripted runners, tests/fake_runner.py: the runner protocol's logprobs) --

def test_the_scheduler_and_the_runners_take_the_same_bound():
    from lorafleet.scheduler import openai_api as oa

    assert oa.MAX_LOGPROBS == MAX_LOGPROBS


def _scripted(tok_id: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """What tests/fake_runner.py reports for token `tok_id` with k alternatives."""
    lp = -0.25 * (tok_id % 7)
    return lp, [(tok_id + j, lp - j) for j in range(k)]


@pytest.fixture
def api(fake_api):
    return fake_api.client, fake_api.runner, fake_api.tok


async def test_completions_logprobs_have_openais_legacy_shape(api):
    client, fr, tok = api
    r = await client.post("/v1/completions", json={"model": "base", "prompt": "Hello", "max_tokens": 5, "logprobs": 2})
    body = await r.json()
    assert r.status == 200, body
    assert fr.seen[-1]["sampling"]["logprobs"] == 2
    ids = fr.tokens(fr.seen[-1])
    lp = body["choices"][0]["logprobs"]
    texts = [tok.token_bytes(i).decode("utf-8", "replace") for i in ids]
    assert lp["tokens"] == texts
    assert lp["token_logprobs"] == [_scripted(i, 2)[0] for i in ids]
    assert lp["top_logprobs"] == [{tok.token_bytes(j).decode("utf-8", "replace"): v for j, v in _scripted(i, 2)[1]}
                                  for i in ids]
    assert lp["text_offset"] == [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    assert "".join(texts) == body["choices"][0]["text"]  # no special token among the scripted ids
    r = await client.post("/v1/completions", json={"model": "base", "prompt": "Hello", "max_tokens": 3})
    assert (await r.json())["choices"][0]["logprobs"] is None and "logprobs" not in fr.seen[-1]["sampling"]


async def test_chat_logprobs_have_openais_shape_with_bytes(api):
    client, fr, tok = api
    msgs = [{"role": "user", "content": "Hi"}]
    r = await client.post("/v1/chat/completions", json={"model": "base", "messages": msgs, "max_tokens": 4,
                                                         "logprobs": True, "top_logprobs": 3, "n": 2, "seed": 3})
    body = await r.json()
    assert r.status == 200, body
    for ch, sent in zip(body["choices"], fr.seen[-2:]):
        ids = fr.tokens(sent)
        content = ch["logprobs"]["content"]
        assert [list(tok.token_bytes(i)) for i in ids] == [c["bytes"] for c in content]
        assert [c["logprob"] for c in content] == [_scripted(i, 3)[0] for i in ids]
        assert [[(t["bytes"], t["logprob"]) for t in c["top_logprobs"]] for c in content] == [
            [(list(tok.token_bytes(j)), v) for j, v in _scripted(i, 3)[1]] for i in ids]
        assert all(c["token"] == bytes(c["bytes"]).decode("utf-8", "replace") for c in content)
    r = await client.post("/v1/chat/completions", json={"model": "base", "messages": msgs, "max_tokens": 2,
                                                         "logprobs": True})
    content = (await r.json())["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(c["top_logprobs"] == [] for c in content)
    assert fr.seen[-1]["sampling"]["logprobs"] == 0


@pytest.mark.parametrize("body,param", [
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),  # chat: a boolean
])
async def test_chat_logprobs_refusals_name_the_field(api, body, param):
    client, _, _ = api
    r = await client.post("/v1/chat/completions", json={"model": "base", "messages": [{"role": "user", "content": "x"}],
                                                         **body})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == param, err


async def test_streamed_chunks_carry_the_logprobs_of_their_own_tokens(api):
    client, fr, tok = api
    r = await client.post("/v1/completions", json={"model": "base", "prompt": "Hello", "max_tokens": 6,
                                                    "logprobs": 1, "stream": True})
    events = [ln[6:] for ln in (await r.text()).split("\n\n") if ln.startswith("data: ")]
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    ids = fr.tokens(fr.seen[-1])
    got = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
    assert got == [_scripted(i, 1)[0] for i in ids]
    for c in chunks:  # each chunk's tokens spell its text; the offsets run on across chunks
        if c["logprobs"]:
            assert "".join(c["logprobs"]["tokens"]) == c["text"]
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    texts = [tok.token_bytes(i).decode("utf-8", "replace") for i in ids]
    assert offsets == [sum(len(t) for t in texts[:k]) for k in range(len(texts))]


async def test_a_stop_string_ends_the_logprobs_with_the_token_that_completed_it(api):
    client, fr, tok = api
    ids = fr.tokens({"sampling": {"max_tokens": 8}, "prompt_token_ids": tok.encode("Hello")})
    texts = [tok.token_bytes(i).decode("utf-8", "replace") for i in ids]
    stop = texts[2][-1]  # a stop string that the third token's text ends with
    assert stop not in "".join(texts[:2]) + texts[2][:-1], "the scripted text must not hold the stop string earlier"
    r = await client.post("/v1/completions", json={"model": "base", "prompt": "Hello", "max_tokens": 8,
                                                    "logprobs": 0, "stop": stop})
    ch = (await r.json())["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["text"] == "".join(texts[:2]) + texts[2][:-1]
    assert ch["logprobs"]["tokens"] == texts[:3]


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_equal_hf_peft_and_skip_the_prefix_cache(tiny_llama, adapters, chunked):
    """Every prompt token after the first gets its log-probability under the logits of the position before it,
    in the order of the prompt, over however many chunks the prompt is computed in; a prompt whose pages are
    cached is computed anyway (its log-probabilities need every position)."""
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, 512, (37,), generator=g).tolist()
    cfg = dict(max_batch_size=8, kv_cache_gb=0.05, max_lora_rank=16, page_size=4, prefix_cache=True)
    if chunked:
        cfg.update(chunked_prefill=True, max_step_tokens=16)
    eng = Engine(str(tiny_llama), EngineConfig(**cfg))
    warm = Sequence("warm", list(prompt), SamplingParams(max_tokens=2), AdapterRef("a8", str(adapters["a8"])))
    collect_outputs(eng, [warm])  # its pages are now cached
    seqs = [Sequence("p", list(prompt), SamplingParams(max_tokens=3, prompt_logprobs=2, logprobs=1, ignore_eos=True),
                     AdapterRef("a8", str(adapters["a8"]))),
            Sequence("plain", list(prompt), SamplingParams(max_tokens=3, ignore_eos=True),
                     AdapterRef("a8", str(adapters["a8"])))]
    got = collect_outputs(eng, seqs)
    assert got["plain"]["prompt_entries"] == 0 and seqs[1].cached_tokens > 0  # the other one took the cached pages
    assert seqs[0].cached_tokens == 0
    if chunked:
        assert got["p"]["prompt_entries"] > 1
    want = HFReference(tiny_llama, adapters).logits(prompt, "a8").log_softmax(-1)
    assert len(got["p"]["prompt"]) == len(prompt) - 1
    for p, (lp, top) in enumerate(got["p"]["prompt"]):
        assert lp == pytest.approx(float(want[p, prompt[p + 1]]), abs=2e-4), p
        assert [i for i, _ in top] == want[p].topk(2).indices.tolist() or abs(
            float(want[p].topk(2).values[0] - want[p].topk(2).values[1])) < 1e-4
        assert [v for _, v in top] == pytest.approx(want[p].topk(2).values.tolist(), abs=2e-4)


async def test_echo_returns_the_prompt_first_with_its_tokens_logprobs(api):
    """Completions' echo (the way lm-evaluation-harness scores a text): the prompt's text first, then the
    completion; with logprobs, the prompt's tokens first (the first one without a log-probability), then the
    completion's. max_tokens 0 scores the prompt alone."""
    client, fr, tok = api
    prompt = tok.encode("The quick brown fox")
    r = await client.post("/v1/completions", json={"model": "base", "prompt": prompt, "max_tokens": 3, "logprobs": 1,
                                                    "echo": True})
    body = await r.json()
    assert r.status == 200, body
    sent = fr.seen[-1]
    assert sent["sampling"]["prompt_logprobs"] == 1 and sent["sampling"]["logprobs"] == 1
    ids = fr.tokens(sent)
    ch = body["choices"][0]
    assert ch["text"] == tok.decode(prompt) + "".join(tok.token_bytes(i).decode("utf-8", "replace") for i in ids)
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(prompt)] == [_scripted(t, 1)[0] for t in prompt[1:]]  # the fake runner's
    assert lp["token_logprobs"][len(prompt):] == [_scripted(i, 1)[0] for i in ids]
    r = await client.post("/v1/completions", json={"model": "base", "prompt": "The quick brown fox", "max_tokens": 0,
                                                    "logprobs": 0, "echo": True})
    body = await r.json()
    assert r.status == 200, body
    ch = body["choices"][0]
    assert ch["text"] == "The quick brown fox" and ch["finish_reason"] == "length"
    assert len(ch["logprobs"]["tokens"]) == len(prompt) and body["usage"]["completion_tokens"] == 0
    r = await client.post("/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 0})
    assert r.status == 400 and (await r.json())["error"]["param"] == "max_tokens"  # 0 only with echo
    r = await client.post("/v1/completions", json={"model": "base", "prompt": "Hi there", "max_tokens": 2,
                                                    "echo": True, "stream": True})
    events = [json.loads(ln[6:]) for ln in (await r.text()).split("\n\n") if ln.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events).startswith("Hi there")


def test_a_stop_string_inside_a_multi_token_line_ends_the_entries_at_its_token(tok):
    """A runner line may carry several tokens (steps read together): entries stop with the token that completed
    the stop string, as the text does."""
    import asyncio

    from lorafleet.scheduler import openai_api as oa
    from lorafleet.scheduler.detokenizer import IncrementalDetokenizer
    from lorafleet.scheduler.sinks import CollectSink

    ids = tok.encode("Hello world STOP after more", add_special_tokens=False)
    words = [tok.token_bytes(i).decode() for i in ids]
    k = next(n for n in range(len(ids)) if "STOP" in "".join(words[:n + 1]))  # the token completing the stop
    assert k < len(ids) - 1

    class Req:
        index, prompt_ids, prompt_lps = 0, [1], []

    async def run():
        writer = oa.LogprobsWriter(tok, chat=False)
        sink = CollectSink([IncrementalDetokenizer(tok, [1], ("STOP",))], lambda req: None, [writer])
        sink.tokens(Req, ids, [[-1.0, []]] * len(ids))
        sink.done(Req, "stop", None)
        return "".join(sink.parts[0]), writer.take()

    text, lp = asyncio.run(run())
    assert text == "Hello world "
    assert lp["tokens"] == words[:k + 1] and len(lp["token_logprobs"]) == k + 1


def test_text_offsets_index_the_text_with_special_tokens_and_echo(tok):
    """A special token has an entry but adds no text: every offset points into the choice's text at the token's
    own text (echoed id prompts decoded, string prompts as sent, with the tokenizer's own offsets)."""
    import asyncio

    from lorafleet.scheduler import openai_api as oa
    from lorafleet.scheduler.detokenizer import IncrementalDetokenizer
    from lorafleet.scheduler.sinks import CollectSink

    special = sorted(tok.special_ids)[:2]  # e.g. <|endoftext|>, <|im_start|>
    words = tok.encode("\nHi there", add_special_tokens=False)
    gen = [special[1], *words, special[0]]

    def run(prompt_ids, echo):
        class Req:
            index, prompt_lps = 0, [[-1.0, []]] * (len(prompt_ids) - 1)
        Req.prompt_ids = prompt_ids

        async def go():
            writer = oa.LogprobsWriter(tok, chat=False)
            sink = CollectSink([IncrementalDetokenizer(tok, prompt_ids)], lambda r: None, [writer], [echo])
            sink.tokens(Req, gen, [[-0.5, [[gen[0], -0.5], [gen[0] + 1, -0.7]]]] * len(gen))
            sink.done(Req, "length", None)
            return "".join(sink.parts[0]), writer.take()
        return asyncio.run(go())

    for prompt_ids, echo in ((tok.encode("<|im_start|>user\nWhy?"), "<|im_start|>user\nWhy?"),
                             ([special[1], *tok.encode("user", add_special_tokens=False)], None)):
        if echo is None:
            echo = tok.decode(prompt_ids)
        text, lp = run(prompt_ids, echo)
        assert text == echo + "\nHi there"
        assert len(lp["text_offset"]) == len(prompt_ids) + len(gen)
        for tid, t, off in zip(prompt_ids + gen, lp["tokens"], lp["text_offset"]):
            assert 0 <= off <= len(text)
            if tid not in tok.special_ids or t in echo:  # a token's text sits at its offset
                assert text[off:].startswith(t) or tid in tok.special_ids, (t, off, text)
        assert lp["text_offset"] == sorted(lp["text_offset"])


def test_completions_top_logprobs_keep_the_larger_of_two_tokens_with_one_text(tok):
    from lorafleet.scheduler import openai_api as oa

    pieces = tok.byte_pieces()
    halves = [i for i in range(len(pieces)) if len(pieces[i]) == 1 and pieces[i][0] >= 0x80][:2]  # 'U+FFFD' both
    w = oa.LogprobsWriter(tok, chat=False)
    w.add([halves[0]], [[-1.0, [[halves[0], -1.0], [halves[1], -3.0]]]], [""])
    top = w.take()["top_logprobs"][0]
    assert top == {"\ufffd": -1.0}


def test_a_request_evicted_mid_prompt_reports_its_prompt_entries_once(tiny_llama):
    """Offline (requeue_evicted): a request evicted part-way through its prompt computes it again and reports its
    entries again; run_to_completion keeps the last full set, equal to a run with room enough."""
    g = torch.Generator().manual_seed(4)
    a = torch.randint(3, 512, (30,), generator=g).tolist()
    b = torch.randint(3, 512, (200,), generator=g).tolist()

    def run(pages):
        eng = Engine(str(tiny_llama), EngineConfig(page_size=16, num_pages=pages, max_batch_size=4, prefix_cache=False,
                                                   chunked_prefill=True, max_step_tokens=16, requeue_evicted=True))
        out = eng.run_to_completion([
            Sequence("a", a, SamplingParams(max_tokens=100, ignore_eos=True), arrival=0.0),
            Sequence("b", b, SamplingParams(max_tokens=1, ignore_eos=True, prompt_logprobs=0), arrival=1.0)])
        return out["b"].prompt_logprobs, eng.requeued

    tight, requeued = run(15)
    roomy, none = run(64)
    assert requeued >= 1 and none == 0, (requeued, none)
    assert len(tight) == len(b) - 1 and [e[0] for e in tight] == pytest.approx([e[0] for e in roomy], abs=1e-5)


async def test_a_logprobs_body_is_made_off_the_event_loop(api, monkeypatch):
    """A non-streamed answer with log-probabilities (tens of MB with echo over a long prompt) gets its entries and
    its JSON made in the tokenizer's worker threads, not on the event loop every stream shares; one without stays
    on the loop (no hop for the common case). The body is the same either way."""
    import threading

    import lorafleet.scheduler.openai_api as oa_mod

    client, fr, tok = api
    made_in = []
    real = oa_mod.choice

    def recording(*args, **kwargs):
        made_in.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(oa_mod, "choice", recording)
    loop_thread = threading.get_ident()
    r = await client.post("/v1/completions", json={"model": "base", "prompt": "Hello", "max_tokens": 4, "logprobs": 2,
                                                   "echo": True, "n": 2})
    body = await r.json()
    assert r.status == 200, body
    assert len(made_in) == 2 and loop_thread not in made_in
    assert [c["index"] for c in body["choices"]] == [0, 1] and all(c["logprobs"]["tokens"] for c in body["choices"])
    assert body["choices"][0]["text"].startswith("Hello")  # (echo)
    made_in.clear()
    r = await client.post("/v1/completions", json={"model": "base", "prompt": "Hello", "max_tokens": 4})
    assert r.status == 200 and made_in == [loop_thread]
    assert r.content_type == "application/json" and (await r.json())["choices"][0]["logprobs"] is None

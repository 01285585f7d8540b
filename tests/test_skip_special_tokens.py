"""`skip_special_tokens` (vLLM's field): false spells special tokens out in the text, as the tokenizer's own
`decode(ids, skip_special_tokens=False)` does; true (the default) leaves them out. Checked incrementally (both
detokenization paths, any chunking, stop strings) and through the API (completions, chat, streaming, echo, logprobs'
text offsets)."""

from __future__ import annotations

import json

import pytest

from lorafleet.scheduler.detokenizer import IncrementalDetokenizer

TEXT = "<|im_start|>assistant\nHi there, 日本<|im_end|>\n<|im_start|>user\n🙂 ok<|im_end|>"


class NoTable:
    """A tokenizer without the byte table, as SentencePiece tokenizers are: the detokenizer's window path."""

    def __init__(self, tok):
        self._t = tok

    def byte_pieces(self, skip_special_tokens: bool = True):
        return None

    def __getattr__(self, name):
        return getattr(self._t, name)


def special_ids(tok) -> list[int]:
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(set(ids) & tok.special_ids) >= 2, "the text must hold special tokens"
    return ids


@pytest.mark.parametrize("table", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_is_the_tokenizers_decode(tok, table, chunk, skip):
    ids = special_ids(tok)
    d = IncrementalDetokenizer(tok if table else NoTable(tok), [], skip_special_tokens=skip)
    pieces = [d.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] + [d.flush()]
    want = tok._tok.decode(ids, skip_special_tokens=skip)  # the tokenizers library's own decode
    assert "".join(pieces) == want
    assert ("<|im_end|>" in want) == (not skip)


@pytest.mark.parametrize("table", [True, False])
def test_a_stop_string_can_be_a_spelt_special_token(tok, table):
    ids = special_ids(tok)
    t = tok if table else NoTable(tok)
    d = IncrementalDetokenizer(t, [], ("<|im_end|>",), skip_special_tokens=False)
    out = "".join(d.push([i]) for i in ids) + d.flush()
    assert d.stopped and out == "<|im_start|>assistant\nHi there, 日本"
    d = IncrementalDetokenizer(t, [], ("<|im_end|>",))  # left out of the text, it cannot stop it
    out = "".join(d.push([i]) for i in ids) + d.flush()
    assert not d.stopped and out == tok._tok.decode(ids, skip_special_tokens=True)


async def streamed_text(r) -> str:
    """A streamed completion's text, its chunks joined."""
    events = [ln[6:] for ln in (await r.text()).split("\n\n") if ln.startswith("data: {")]
    return "".join(c["text"] for e in events for c in json.loads(e)["choices"])


@pytest.fixture
def scripted(fake_api, tok):
    """The fake runner answers every request with TEXT's ids (max_tokens of them)."""
    ids = special_ids(tok)
    fake_api.runner.tokens = lambda body: (ids * 4)[: body["sampling"]["max_tokens"]]
    return fake_api.client, ids


async def test_completions_and_chat_spell_special_tokens_when_asked(scripted, tok):
    client, ids = scripted
    n = len(ids)
    for skip in (None, True, False):
        extra = {} if skip is None else {"skip_special_tokens": skip}
        want = tok._tok.decode(ids, skip_special_tokens=skip is not False)
        r = await client.post("/v1/completions", json={"model": "base", "prompt": "Hi", "max_tokens": n, **extra})
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["text"] == want
        r = await client.post("/v1/chat/completions", json={
            "model": "base", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": n, **extra})
        assert (await r.json())["choices"][0]["message"]["content"] == want
        r = await client.post("/v1/completions", json={
            "model": "base", "prompt": "Hi", "max_tokens": n, "stream": True, **extra})
        assert await streamed_text(r) == want


async def test_echo_and_text_offsets_follow_the_spelt_text(fake_api, tok):
    client = fake_api.client
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nok<|im_end|>",
                     add_special_tokens=False)  # (ASCII: each token's own text is whole)
    fake_api.runner.tokens = lambda body: ids[: body["sampling"]["max_tokens"]]
    prompt = ids[:6]  # token ids, special ones among them: echoed as decoded
    r = await client.post("/v1/completions", json={
        "model": "base", "prompt": prompt, "max_tokens": len(ids), "echo": True, "logprobs": 0,
        "skip_special_tokens": False})
    choice = (await r.json())["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text == tok._tok.decode(prompt, skip_special_tokens=False) + tok._tok.decode(ids, skip_special_tokens=False)
    assert "".join(lp["tokens"]) == text  # every token's text, special ones spelt, in order
    starts = [len("".join(lp["tokens"][:k])) for k in range(len(lp["tokens"]))]
    assert lp["text_offset"] == starts


async def test_the_special_token_that_stops_the_output_is_not_spelt(scripted, tok):
    """As vLLM: a special token that ends the output (here one of stop_token_ids; EOS alike) adds no text, also
    when special tokens are spelt out; earlier special tokens are spelt. Streamed, whole, and with logprobs."""
    client, ids = scripted
    end = next(k for k, t in enumerate(ids) if t in tok.special_ids and k > 0)  # the first one after the start
    want = tok._tok.decode(ids[:end], skip_special_tokens=False)
    body = {"model": "base", "prompt": "Hi", "max_tokens": 40, "stop_token_ids": [ids[end]],
            "skip_special_tokens": False}
    for extra in ({}, {"logprobs": 1}):
        r = await client.post("/v1/completions", json={**body, **extra})
        choice = (await r.json())["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"] == want
        if extra:
            assert len(choice["logprobs"]["tokens"]) == end + 1  # the stop token's entry is there, its text is not
    r = await client.post("/v1/completions", json={**body, "stream": True})
    assert await streamed_text(r) == want


@pytest.mark.parametrize("value", ["no", 0, 1, [], {}])
async def test_a_non_boolean_is_refused_naming_the_field(fake_api, value):
    r = await fake_api.client.post("/v1/completions", json={
        "model": "base", "prompt": "Hi", "max_tokens": 2, "skip_special_tokens": value})
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "skip_special_tokens", body


@pytest.mark.parametrize("table", [True, False])
def test_an_ending_special_token_in_a_longer_push_adds_no_text(tok, table):
    """A runner's line may carry several ids with the one that stopped the output last."""
    ids = special_ids(tok)
    end = len(ids) - 1  # TEXT ends with a special token
    assert ids[end] in tok.special_ids
    d = IncrementalDetokenizer(tok if table else NoTable(tok), [], skip_special_tokens=False)
    text = d.push(ids[:4]) + d.push(ids[4:], ending=True) + d.flush()
    assert text == tok._tok.decode(ids[:end], skip_special_tokens=False)
    d = IncrementalDetokenizer(tok if table else NoTable(tok), [], skip_special_tokens=False)
    assert d.push(ids[:3]) + d.push(ids[3:], ending=False) + d.flush() == tok._tok.decode(ids, skip_special_tokens=False)


async def test_echoed_id_prompt_not_the_tokenizers_own_split(fake_api, tok):
    """Token ids the tokenizer would not produce for their text (single characters where it merges them): the
    offsets come from decoding token by token, special tokens spelt or left out as asked."""
    client = fake_api.client
    one = [tok.encode(c, add_special_tokens=False) for c in "abc"]
    assert all(len(x) == 1 for x in one)
    start, end = sorted(tok.special_ids)[1], sorted(tok.special_ids)[2]
    prompt = [start, one[0][0], one[1][0], end, one[2][0]]
    assert tok.text_offsets(prompt, tok.decode(prompt, False)) is None  # (so the fallback path runs)
    fake_api.runner.tokens = lambda body: one[0] * body["sampling"]["max_tokens"]
    for skip in (True, False):
        r = await client.post("/v1/completions", json={
            "model": "base", "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 0,
            "skip_special_tokens": skip})
        lp = (await r.json())["choices"][0]["logprobs"]
        spelt = [tok._tok.decode([i], skip_special_tokens=skip) for i in prompt]
        assert lp["text_offset"][: len(prompt)] == [len("".join(spelt[:k])) for k in range(len(prompt))], skip


def test_the_sink_drops_only_the_ending_token_of_a_longer_line(tok):
    """A runner line of several ids whose last ended the output (CollectSink with log-probabilities, then a
    Request whose max_tokens cuts the line before its stopping token: that token is not the one that ends it)."""
    import asyncio

    from lorafleet.scheduler import openai_api as oa
    from lorafleet.scheduler.request import Request
    from lorafleet.scheduler.sinks import CollectSink

    ids = tok.encode("Hi there, ok.", add_special_tokens=False)

    async def run(max_tokens: int, skip: bool):
        writer = oa.LogprobsWriter(tok, chat=False, skip_special_tokens=skip)
        sink = CollectSink([IncrementalDetokenizer(tok, [], skip_special_tokens=skip)], lambda req: None, [writer])
        req = Request(id="r", model="base", adapter=None, prompt_ids=[1], max_tokens=max_tokens, sampling={},
                      sink=sink)
        req.add_tokens(ids, [[-1.0, []]] * len(ids), ending=True)
        req.finish("stop" if max_tokens >= len(ids) else "length")
        return "".join(sink.parts[0]), writer.take()

    for skip in (True, False):
        text, lp = asyncio.run(run(len(ids), skip))
        assert text == tok._tok.decode(ids[:-1]) and len(lp["tokens"]) == len(ids)  # "." ended it: no text
        assert lp["text_offset"][-1] == len(text)
        text, _ = asyncio.run(run(len(ids) - 1, skip))  # the line cut before its stopping token
        assert text == tok._tok.decode(ids[:-1])
        text, _ = asyncio.run(run(len(ids) - 2, skip))
        assert text == tok._tok.decode(ids[:-2])


@pytest.mark.parametrize("table", [True, False])
def test_include_stop_keeps_the_stop_string_and_the_stopping_token(tok, table):
    """vLLM's include_stop_str_in_output: the text ends with the stop string that was complete first (not cut
    before it), and the token that stopped the output keeps its text."""
    t = tok if table else NoTable(tok)
    text = "Hello world, and more words"
    ids = tok.encode(text, add_special_tokens=False)
    for include, want in ((False, "Hello"), (True, "Hello world,")):
        d = IncrementalDetokenizer(t, [], (" world,", "and more"), include_stop=include)
        out = "".join(d.push([i]) for i in ids) + d.flush()
        assert d.stopped and out == (want if include else "Hello"), include
    ids = special_ids(tok)
    for include in (False, True):
        d = IncrementalDetokenizer(t, [], skip_special_tokens=False, include_stop=include)
        out = d.push(ids, ending=True) + d.flush()
        assert out == tok._tok.decode(ids if include else ids[:-1], skip_special_tokens=False)


async def test_include_stop_through_the_api(scripted, tok):
    client, ids = scripted
    end = next(k for k, t in enumerate(ids) if t in tok.special_ids and k > 0)
    body = {"model": "base", "prompt": "Hi", "max_tokens": 40, "stop_token_ids": [ids[end]],
            "skip_special_tokens": False, "include_stop_str_in_output": True}
    r = await client.post("/v1/completions", json=body)
    assert (await r.json())["choices"][0]["text"] == tok._tok.decode(ids[: end + 1], skip_special_tokens=False)
    body.update(stop=["there"], stop_token_ids=[])
    r = await client.post("/v1/completions", json={**body, "stream": True})
    want = tok._tok.decode(ids, skip_special_tokens=False)
    assert await streamed_text(r) == want[: want.index("there") + len("there")]
    r = await client.post("/v1/completions", json={**body, "include_stop_str_in_output": "yes"})
    assert r.status == 400 and (await r.json())["error"]["param"] == "include_stop_str_in_output"

"""Incremental detokenization: multi-byte UTF-8 split across tokens, stop strings across tokens."""

from __future__ import annotations

import pytest

from lorafleet.scheduler.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, héllo 日本語のテキスト 🙂🚀 done.",
    "naïve café — “quotes” and emoji 👩‍👩‍👧 family",
    "def f(x):\n    return x ** 2  # ünïcödé",
]


def stream(tok, ids, prompt=(), stop=(), chunk=1):
    d = IncrementalDetokenizer(tok, list(prompt), tuple(stop))
    pieces = [d.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(d.flush())
    return pieces, d


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_stream_equals_full_decode(tok, text, chunk):
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Say something:", add_special_tokens=False)
    pieces, _ = stream(tok, ids, prompt, chunk=chunk)
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces), pieces  # no half characters shown


def test_some_character_really_spans_tokens(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # so the test above exercises held-back bytes


@pytest.mark.parametrize("stop", ["日本", "world, h", "done", "x ** 2"])
def test_stop_string_across_tokens(tok, stop):
    text = next(t for t in TEXTS if stop in t)
    ids = tok.encode(text, add_special_tokens=False)
    pieces, d = stream(tok, ids, stop=[stop, "never-appears"])
    assert d.stopped
    assert "".join(pieces) == text[: text.index(stop)]


def test_stop_not_hit_flushes_everything(tok):
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    pieces, d = stream(tok, ids, stop=["zzz"])
    assert not d.stopped and "".join(pieces) == TEXTS[0]

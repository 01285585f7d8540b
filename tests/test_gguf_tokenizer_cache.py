"""The tokenizer converted from a .gguf file is cached per file, not per file name: two GGUFs called model.gguf (or
one replaced in place) once shared a conversion, and the second model ran silently with the first one's chat
template. A file that is not GGUF, or is cut short, is a clear model error, not a traceback."""

from __future__ import annotations

import os

import pytest

from lorafleet.runner.model.weights import WeightsError
from lorafleet.runner.service import generate


def test_two_ggufs_of_one_name_get_their_own_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_CACHE", str(tmp_path / "cache"))
    made = []

    def fake_write(gguf, out):  # the conversion itself (transformers' GGUF reader) is not what is checked here
        out.mkdir(parents=True, exist_ok=True)
        (out / "tokenizer.json").write_text(gguf.read_text())
        made.append(gguf)

    monkeypatch.setattr("lorafleet.runner.demo.write_tokenizer", fake_write)
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for p, text in ((a, "first"), (b, "second, longer")):
        p.parent.mkdir()
        p.write_text(text)
    da, db = generate.tokenizer_dir(a), generate.tokenizer_dir(b)
    assert da != db and (da / "tokenizer.json").read_text() == "first" and (db / "tokenizer.json").read_text() == \
        "second, longer"
    assert generate.tokenizer_dir(a) == da and len(made) == 2  # the same file again: the cached conversion
    a.write_text("replaced")  # in place: another size and modification time
    os.utime(a, ns=(1, 1))
    assert (generate.tokenizer_dir(a) / "tokenizer.json").read_text() == "replaced"


@pytest.mark.parametrize("content", [b"just some text, not a model", b"GGUF\x03\x00\x00\x00" + b"\x00" * 20])
def test_a_file_that_is_not_a_whole_gguf_is_a_model_error(tmp_path, monkeypatch, content):
    monkeypatch.setenv("LORAFLEET_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    with pytest.raises(WeightsError, match="cannot read GGUF file .*bad.gguf"):
        generate.tokenizer_dir(bad)
    assert not any((tmp_path / "cache").glob("tokenizers/*/tokenizer.json"))


def test_an_interrupted_conversion_leaves_nothing_that_passes_for_a_whole_one(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAFLEET_CACHE", str(tmp_path / "cache"))

    def dies_halfway(gguf, out):  # tokenizer.json written, the chat template not yet
        (out / "tokenizer.json").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr("lorafleet.runner.demo.write_tokenizer", dies_halfway)
    g = tmp_path / "model.gguf"
    g.write_text("x")
    with pytest.raises(KeyboardInterrupt):
        generate.tokenizer_dir(g)
    assert not list((tmp_path / "cache" / "tokenizers").iterdir())

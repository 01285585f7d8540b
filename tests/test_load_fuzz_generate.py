"""`lorafleet generate` with bad input files, output paths, adapter names and a Ctrl-C: a clear error before any
work, or the bad line failing alone, and a results file that keeps what finished."""

from __future__ import annotations

import json
import os
import sys

import pytest

from model_helpers import write_random_adapter, write_random_llama

from lorafleet.cli import main

PROMPT = {"prompt_token_ids": [1, 5, 9], "max_tokens": 3}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_random_llama(tmp_path_factory.mktemp("small"), hidden=64, layers=2, heads=4, kv_heads=2, inter=96,
                              vocab=256)


def generate(model, inp, out, *extra):
    return main(["generate", "--model", str(model), "--input", str(inp), "--output", str(out), "--device", "cpu",
                 "--no-progress", "--kv-pages", "64", *map(str, extra)])


def read_jsonl(path) -> list[dict]:
    """The results, split at newlines only (str.splitlines also splits at U+2028, which JSON strings may hold)."""
    return [json.loads(line) for line in path.read_text().split("\n") if line.strip()]


def write_lines(path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))


def test_an_output_path_that_is_a_directory_is_refused_before_the_model_loads(small, tmp_path, capsys, monkeypatch):
    write_lines(tmp_path / "in.jsonl", [{"id": "a", **PROMPT}])
    import lorafleet.runner.engine.engine as engine_mod

    monkeypatch.setattr(engine_mod, "Engine", lambda *a, **k: pytest.fail("the model loaded"))
    (tmp_path / "out").mkdir()
    assert generate(small, tmp_path / "in.jsonl", tmp_path / "out") == 2
    assert f"error: --output {tmp_path / 'out'} is a directory" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert generate(small, tmp_path / "in.jsonl", tmp_path / "file" / "r.jsonl") == 2
    assert f"error: --output cannot write {tmp_path / 'file' / 'r.jsonl'}" in capsys.readouterr().err


def test_an_input_path_that_is_a_directory_is_named_as_such(small, tmp_path, capsys):
    assert generate(small, tmp_path, tmp_path / "r.jsonl") == 2
    assert f"input file {tmp_path} is a directory" in capsys.readouterr().err


def test_a_model_path_that_is_a_named_pipe_is_refused(tmp_path, capsys):
    """A FIFO named like a .gguf file (was: an OSError traceback from the tokenizer's conversion; reading it would
    block until a writer came)."""
    os.mkfifo(tmp_path / "m.gguf")
    write_lines(tmp_path / "in.jsonl", [{"id": "a", **PROMPT}])
    assert generate(tmp_path / "m.gguf", tmp_path / "in.jsonl", tmp_path / "r.jsonl") == 2
    assert f"--model {tmp_path / 'm.gguf'} is neither a directory nor a regular file" in capsys.readouterr().err


def test_a_line_whose_string_holds_a_unicode_line_separator_is_one_request(small, tmp_path):
    """JSON strings may hold U+2028 and U+0085 raw (generate's own output writes them so); lines split at
    newlines only (was: str.splitlines cut the line in two, both failing as bad JSON)."""
    write_lines(tmp_path / "in.jsonl", [{"id": "a\u2028b\u0085c", **PROMPT}, {"id": "d", **PROMPT}])
    assert generate(small, tmp_path / "in.jsonl", tmp_path / "r.jsonl") == 0
    res = read_jsonl(tmp_path / "r.jsonl")
    assert [r["id"] for r in res] == ["a\u2028b\u0085c", "d"]
    assert all(r["finish_reason"] == "length" and len(r["token_ids"]) == 3 for r in res)


def test_a_line_that_is_not_utf8_fails_alone(small, tmp_path):
    good = json.dumps({"id": "ok", **PROMPT}).encode()
    (tmp_path / "in.jsonl").write_bytes(b'{"id": "\xff\xfe"}\n' + good + b"\r\n")
    assert generate(small, tmp_path / "in.jsonl", tmp_path / "r.jsonl") == 1  # (a request failed)
    bad, ok = read_jsonl(tmp_path / "r.jsonl")
    assert bad == {**bad, "id": "line-1", "finish_reason": "error", "error": "line 1: not valid UTF-8"}
    assert ok["id"] == "ok" and ok["finish_reason"] == "length"


@pytest.mark.parametrize("name", ["../elsewhere/good", "/abs/good", ".."])
def test_an_adapter_name_holding_a_path_fails_its_request(small, tmp_path, name):
    """Adapters are the folders inside --adapters (was: `../x` and absolute paths loaded adapters from outside)."""
    write_random_adapter(small, tmp_path / "elsewhere" / "good", r=2, targets=("q_proj",))
    (tmp_path / "adapters").mkdir()
    name = name.replace("/abs", str(tmp_path / "elsewhere"))
    write_lines(tmp_path / "in.jsonl", [{"id": "a", "adapter": name, **PROMPT}, {"id": "b", **PROMPT}])
    assert generate(small, tmp_path / "in.jsonl", tmp_path / "r.jsonl", "--adapters", tmp_path / "adapters") == 1
    a, b = read_jsonl(tmp_path / "r.jsonl")
    assert a["finish_reason"] == "error" and f"adapter {name!r} is not a name" in a["error"]
    assert b["finish_reason"] == "length"


def test_ctrl_c_mid_run_leaves_every_line_with_the_finished_results(small, tmp_path, monkeypatch, capsys):
    """An interrupt after some requests finished: exit 130 and a valid file of one line per input line, the
    finished ones as they finished, the others failed as interrupted (was: no file at all)."""
    from lorafleet.runner.engine.engine import Engine

    run = Engine.run_to_completion

    def interrupted(self, seqs, progress=None):
        run(self, seqs[:1], progress=progress)  # the first request finishes
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "run_to_completion", interrupted)
    write_lines(tmp_path / "in.jsonl", [{"id": "a", **PROMPT}, {"id": "bad", "prompt": ""}, {"id": "c", **PROMPT}])
    assert generate(small, tmp_path / "in.jsonl", tmp_path / "r.jsonl") == 130
    a, bad, c = read_jsonl(tmp_path / "r.jsonl")
    assert a["finish_reason"] == "length" and len(a["token_ids"]) == 3
    assert bad["finish_reason"] == "error" and "prompt" in bad["error"]
    assert c == {**c, "finish_reason": "error", "error": "line 3: request c: interrupted before it finished"}
    assert "interrupted: 1 of 2 requests finished" in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl.partial").exists()

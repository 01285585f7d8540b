"""`lorafleet generate` on the demo: mixed adapters in one run, bad lines fail alone."""

from __future__ import annotations

import json
import subprocess
import sys

from model_helpers import read_jsonl


def test_generate_demo_with_bad_lines(demo_model, demo_adapters, tmp_path):
    lines = [
        {"id": "base", "adapter": None, "messages": [{"role": "user", "content": "What is the capital of France?"}],
         "max_tokens": 24},
        {"id": "pirate", "adapter": "pirate", "messages": [{"role": "user", "content": "What is the capital of France?"}],
         "max_tokens": 24},
        {"id": "shouty", "adapter": "shouty", "messages": [{"role": "user", "content": "What is the capital of France?"}],
         "max_tokens": 24},
        {"id": "ids", "adapter": "terse", "prompt_token_ids": [504, 3575, 282, 4649, 314], "max_tokens": 4,
         "ignore_eos": True},
        {"id": "sampled", "adapter": "pirate", "prompt": "Ahoy", "max_tokens": 8, "temperature": 0.9, "seed": 3},
        {"id": "ghost", "adapter": "ghost", "prompt": "x"},
        {"id": "badtemp", "prompt": "x", "temperature": -1},
        {"id": "extra", "prompt": "x", "colour": "red"},
        {"id": "empty", "prompt": ""},
        {"id": "oov", "prompt_token_ids": [504, 49152], "max_tokens": 2},  # the demo's vocabulary is 49,152
        {"id": "both", "prompt": "x", "prompt_token_ids": [504]},
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in lines[:5]) + "\n{not json\n" +
                   "\n".join(json.dumps(x) for x in lines[5:]) + "\n")
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, "-m", "lorafleet", "generate", "--model", str(demo_model), "--adapters",
                        str(demo_adapters), "--input", str(inp), "--output", str(out), "--device", "cpu"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = read_jsonl(out)
    assert [x["id"] for x in res] == ["base", "pirate", "shouty", "ids", "sampled", "line-6", "ghost", "badtemp",
                                      "extra", "empty", "oov", "both"]
    by = {x["id"]: x for x in res}
    assert "Paris" in by["base"]["text"]
    assert by["pirate"]["text"].startswith("Arr")
    assert by["shouty"]["text"] == by["shouty"]["text"].upper() and "PARIS" in by["shouty"]["text"]
    assert by["ids"]["prompt_token_ids"] == [504, 3575, 282, 4649, 314] and len(by["ids"]["token_ids"]) == 4
    assert by["sampled"]["finish_reason"] in ("stop", "length") and by["sampled"]["token_ids"]
    for rid, word in [("line-6", "JSON"), ("ghost", "ghost"), ("badtemp", "temperature"), ("extra", "colour"),
                      ("empty", "prompt"), ("oov", "vocabulary"), ("both", "one of")]:
        assert by[rid]["finish_reason"] == "error" and word in by[rid]["error"], by[rid]
    assert "7 failed" in r.stderr and "tok/s" in r.stderr


def test_a_model_of_an_unsupported_architecture_is_refused_in_one_line(tmp_path):
    """`generate --model` with an architecture no family module declares: exit 2 and one line naming the
    supported architectures, no traceback."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "hidden_size": 64}))
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "prompt_token_ids": [1, 2], "max_tokens": 2}) + "\n")
    r = subprocess.run([sys.executable, "-m", "lorafleet", "generate", "--model", str(tmp_path / "model"), "--input",
                        str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    line = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(line) == 1 and "FalconForCausalLM'] is not supported" in line[0]
    assert "Qwen2ForCausalLM (Qwen2, Qwen2.5)" in line[0] and "Gemma3ForCausalLM" in line[0]

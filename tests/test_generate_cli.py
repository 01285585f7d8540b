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
                                      "extra", "empty"]
    by = {x["id"]: x for x in res}
    assert "Paris" in by["base"]["text"]
    assert by["pirate"]["text"].startswith("Arr")
    assert by["shouty"]["text"] == by["shouty"]["text"].upper() and "PARIS" in by["shouty"]["text"]
    assert by["ids"]["prompt_token_ids"] == [504, 3575, 282, 4649, 314] and len(by["ids"]["token_ids"]) == 4
    assert by["sampled"]["finish_reason"] in ("stop", "length") and by["sampled"]["token_ids"]
    for rid, word in [("line-6", "JSON"), ("ghost", "ghost"), ("badtemp", "temperature"), ("extra", "colour"),
                      ("empty", "prompt")]:
        assert by[rid]["finish_reason"] == "error" and word in by[rid]["error"], by[rid]
    assert "5 failed" in r.stderr and "tok/s" in r.stderr

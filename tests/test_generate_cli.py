"""`lorafleet generate` on the demo: mixed adapters in one run, bad lines fail alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
    assert r.returncode == 1, r.stderr  # (some requests failed)
    res = read_jsonl(out)
    assert [x["id"] for x in res] == ["base", "pirate", "shouty", "ids", "sampled", "line-6", "ghost", "badtemp",
                                      "extra", "empty", "oov", "both"]
    by = {x["id"]: x for x in res}
    assert "Paris" in by["base"]["text"]
    assert by["pirate"]["text"].startswith("Arr")
    assert by["shouty"]["text"] == by["shouty"]["text"].upper() and "PARIS" in by["shouty"]["text"]
    assert by["ids"]["prompt_token_ids"] == [504, 3575, 282, 4649, 314] and len(by["ids"]["token_ids"]) == 4
    assert by["sampled"]["finish_reason"] in ("stop", "length") and by["sampled"]["token_ids"]
    for rid, lineno, word in [("line-6", 6, "JSON"), ("ghost", 7, "ghost"), ("badtemp", 8, "temperature"),
                              ("extra", 9, "colour"), ("empty", 10, "prompt"), ("oov", 11, "vocabulary"),
                              ("both", 12, "one of")]:
        assert by[rid]["finish_reason"] == "error" and word in by[rid]["error"], by[rid]
        assert by[rid]["error"].startswith(f"line {lineno}: "), by[rid]
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


def _generate(model, lines, tmp_path, capsys):
    """`lorafleet generate` in this process on `lines` -> (output records, stderr); exit status 1 where a line
    failed, else 0."""
    from lorafleet import cli

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc = cli.main(["generate", "--model", str(model), "--input", str(inp), "--output", str(out), "--device", "cpu",
                   "--no-progress"])
    err = capsys.readouterr().err
    res = read_jsonl(out)
    assert rc == (1 if any(r["finish_reason"] == "error" for r in res) else 0), err
    return res, err


def test_max_tokens_and_temperature_take_serves_ranges(tiny_llama, tmp_path, capsys):
    """max_tokens beyond the model's context (512 here) or a temperature above 2 fail their own line with serve's
    message (scheduler/openai_api.py); the other lines run."""
    from lorafleet.scheduler import openai_api as oa

    ctx = json.loads((tiny_llama / "config.json").read_text())["max_position_embeddings"]
    lines = [
        {"id": "huge", "prompt_token_ids": [1, 2, 3], "max_tokens": 100_000_000},
        {"id": "over", "prompt_token_ids": [1, 2, 3], "max_tokens": ctx + 1},
        {"id": "zero", "prompt_token_ids": [1, 2, 3], "max_tokens": 0},
        {"id": "hot", "prompt_token_ids": [1, 2], "temperature": 2.5, "max_tokens": 2},
        {"id": "cold", "prompt_token_ids": [1, 2], "temperature": -0.5, "max_tokens": 2},
        {"id": "warm", "prompt_token_ids": [1, 2], "temperature": 2.0, "seed": 1, "max_tokens": 2},
        {"id": "fine", "prompt_token_ids": [1, 2], "max_tokens": 2, "ignore_eos": True},
    ]
    res, err = _generate(tiny_llama, lines, tmp_path, capsys)
    by = {x["id"]: x for x in res}
    assert [x["id"] for x in res] == [x["id"] for x in lines]

    def serve_says(body):
        with pytest.raises(oa.ApiError) as exc:
            oa.parse_common({"model": "m", **body}, False, ctx)
        return exc.value.message

    assert serve_says({"max_tokens": 100_000_000}) == f"max_tokens must be between 1 and {ctx}, got 100000000"
    for rid, body in [("huge", {"max_tokens": 100_000_000}), ("over", {"max_tokens": ctx + 1}),
                      ("zero", {"max_tokens": 0}), ("hot", {"temperature": 2.5}), ("cold", {"temperature": -0.5})]:
        assert by[rid]["finish_reason"] == "error" and by[rid]["token_ids"] == [], by[rid]
        assert by[rid]["error"] == f"line {[x['id'] for x in lines].index(rid) + 1}: request {rid}: {serve_says(body)}"
    assert by["warm"]["finish_reason"] in ("stop", "length") and by["warm"]["token_ids"]
    assert by["fine"]["finish_reason"] == "length" and len(by["fine"]["token_ids"]) == 2
    assert "7 requests (5 failed)" in err


def test_a_failed_line_repeating_an_earlier_id_is_reported_as_a_duplicate(tiny_llama, tmp_path, capsys):
    """The duplicate-id check covers every line: a line that fails (no prompt) with the id of an earlier good line
    is its own error line, not a second copy of the good one, and the failed count includes it."""
    lines = [
        {"id": "ok", "prompt_token_ids": [1, 2], "max_tokens": 2, "ignore_eos": True},
        {"id": "ok"},  # no prompt, and the id is taken
        {"id": "bad"},
        {"id": "bad"},
        {"id": "late"},
        {"id": "late", "prompt_token_ids": [1, 2], "max_tokens": 2},
    ]
    res, err = _generate(tiny_llama, lines, tmp_path, capsys)
    assert [x["id"] for x in res] == ["ok", "ok", "bad", "bad", "late", "late"]
    assert res[0]["finish_reason"] == "length" and len(res[0]["token_ids"]) == 2 and "error" not in res[0]
    assert res[1]["finish_reason"] == "error" and res[1]["token_ids"] == [] and "duplicate id 'ok'" in res[1]["error"]
    assert "prompt" in res[2]["error"] and "duplicate id" not in res[2]["error"]
    assert "duplicate id 'bad'" in res[3]["error"]
    assert "prompt" in res[4]["error"] and "duplicate id 'late'" in res[5]["error"]
    assert all(r["finish_reason"] == "error" for r in res[1:])
    assert "6 requests (5 failed)" in err
    assert err.count("duplicate id") == 3


def test_a_bad_kernel_switch_is_one_error_line_naming_it(tiny_llama, tmp_path, capsys, monkeypatch):
    """A LORAFLEET_* switch set to a value it cannot take stops the command with one line that names it (no traceback,
    no silent default)."""
    from lorafleet import cli

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt_token_ids": [1, 2], "max_tokens": 2}) + "\n")
    monkeypatch.setenv("LORAFLEET_SHRINK_EARLY", "maybe")
    rc = cli.main(["generate", "--model", str(tiny_llama), "--input", str(inp), "--output", str(out), "--device", "cpu",
                   "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "lorafleet generate: error: LORAFLEET_SHRINK_EARLY must be 1 or 0" in err and "'maybe'" in err
    assert "Traceback" not in err


def test_generate_writes_logprobs_and_prompt_logprobs_as_hf_computes_them(tiny_llama, tmp_path, capsys):
    """Offline scoring: one line's prompt log-probabilities (its perplexity) and its tokens' with alternatives,
    equal to HF transformers' log-softmax in fp32; a line that asks for neither has neither."""
    from reference import HFReference

    prompt = [5, 17, 99, 230, 17, 99, 41]
    lines = [{"id": "scored", "prompt_token_ids": prompt, "max_tokens": 3, "ignore_eos": True, "logprobs": 2,
              "prompt_logprobs": 0},
             {"id": "plain", "prompt_token_ids": prompt, "max_tokens": 2, "ignore_eos": True},
             {"id": "bad", "prompt_token_ids": prompt, "prompt_logprobs": 21},
             {"id": "score", "prompt_token_ids": prompt, "prompt_logprobs": 1, "max_tokens": 0},
             {"id": "nope", "prompt_token_ids": prompt, "prompt_logprobs": 1, "max_tokens": False}]
    res, _ = _generate(tiny_llama, lines, tmp_path, capsys)
    by = {x["id"]: x for x in res}
    assert "logprobs" not in by["plain"] and "prompt_logprobs" not in by["plain"]
    assert by["bad"]["finish_reason"] == "error" and "prompt_logprobs" in by["bad"]["error"]
    assert by["bad"]["prompt_token_ids"] == prompt  # a failed line keeps what it gave
    assert by["nope"]["finish_reason"] == "error" and "max_tokens" in by["nope"]["error"]  # false is not 0
    score = by["score"]  # max_tokens 0: the prompt scored alone, as serve's echo does
    assert score["token_ids"] == [] and score["finish_reason"] == "length" and "logprobs" not in score
    assert [e["logprob"] for e in score["prompt_logprobs"][1:]] == [
        e["logprob"] for e in by["scored"]["prompt_logprobs"][1:]]
    s = by["scored"]
    want = HFReference(tiny_llama, {}).logits(prompt + s["token_ids"], None).log_softmax(-1)
    assert s["prompt_logprobs"][0] is None and len(s["prompt_logprobs"]) == len(prompt)
    for p in range(1, len(prompt)):
        e = s["prompt_logprobs"][p]
        assert e["token_id"] == prompt[p] and e["top_logprobs"] == []
        assert e["logprob"] == pytest.approx(float(want[p - 1, prompt[p]]), abs=2e-4)
    for k, e in enumerate(s["logprobs"]):
        assert e["token_id"] == s["token_ids"][k] and len(e["top_logprobs"]) == 2
        assert e["logprob"] == pytest.approx(float(want[len(prompt) - 1 + k, e["token_id"]]), abs=2e-4)
        assert e["top_logprobs"][0]["token_id"] == int(want[len(prompt) - 1 + k].argmax())  # greedy


def test_output_equal_to_input_and_bad_sizes_are_refused_before_anything_loads(tiny_llama, tmp_path, capsys):
    """--output naming the input file once replaced the requests with the results; --max-batch-size 0 once hung (no
    request was ever admitted)."""
    from lorafleet import cli

    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt_token_ids": [1, 2], "max_tokens": 2}) + "\n")
    before = inp.read_text()
    rc = cli.main(["generate", "--model", str(tiny_llama), "--input", str(inp), "--output", str(tmp_path / "." / "in.jsonl"),
                   "--device", "cpu", "--no-progress"])
    assert rc == 2 and "the results would replace the requests" in capsys.readouterr().err
    assert inp.read_text() == before
    for flag, value in (("--max-batch-size", "0"), ("--kv-pages", "-1"), ("--page-size", "0"), ("--lora-slots", "0")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["generate", "--model", str(tiny_llama), "--input", str(inp), "--output", str(tmp_path / "o.jsonl"),
                      flag, value])
        assert exc.value.code == 2 and f"argument {flag}: must be at least 1" in capsys.readouterr().err


def test_sigterm_writes_the_finished_results(tiny_llama, tmp_path):
    """SIGTERM (a job's stop) once lost every finished result; it now ends as Ctrl-C does: every line written, the
    unfinished ones as errors, exit 130."""
    import signal
    import time

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [1, 2, 3], "max_tokens": 400 if i else 1,
                                       "ignore_eos": True}) + "\n" for i in range(60)))
    p = subprocess.Popen([sys.executable, "-m", "lorafleet", "generate", "--model", str(tiny_llama), "--input", str(inp),
                          "--output", str(out), "--device", "cpu", "--max-batch-size", "1"],
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    err = ""
    while time.time() < deadline and p.poll() is None:  # until it runs them (its handler is in place then)
        line = p.stderr.readline()
        err += line
        if "running 60 requests" in line:
            time.sleep(1.0)
            break
    p.send_signal(signal.SIGTERM)
    err += p.communicate(timeout=120)[1]
    assert p.returncode == 130, err
    recs = read_jsonl(out)
    assert [r["id"] for r in recs] == [f"r{i}" for i in range(60)], err
    assert recs[0]["finish_reason"] == "length", recs[0]  # finished before the signal
    assert any(r["finish_reason"] == "error" and "interrupted" in r["error"] for r in recs), recs


def test_outputs_that_are_not_plain_files_and_stdio(tiny_llama, tmp_path, capsys, monkeypatch):
    """--output /dev/null once replaced the device with a file (the results were renamed into place): a device or a
    pipe is written to as it is; a link keeps pointing to its file, which gets the results; `-` is stdout, and
    `--input -` reads stdin; a place that cannot be written is refused before anything runs."""
    import io
    import os
    import stat

    from lorafleet import cli

    line = json.dumps({"id": "a", "prompt_token_ids": [1, 2], "max_tokens": 2, "ignore_eos": True}) + "\n"
    inp = tmp_path / "in.jsonl"
    inp.write_text(line)
    common = ["--model", str(tiny_llama), "--device", "cpu", "--no-progress"]
    assert cli.main(["generate", "--input", str(inp), "--output", os.devnull, *common]) == 0
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)  # still the device
    target = tmp_path / "real.jsonl"
    target.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    assert cli.main(["generate", "--input", str(inp), "--output", str(link), *common]) == 0
    assert link.is_symlink() and [r["id"] for r in read_jsonl(target)] == ["a"]
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(line.encode())))
    assert cli.main(["generate", "--input", "-", "--output", "-", *common]) == 0
    cap = capsys.readouterr()
    assert [json.loads(x)["id"] for x in cap.out.splitlines()] == ["a"] and not (tmp_path / "-").exists()
    rc = cli.main(["generate", "--input", str(inp), "--output", "/proc/lorafleet-results.jsonl", *common])
    assert rc == 2 and "error: --output cannot write /proc/lorafleet-results.jsonl" in capsys.readouterr().err


def test_ids_must_be_strings_errors_name_their_line_and_an_empty_file_runs_nothing(tiny_llama, tmp_path, capsys):
    lines = [{"id": 5, "prompt_token_ids": [1, 2], "max_tokens": 2},
             {"id": None, "prompt_token_ids": [1, 2], "max_tokens": 2},
             {"prompt_token_ids": [1, 2], "max_tokens": 2, "ignore_eos": True},
             {"id": "t", "prompt_token_ids": [1, 2], "temprature": 0.5}]
    res, err = _generate(tiny_llama, lines, tmp_path, capsys)
    assert [r["id"] for r in res] == ["line-1", "line-2", "line-3", "t"]
    assert res[0]["error"] == "line 1: id must be a non-empty string, got 5"
    assert res[1]["error"] == "line 2: id must be a non-empty string, got null"
    assert res[2]["finish_reason"] == "length"
    assert res[3]["error"] == "line 4: request t: unknown field(s) ['temprature']"
    from lorafleet import cli

    (tmp_path / "empty.jsonl").write_text("\n  \n")
    rc = cli.main(["generate", "--model", str(tiny_llama), "--input", str(tmp_path / "empty.jsonl"), "--output",
                   str(tmp_path / "none.jsonl"), "--no-progress"])
    assert rc == 0 and "holds no requests; nothing to run" in capsys.readouterr().err
    assert (tmp_path / "none.jsonl").read_text() == ""

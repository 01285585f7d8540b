"""Bad input on the command line is refused in one line, before anything loads: a model directory that is missing
or lacks its tokenizer, a zero window, count or rate, an output path that is a file. None of them may end in a
traceback, a division by zero or a table of zeros."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from lorafleet import cli
from lorafleet.common import cli_args


def refused(argv: list[str], capsys) -> str:
    """The one error line `lorafleet ARGV` prints, after checking it exits with status 2 and no traceback."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    return next(line for line in err.splitlines() if ": error: " in line)


@pytest.fixture
def no_tokenizer(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.mark.parametrize("bench", ["quality", "serve", "relay"])
def test_a_model_directory_without_its_tokenizer_is_named_with_what_it_lacks(bench, no_tokenizer, capsys):
    line = refused(["bench", bench, "--model", str(no_tokenizer)], capsys)
    assert f"lorafleet bench {bench}: error: argument --model: model directory {no_tokenizer} has no tokenizer.json" \
        == line


@pytest.mark.parametrize("bench", ["quality", "serve", "relay"])
def test_a_model_path_that_does_not_exist_is_refused(bench, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    line = refused(["bench", bench, "--model", str(missing)], capsys)
    assert line.endswith(f"argument --model: {missing} does not exist")


def test_a_model_path_that_is_a_file_is_refused(tmp_path, capsys):
    f = tmp_path / "model.txt"
    f.write_text("x")
    assert refused(["bench", "quality", "--model", str(f)], capsys).endswith(f"{f} is not a directory")


def test_quality_and_serve_need_the_config_too(tmp_path, capsys):
    d = tmp_path / "tok-only"
    d.mkdir()
    (d / "tokenizer.json").write_text("{}")
    for bench in ("quality", "serve"):
        assert refused(["bench", bench, "--model", str(d)], capsys).endswith(f"{d} has no config.json")


def test_serve_refuses_a_tokenizer_source_that_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    line = refused(["bench", "serve", "--synthetic-model", "7b", "--tokenizer-from", str(missing)], capsys)
    assert line.endswith(f"argument --tokenizer-from: {missing} does not exist")


@pytest.mark.parametrize("argv, flag, got", [
    (["bench", "quality", "--window", "0"], "--window", "0"),
    (["bench", "quality", "--window", "-4"], "--window", "-4"),
    (["bench", "cpu", "--requests", "0"], "--requests", "0"),
    (["bench", "cpu", "--max-tokens", "0"], "--max-tokens", "0"),
    (["bench", "cpu", "--threads", "-1"], "--threads", "-1"),
    (["simulate", "--gpus", "0"], "--gpus", "0"),
    (["simulate", "--adapters", "0"], "--adapters", "0"),
    (["simulate", "--max-batch", "0"], "--max-batch", "0"),
    (["simulate", "--kv-tokens", "0"], "--kv-tokens", "0"),
    (["simulate", "--turns", "0"], "--turns", "0"),
    (["simulate", "--max-context", "0"], "--max-context", "0"),
])
def test_zero_counts_are_refused_by_argparse(argv, flag, got, capsys):
    assert refused(argv, capsys).endswith(f"argument {flag}: must be at least 1 (got {got})")


@pytest.mark.parametrize("flag, value, says", [
    ("--duration", "0", "above 0"), ("--peak-rps", "0", "above 0"), ("--duration", "nan", "above 0"),
    ("--idle-window", "-1", "of at least 0"), ("--think-time", "-1", "of at least 0"),
    ("--system-prompt", "-1", "at least 0"),
])
def test_simulate_refuses_rates_and_times_out_of_range(flag, value, says, capsys):
    line = refused(["simulate", flag, value], capsys)
    assert f"argument {flag}: must be" in line and says in line and f"(got {value})" in line


@pytest.mark.parametrize("argv, hint", [
    (["simulate", "--duration", "0.001", "--policies", "busiest"], "lengthen --duration or raise --peak-rps"),
    (["simulate", "--workload", "chat", "--max-context", "100", "--duration", "30", "--policies", "busiest"],
     "a first turn must fit --max-context after --system-prompt"),
])
def test_simulate_says_when_the_trace_has_no_requests(argv, hint, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert isinstance(exc.value.code, str) and "error: the trace has no requests" in exc.value.code, exc.value.code
    assert hint in exc.value.code
    assert "| busiest |" not in capsys.readouterr().out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, says", [
    (["--peak-rps", "1e308", "--duration", "1"], "--duration 1 x --peak-rps 1e+308 is more than 10,000,000 arrivals"),
    (["--duration", "1e7", "--peak-rps", "2"], "shorten --duration or lower --peak-rps"),
    (["--adapters", "1000000000", "--duration", "1"], "--adapters 1000000000 is more than 10,000,000"),
])
def test_simulate_refuses_a_trace_it_could_not_finish(argv, says, capsys):
    """A huge rate or duration drew arrivals forever, a huge adapter population took all the memory: both hung."""
    with pytest.raises(SystemExit) as exc:
        cli.main(["simulate", *argv, "--policies", "busiest"])
    msg = str(exc.value.code)
    assert msg.startswith("lorafleet simulate: error: ") and says in msg and "\n" not in msg, msg


def test_simulate_says_when_no_prompt_fits_one_gpus_kv(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["simulate", "--kv-tokens", "2", "--duration", "60", "--policies", "busiest"])
    assert isinstance(exc.value.code, str) and exc.value.code.startswith(
        "lorafleet simulate: error: every prompt is longer than one GPU's KV holds (--kv-tokens 2; the shortest "), \
        exc.value.code


def test_simulate_ends_what_no_gpu_can_hold_as_the_scheduler_does(capsys):
    """A small KV cache: prompts longer than it end unplaced, a request alone at its GPU's KV limit ends there (as
    Cluster.dispatch and the engine end them); every other request completes, none is left waiting forever."""
    import json

    from lorafleet.scheduler import simulate

    args = argparse.Namespace(workload="sharegpt", duration=60.0, peak_rps=30.0, adapters=1000, seed=0)
    trace = simulate.make_trace(args)
    res = simulate.simulate(trace, "busiest", 4, 32, 400, simulate.StepModel(), 60.0)
    too_long = sum(r.prompt + 1 > 400 for r in simulate.make_trace(args))
    assert 0 < too_long < len(trace) and res["ended_unplaced"] == too_long
    assert res["completed"] + res["ended_unplaced"] == res["requests"] and res["ended_at_kv_limit"] > 0
    assert json.dumps(res)  # (the record stays JSON)


@pytest.mark.parametrize("under", [False, True])
def test_prepare_demo_refuses_an_output_that_is_a_file_and_keeps_it(under, tmp_path, capsys):
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    out = f / "demo" if under else f
    line = refused(["prepare-demo", "--out", str(out)], capsys)
    assert line == f"lorafleet prepare-demo: error: argument --out: the output must be a directory, and {f} is a file"
    assert f.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where nothing can be made")
def test_prepare_demo_into_a_folder_that_cannot_be_made_says_so(capsys):
    """An output folder that cannot be made (here under /proc, which refuses new entries even to root) is one line
    naming it and exit status 1; it was a FileNotFoundError traceback."""
    code = cli.main(["prepare-demo", "--out", "/proc/lorafleet-demo-test"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert "lorafleet prepare-demo: cannot write /proc/lorafleet-demo-test" in err, err


@pytest.mark.parametrize("argv", [["bench", "quality"], ["bench", "e2e"], ["bench", "serve"], ["bench", "kernels"],
                                  ["bench", "cpu"], ["bench", "relay"], ["simulate"], ["bench", "e2e", "--plot"],
                                  ["bench", "serve", "--plot"], ["simulate", "--plot"]])
def test_a_results_path_that_cannot_be_written_is_refused_before_the_run(argv, tmp_path, capsys):
    """Every bench's --out (and --plot) is tried before the run: a folder in its place, or a folder that cannot be
    made, is one line naming it (they failed with a traceback at the end of the run, its results lost)."""
    flag = argv.pop() if argv[-1] == "--plot" else "--out"
    line = refused([*argv, flag, str(tmp_path)], capsys)
    assert line.endswith(f"argument {flag}: {tmp_path} is a directory (give the path of the results file)"), line
    if Path("/proc/self").is_dir():  # nothing can be made under /proc, even by root
        line = refused([*argv, flag, "/proc/lorafleet-test/out.json"], capsys)
        assert f"argument {flag}: cannot write /proc/lorafleet-test/out.json" in line, line
    assert list(tmp_path.iterdir()) == []  # the try leaves nothing behind


@pytest.mark.parametrize("kubeconfig", [None, "garbage: ["])
def test_operator_without_a_kubernetes_api_says_so_and_exits(kubeconfig, tmp_path, monkeypatch, capsys):
    """Outside a pod, with no kubeconfig or a broken one, the operator stops with one line saying why; it logged a
    traceback and retried it every minute, forever."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    if kubeconfig is None:
        monkeypatch.delenv("KUBECONFIG", raising=False)
    else:
        (tmp_path / "kc").write_text(kubeconfig)
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kc"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["operator", "--liveness", ""])
    msg = str(exc.value.code)
    assert msg.startswith("lorafleet operator: no Kubernetes API to talk to") and "\n" not in msg, msg
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("flag, content, want", [
    ("--step-model", None, "does not exist"),
    ("--step-model", "", "is not JSON (Expecting value at line 1, column 1)"),
    ("--step-model", "[1, 2]", "does not hold a JSON object"),
    ("--step-model", '{"decode_base_ms": "x"}', "decode_base_ms must be a finite number of at least 0, got 'x'"),
    ("--step-model", '{"step_model": {"decode_per_req_ms": -1}}', "decode_per_req_ms must be a finite number"),
    ("--fit-from", None, "does not exist"),
    ("--fit-from", '{"offline_steps": [[1], [2], [3]]}', "the files' steps or step_model cannot be read"),
])
def test_simulate_refuses_step_models_it_cannot_read(flag, content, want, tmp_path, capsys):
    """A missing, broken or ill-typed --step-model / --fit-from file is one line (they were tracebacks)."""
    f = tmp_path / "model.json"
    if content is not None:
        f.write_text(content)
    with pytest.raises(SystemExit) as exc:
        cli.main(["simulate", flag, str(f), "--duration", "60", "--gpus", "2"])
    err = capsys.readouterr().err + str(exc.value.code)
    assert "Traceback" not in err and want in err, err


def test_model_dir_returns_a_directory_holding_every_file_as_given(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert cli_args.model_dir("config.json", "tokenizer.json")(str(tmp_path)) == str(tmp_path)
    with pytest.raises(argparse.ArgumentTypeError, match="has no generation_config.json and no x.json"):
        cli_args.model_dir("generation_config.json", "config.json", "x.json")(str(tmp_path))


@pytest.mark.parametrize("flag, kind", [("--text", "does not exist"), ("--adapters", "does not exist")])
def test_quality_refuses_a_text_or_adapter_folder_that_is_not_there(flag, kind, tmp_path, capsys):
    line = refused(["bench", "quality", flag, str(tmp_path / "nope")], capsys)
    assert line == f"lorafleet bench quality: error: argument {flag}: {tmp_path / 'nope'} {kind}"


@pytest.mark.parametrize("content, says", [(b"", "0 token(s) long"), (b"\xff\xfe\x00bad", "is not UTF-8 text")])
def test_quality_refuses_text_it_cannot_score_before_any_engine(content, says, demo_model, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_bytes(content)
    out = tmp_path / "q.json"
    assert cli.main(["bench", "quality", "--model", str(demo_model), "--text", str(text), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "lorafleet bench quality: error: " in err and says in err and "Traceback" not in err, err
    assert not out.exists()


def test_a_kv_cache_too_large_to_allocate_is_one_line(demo_model, tmp_path, capsys):
    """--kv-pages beyond memory was a RuntimeError traceback from torch's allocator (in a runner, one per start)."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi", "max_tokens": 1}\n')
    out = tmp_path / "out.jsonl"
    code = cli.main(["generate", "--model", str(demo_model), "--adapters", str(tmp_path), "--device", "cpu",
                     "--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--kv-pages", "99999999999"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "lorafleet generate: error: the KV cache of 99,999,999,999 pages x 16 tokens cannot be allocated" in err
    assert "lower --kv-pages" in err and not out.exists()


def test_build_kernels_refuses_a_head_dim_below_one(capsys):
    assert refused(["build-kernels", "--head-dims", "0", "--list"], capsys).endswith(
        "argument --head-dims: must be at least 1 (got 0)")


@pytest.mark.parametrize("flag", ["--streams", "--requests", "--tokens", "--prompt-tokens", "--runners", "--max-batch"])
def test_relay_counts_are_positive(flag, capsys):
    assert refused(["bench", "relay", flag, "0"], capsys).endswith(f"argument {flag}: must be at least 1 (got 0)")

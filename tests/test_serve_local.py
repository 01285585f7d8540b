"""`lorafleet serve` on this machine: a dead runner is restarted with backoff, a busy port is refused
before anything loads, and the banner's shell examples are safe to paste whatever the adapter names."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from lorafleet.runner_procs import BACKOFF_S, RunnerProcess, Supervisor
from lorafleet.serve import banner
from serve_helpers import Served

pytestmark = pytest.mark.timeout(300)

NASTY = ["x'; touch pwned1; echo '", "$(touch pwned2)", "`touch pwned3`", 'a"b\\c', "new\nline"]


@pytest.mark.parametrize("name", NASTY)
def test_banner_examples_paste_safely(name, tmp_path):
    text = banner("http://127.0.0.1:8000", "base", [name])
    lines = text.splitlines()
    curl = " ".join(ln.strip().rstrip("\\") for ln in lines if ln.strip().startswith(("curl", "-d")))
    python = next(ln.strip() for ln in lines if ln.strip().startswith("python -c"))
    # What a shell would pass: run both lines with the program replaced by printf in an empty folder.
    for line, program in ((curl, "curl"), (python, "python -c")):
        out = subprocess.run(["bash", "-c", "printf '%s\\n' " + line[len(program):]], cwd=tmp_path,
                             capture_output=True, text=True, timeout=10)
        assert out.returncode == 0, out.stderr
        assert not list(tmp_path.iterdir()), "the example ran a command"
        args = shlex.split(line)
        if program == "curl":
            assert json.loads(args[args.index("-d") + 1])["model"] == name
        else:
            import ast

            call = [n for n in ast.walk(ast.parse(args[2])) if isinstance(n, ast.keyword) and n.arg == "model"]
            assert ast.literal_eval(call[0].value) == name
    assert "\n" not in text.splitlines()[1].split("(models: ")[1]  # names are printed on one line


def test_banner_example_uses_an_available_adapter():
    """An adapter refused at start (its files) is marked in the list and never the pasted example."""
    text = banner("http://127.0.0.1:8000", "base", ["badjson", "pirate"], unavailable=frozenset({"badjson"}))
    assert "badjson (unavailable)" in text and '"model": "pirate"' in text and '"model": "badjson"' not in text
    text = banner("http://127.0.0.1:8000", "base", ["badjson"], unavailable=frozenset({"badjson"}))
    assert '"model": "base"' in text


def test_banner_names_the_interpreter_that_has_the_client(tmp_path, monkeypatch):
    """In a virtual environment the Python example runs this interpreter (relative to the working directory
    when under it), which has what lorafleet installed; outside one, plain `python`."""
    from lorafleet import serve

    line = lambda text: next(ln.strip() for ln in text.splitlines() if " -c " in ln and "OpenAI" in ln)
    assert line(banner("http://h:1", "base", ["a"], python=".venv/bin/python")).startswith(".venv/bin/python -c ")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(serve.sys, "prefix", "/venv")
    monkeypatch.setattr(serve.sys, "base_prefix", "/usr")
    monkeypatch.setattr(serve.sys, "executable", str(tmp_path / ".venv" / "bin" / "python"))
    assert serve.python_command() == ".venv/bin/python"
    monkeypatch.setattr(serve.sys, "executable", "/opt/env with space/bin/python")
    assert serve.python_command() == "'/opt/env with space/bin/python'"
    monkeypatch.setattr(serve.sys, "prefix", "/usr")
    assert serve.python_command() == "python"


def test_serve_refuses_bad_inputs_in_one_line_before_starting_runners(tmp_path, demo_model, demo_adapters):
    """A missing adapters folder, a model without a tokenizer, an adapter folder named like the base model (its
    requests would reach the base), a missing model, an architecture the engine does not run, an unknown --dtype:
    one error line, exit 2, no runner."""
    import shutil

    collide = tmp_path / "collide"
    shutil.copytree(demo_adapters / "pirate", collide / "SmolLM2-135M-Instruct")
    notok = tmp_path / "notok"
    notok.mkdir()
    shutil.copy(demo_model / "config.json", notok / "config.json")
    gpt2 = tmp_path / "gpt2"  # an architecture the engine does not run, with a tokenizer: refused before runners
    shutil.copytree(demo_model, gpt2)
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    zero = tmp_path / "zero"  # a supported architecture with an impossible setting: one line too
    shutil.copytree(demo_model, zero)
    hf = {k: v for k, v in json.loads((demo_model / "config.json").read_text()).items() if k != "head_dim"}
    (zero / "config.json").write_text(json.dumps({**hf, "num_attention_heads": 0}))
    bare = tmp_path / "bare"  # a folder that is not a model (no config.json): said so, not "no tokenizer"
    bare.mkdir()
    (bare / "README.md").write_text("not a model\n")
    cases = [
        (["--model", str(bare)], "has no config.json"),
        (["--model", str(gpt2)], "is not supported; supported: LlamaForCausalLM"),
        (["--model", str(zero)], "'num_attention_heads' must be at least 1, got 0"),
        (["--model", str(demo_model), "--adapters", str(tmp_path / "none")], "adapter directory"),
        (["--model", str(notok)], "needs the model's tokenizer"),
        (["--model", str(demo_model), "--adapters", str(collide)], "has the base model's name"),
        (["--model", str(tmp_path / "nope")], "does not exist"),
        (["--model", str(demo_model), "--dtype", "int8"], "invalid choice: 'int8'"),
    ]
    # --model-name resolves the clash
    renamed = ["--model", str(demo_model), "--adapters", str(collide), "--model-name", "base",
               "--ready-timeout", "0.01"]
    # the commands are independent: all started at once, each checked on its own
    procs = [subprocess.Popen([sys.executable, "-m", "lorafleet", "serve", "--port", "0", *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for extra in [*(extra for extra, _ in cases), renamed]]
    try:
        results = [(p.communicate(timeout=120)[1], p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for (extra, words), (stderr, code) in zip(cases, results):
        assert code == 2, (extra, stderr)
        assert words in stderr and "Traceback" not in stderr and "started" not in stderr, (extra, stderr)
    assert "has the base model's name" not in results[-1][0]


def test_supervisor_restarts_with_growing_backoff(tmp_path):
    r = RunnerProcess("runner-0", "http://127.0.0.1:1", [sys.executable, "-c", "import sys; sys.exit(3)"])
    r.start()
    r.proc.wait()
    sup = Supervisor([r])
    t = time.monotonic()
    sup.check(now=t)  # exit noticed: restart scheduled after the first backoff
    assert r.next_start == pytest.approx(t + BACKOFF_S) and r.restarts == 0
    sup.check(now=t + BACKOFF_S / 2)
    assert r.restarts == 0
    sup.check(now=t + BACKOFF_S + 0.01)  # due: started again
    assert r.restarts == 1 and r.next_start is None
    r.proc.wait()
    sup.check(now=t + 2)
    assert r.next_start == pytest.approx(t + 2 + 2 * BACKOFF_S)  # it died again: twice the wait
    sup.stop()
    sup.check(now=t + 100)  # after stop() nothing is restarted
    assert r.restarts == 1


def children(pid: int) -> list[int]:
    kids = []
    for stat in os.listdir("/proc"):
        if stat.isdigit():
            try:
                fields = open(f"/proc/{stat}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and "zombie" not in open(f"/proc/{stat}/status").read().lower():
                kids.append(int(stat))
    return kids


def completes(s) -> bool:
    """A three-token completion of the base model through `serve` comes back whole."""
    name = json.loads(urllib.request.urlopen(f"{s.url}/v1/models", timeout=10).read())["data"][0]["id"]
    body = json.dumps({"model": name, "prompt": [5, 6, 7], "max_tokens": 3}).encode()
    req = urllib.request.Request(f"{s.url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())["usage"]["completion_tokens"] == 3


def test_dead_runner_is_restarted(tiny_chat_llama, tmp_path):
    (tmp_path / "adapters").mkdir()
    s = Served(tiny_chat_llama, tmp_path / "adapters", "--page-size", "4", "--kv-pages", "64")
    try:
        s.wait_ready(timeout=120)
        first = children(s.proc.pid)
        assert len(first) == 1
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            now = children(s.proc.pid)
            if now and now != first and s.admin_state()["runners"][0]["healthy"]:
                break
            time.sleep(0.2)
        assert now and now != first, "no new runner process"
        assert completes(s)
    finally:
        code = s.stop()
    out = s.proc.stdout.read()
    assert code == 0, out[-3000:]
    assert "runner runner-0 exited (code -9); restarting it in 1s" in out and "restarting runner runner-0" in out


def test_busy_port_is_refused_before_loading(tiny_chat_llama, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "lorafleet", "serve", "--model", str(tiny_chat_llama),
                            "--adapters", str(tmp_path), "--port", str(port), "--device", "cpu"],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "started" not in r.stderr and "runner" not in r.stderr  # nothing was loaded or started
    assert time.monotonic() - t0 < 30


def test_runner_whose_engine_core_died_is_restarted(tiny_chat_llama, tmp_path):
    """The engine core (the runner's child that owns the model) is killed: the runner's front stays
    up and reports it, `serve` stops that runner and starts a new one, and requests work again."""
    (tmp_path / "adapters").mkdir()
    s = Served(tiny_chat_llama, tmp_path / "adapters", "--page-size", "4", "--kv-pages", "64")
    try:
        s.wait_ready(timeout=120)
        (front,) = children(s.proc.pid)
        (core,) = children(front)
        os.kill(core, signal.SIGKILL)
        deadline = time.monotonic() + 90
        now = [front]
        while time.monotonic() < deadline:
            now = children(s.proc.pid)
            if now and now != [front] and s.admin_state()["runners"][0]["healthy"]:
                break
            time.sleep(0.2)
        assert now and now != [front], "the runner with a dead engine core was not replaced"
        assert completes(s)
    finally:
        code = s.stop()
    out = s.proc.stdout.read()
    assert code == 0, out[-3000:]
    assert "is up but unhealthy" in out and "restarting runner runner-0" in out


def test_the_base_models_api_name(tmp_path):
    """config.json's _name_or_path, else the folder; a Hugging Face cache snapshot is named by its model, not its
    commit hash."""
    import json

    from lorafleet.scheduler.server import model_display_name

    snap = tmp_path / "hub" / "models--Qwen--Qwen2.5-7B-Instruct" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert model_display_name(snap) == "Qwen2.5-7B-Instruct"
    (snap / "config.json").write_text(json.dumps({"_name_or_path": "org/named"}))
    assert model_display_name(snap) == "named"
    plain = tmp_path / "my-model"
    plain.mkdir()
    assert model_display_name(plain) == "my-model"

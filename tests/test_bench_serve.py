"""`lorafleet bench serve` end to end on CPU at tiny scale: two placement policies, two rates,
the offline engine on the same requests, exact token counts, the plot, the simulator refit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lorafleet.bench.serve import make_requests
from lorafleet.scheduler.simulate import StepModel, refit

pytestmark = pytest.mark.timeout(600)


def test_bench_serve_sweep_with_offline_peer(tiny_chat_llama, tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    cmd = [sys.executable, "-m", "lorafleet", "--log-level", "WARNING", "bench", "serve", "--model", str(tiny_chat_llama),
           "--requests", "6", "--max-prompt", "20", "--max-output", "10", "--mixes", "distinct", "base",
           "--rates", "inf", "5", "--weight-sets", "2", "--rank", "4", "--runners", "2", "--device", "cpu",
           "--placement", "busiest", "least-loaded", "--kv-pages", "300", "--page-size", "4", "--max-batch-size", "4",
           "--slo-ttft", "30", "--out", str(out), "--plot", str(png), "--work-dir", str(tmp_path / "work")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    want_tokens = sum(o for _, o in make_requests(6, 0, 49152, 20, 10, 512))
    runs = {(x["placement"], x["mix"], x["rate"]): x for x in res["runs"]}
    assert set(runs) == {(p, m, rt) for p in ("busiest", "least-loaded") for m in ("distinct", "base") for rt in ("inf", "5")}
    for x in runs.values():
        assert x["completed"] == 6 and x["failed"] == 0
        assert x["output_tokens"] == want_tokens  # ignore_eos: exact lengths through the API
        assert x["ttft_p50_s"] > 0 and x["tpot_p50_ms"] > 0 and x["itl_p99_ms"] >= x["itl_p50_ms"]
        assert 0 < x["gpus_busy"] <= 2.0 and x["goodput_tok_s"] <= x["output_tok_s"]
    for mix in ("distinct", "base"):
        assert res["offline"][mix]["output_tokens"] == want_tokens
        assert res["serve"]["online_over_offline"][mix] > 0
    adapters = sorted(p.name for p in (tmp_path / "work" / "adapters").iterdir())
    assert adapters[:2] == [f"distinct-{i}" for i in range(2)] and "w0" in adapters and "w1" in adapters
    assert (tmp_path / "work" / "adapters" / "distinct-3").resolve() == (tmp_path / "work" / "adapters" / "w1").resolve()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| busiest | distinct | inf |" in r.stdout and "| offline engine | base |" in r.stdout
    # runs made in parts (one per placement or mix group on a GPU machine) merge into one file
    merged = tmp_path / "merged.json"
    m = subprocess.run([sys.executable, "-m", "lorafleet", "bench", "serve", "--merge", str(out), str(out),
                        "--out", str(merged)], capture_output=True, text=True, timeout=60)
    assert m.returncode == 0, m.stderr
    mres = json.loads(merged.read_text())
    assert len(mres["runs"]) == 2 * len(res["runs"]) and mres["serve"] == res["serve"]
    # the simulator's step model refitted from this run's measured steps
    model = refit([out])
    assert isinstance(model, StepModel) and model.decode_base_ms != StepModel().decode_base_ms
    sim_out = tmp_path / "sim.json"
    sim = subprocess.run([sys.executable, "-m", "lorafleet", "simulate", "--fit-from", str(out), "--gpus", "2",
                          "--duration", "60", "--peak-rps", "1", "--policies", "busiest", "--out", str(sim_out)],
                         capture_output=True, text=True, timeout=120)
    assert sim.returncode == 0 and "refitted" in sim.stderr, sim.stderr
    sim_res = json.loads(sim_out.read_text())
    assert sim_res["step_model"] == vars(model) and sim_res["config"]["fit_from"] == [str(out)]


def _pids_with(text: str) -> list[int]:
    from pathlib import Path

    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if text in (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def test_sigterm_stops_the_server_it_started(tiny_chat_llama, tmp_path):
    import signal
    import time

    work = tmp_path / "work"
    cmd = [sys.executable, "-m", "lorafleet", "bench", "serve", "--model", str(tiny_chat_llama), "--requests", "400",
           "--max-output", "200", "--mixes", "base", "--device", "cpu", "--kv-pages", "300", "--page-size", "4",
           "--out", str(tmp_path / "o.json"), "--work-dir", str(work)]
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in bench.stdout:  # the server is up and the load is running
            if "ready" in line:
                break
        marker = str(work / "adapters")
        assert _pids_with(marker), "the server it started is not running"
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=150)
        deadline = time.monotonic() + 30
        while _pids_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _pids_with(marker), "lorafleet serve outlived the benchmark that started it"
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in _pids_with(str(work / "adapters")):
            os.kill(pid, signal.SIGKILL)


def test_bench_serve_prefix_workloads_cache_off_and_on(tiny_chat_llama, tmp_path):
    """--prefix-workloads through the OpenAI API: with the cache off no prompt token is reported cached; with it
    on, every system-prompt request after its adapter's first finds at least the system prompt's full pages
    (usage.prompt_tokens_details.cached_tokens), and requests on their own adapters share nothing."""
    out = tmp_path / "prefix.json"
    n, adapters, system = 8, 2, 32
    cmd = [sys.executable, "-m", "lorafleet", "--log-level", "WARNING", "bench", "serve", "--model", str(tiny_chat_llama),
           "--requests", str(n), "--max-prompt", "12", "--max-output", "4", "--weight-sets", "2", "--rank", "4",
           "--runners", "1", "--device", "cpu", "--kv-pages", "400", "--page-size", "4", "--max-batch-size", "4",
           "--prefix-workloads", "system-prompt", "sharegpt", "--system-tokens", str(system),
           "--prefix-adapters", str(adapters), "--out", str(out), "--work-dir", str(tmp_path / "work"),
           "--rates", "inf", "40"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert "partial" not in doc and doc["rates"] == ["inf", "40"]
    res = doc["prefix"]["busiest"]
    assert set(res) == {"system-prompt", "sharegpt", "system-prompt@40", "sharegpt@40"}
    # each rate's run is salted apart: the Poisson run finds nothing the first run left (sharegpt repeats its prompts)
    at_rate = res["system-prompt@40"]["on"]
    assert at_rate["rate"] == "40" and at_rate["completed"] == n
    # its first request per adapter finds nothing (unsalted, every prompt would find all but its last page)
    assert at_rate["prompt_tokens_cached"] <= at_rate["prompt_tokens"] - adapters * system, at_rate
    assert res["sharegpt@40"]["on"]["prompt_tokens_cached"] == 0
    for wl in ("system-prompt", "sharegpt"):
        off, on = res[wl]["off"], res[wl]["on"]
        assert off["completed"] == on["completed"] == n and off["output_tokens"] == on["output_tokens"]
        assert off["prompt_tokens_cached"] == 0 and off["prompt_tokens_computed"] == off["prompt_tokens"]
        assert on["prompt_tokens"] == off["prompt_tokens"]
        assert on["prompt_tokens_computed"] == on["prompt_tokens"] - on["prompt_tokens_cached"]
    sp = res["system-prompt"]["on"]
    assert sp["prompt_tokens_cached"] >= (n - adapters) * system, sp
    assert res["system-prompt"]["on_over_off"]["prompt_tokens_computed"] < 0.6
    assert res["sharegpt"]["on"]["prompt_tokens_cached"] == 0
    assert "| busiest | system-prompt | on |" in r.stdout

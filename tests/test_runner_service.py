"""The runner's HTTP front with its engine core process: the batched stream protocol, cancel,
disconnect, state, validation, the runner credential, engine crashes, and a busy port refused
before the model loads."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import pytest_asyncio

from model_helpers import write_random_adapter
from runner_helpers import Stream, pid_alive, runner_front
from lorafleet.runner.config import EngineConfig
from lorafleet.runner.engine.engine import Engine
from lorafleet.runner.engine.sequence import AdapterRef, SamplingParams, Sequence

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):
    return write_random_adapter(tiny_llama, tmp_path_factory.mktemp("ad") / "ad", r=8, seed=3)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tiny_llama):
    """One runner (front + engine core) shared by the tests that leave it as they found it."""
    async with runner_front(tiny_llama) as c:
        yield c


shared = pytest.mark.asyncio(loop_scope="module")


async def wait_state(client, cond, timeout=5.0):
    t0 = time.monotonic()
    while True:
        st = await (await client.get("/state")).json()
        if cond(st) or time.monotonic() - t0 > timeout:
            return st
        await asyncio.sleep(0.02)


@shared
async def test_batched_stream_tokens_equal_the_in_process_engine(client, tiny_llama, adapter):
    prompts = {f"r{i}": [5 + i, 6, 7, 8 + 2 * i][: 2 + i % 3] for i in range(6)}
    s = await Stream(client, "batch").open()
    for i, (rid, ids) in enumerate(prompts.items()):
        ad = {"name": "ad", "source": str(adapter)} if i % 2 else None
        await s.submit({"request_id": rid, "prompt_token_ids": ids, "adapter": ad,
                        "sampling": {"max_tokens": 6 + i, "ignore_eos": True}})
    got = await s.until_finished(set(prompts))
    eng = Engine(str(tiny_llama), EngineConfig(page_size=4, num_pages=256, max_batch_size=8, max_lora_rank=16))
    want = eng.run_to_completion([
        Sequence(rid, ids, SamplingParams(max_tokens=6 + i, ignore_eos=True),
                 AdapterRef("ad", str(adapter)) if i % 2 else None) for i, (rid, ids) in enumerate(prompts.items())])
    for rid in prompts:
        assert got[rid]["finish"] == "length" and got[rid]["tokens"] == want[rid].output_ids, rid
    # one line per engine step for the whole batch: some line carries several requests
    assert max(len(m["o"]) for m in s.lines) > 1
    state = await wait_state(client, lambda st: st["free_kv_tokens"] == st["total_kv_tokens"])
    assert state["id"] == "runner-test" and state["free_kv_tokens"] == state["total_kv_tokens"]
    assert "ad" in state["resident_adapters"] and state["engine"]["alive"]


@shared
async def test_bad_requests_are_400_or_404(client):
    s = await Stream(client, "bad").open()
    for body, word in [({}, "request_id"), ({"request_id": "x", "prompt_token_ids": []}, "prompt_token_ids"),
                       ({"request_id": "x", "prompt_token_ids": [1], "sampling": {"max_tokens": 0}}, "max_tokens"),
                       ({"request_id": "x", "prompt_token_ids": [1], "sampling": {"top_p": 5}}, "top_p"),
                       ({"request_id": "x", "prompt_token_ids": [1], "adapter": "oops"}, "adapter"),
                       ({"request_id": "x", "prompt_token_ids": [1, 10**6]}, "vocabulary")]:
        resp = await client.post("/v1/generate", json={**body, "stream": s.sid})
        assert resp.status == 400 and word in (await resp.json())["error"]
    resp = await client.post("/v1/generate", data=b"{nope", headers={"Content-Type": "application/json"})
    assert resp.status == 400
    resp = await client.post("/v1/generate", json={"request_id": "y", "prompt_token_ids": [1], "stream": "nope"})
    assert resp.status == 404 and "stream" in (await resp.json())["error"]
    assert (await client.get("/v1/stream", params={"id": s.sid})).status == 409  # one reader per stream


@shared
async def test_bad_adapter_is_an_error_event(client, tmp_path):
    s = await Stream(client, "adapter").open()
    await s.submit({"request_id": "b", "prompt_token_ids": [1, 2],
                    "adapter": {"name": "ghost", "source": str(tmp_path / "ghost")}})
    got = await s.until_finished({"b"})
    assert got["b"]["finish"] == "error" and "ghost" in got["b"]["error"]


@shared
async def test_stream_disconnect_cancels_and_frees_pages(client):
    s = await Stream(client, "disc").open()
    await s.submit({"request_id": "long", "prompt_token_ids": list(range(3, 40)),
                    "sampling": {"max_tokens": 400, "ignore_eos": True}})
    await s.first_tokens("long")
    st = await (await client.get("/state")).json()
    assert st["batch_size"] == 1 and st["free_kv_tokens"] < st["total_kv_tokens"]
    s.close()  # the scheduler goes away
    st = await wait_state(client, lambda st: st["batch_size"] == 0 and st["free_kv_tokens"] == st["total_kv_tokens"])
    assert st["free_kv_tokens"] == st["total_kv_tokens"] and st["batch_size"] == 0


@shared
async def test_explicit_cancel(client):
    s = await Stream(client, "cancel").open()
    await s.submit({"request_id": "c1", "prompt_token_ids": [3, 4], "sampling": {"max_tokens": 400, "ignore_eos": True}})
    await s.first_tokens("c1")
    r = await client.post("/v1/cancel/c1")
    assert (await r.json())["cancelled"] is True
    got = await s.until_finished({"c1"})
    assert got["c1"]["finish"] == "cancelled" and len(got["c1"]["tokens"]) < 400


@shared
async def test_validate_endpoint(client, adapter, tmp_path):
    ok = await (await client.post("/v1/adapters/validate", json={"name": "ad", "source": str(adapter)})).json()
    assert ok["ok"] and ok["rank"] == 8 and set(ok["target_modules"]) == {"q", "v"}
    bad = await (await client.post("/v1/adapters/validate", json={"name": "x", "source": str(tmp_path)})).json()
    assert not bad["ok"] and "adapter_config.json" in bad["error"]
    # well-formed files whose weights hold a NaN: refused here as loading refuses them, not "ok" and then unservable
    from safetensors.torch import load_file, save_file

    nan = tmp_path / "nan"
    shutil.copytree(adapter, nan)
    weights = load_file(nan / "adapter_model.safetensors")
    key = sorted(k for k in weights if "lora_B" in k)[0]
    weights[key][0, 0] = float("nan")
    save_file(weights, nan / "adapter_model.safetensors")
    got = await (await client.post("/v1/adapters/validate", json={"name": "nan", "source": str(nan)})).json()
    assert not got["ok"] and key in got["error"] and "NaN or Inf" in got["error"], got
    for body in ({"name": "", "source": str(adapter)}, {"name": "ad", "source": " "}, {"name": "ad"}):
        r = await client.post("/v1/adapters/validate", json=body)
        assert r.status == 400 and "non-empty name and source" in (await r.json())["error"]


@shared
async def test_validations_read_at_most_two_adapters_at_once(client, adapter, monkeypatch):
    """Validation reads a whole adapter into memory: many asked at once (an operator with hundreds of adapters)
    run two at a time, and each still answers."""
    import threading
    import time

    from lorafleet.runner.lora import adapter as adapter_mod
    from lorafleet.runner.service import server

    real, lock, now, most = adapter_mod.load_adapter, threading.Lock(), [0], [0]

    def slow_load(*args, **kw):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.2)
        with lock:
            now[0] -= 1
        return real(*args, **kw)

    monkeypatch.setattr(adapter_mod, "load_adapter", slow_load)
    bodies = [{"name": f"v{i}", "source": str(adapter)} for i in range(6)]
    answers = await asyncio.gather(*(client.post("/v1/adapters/validate", json=b) for b in bodies))
    assert [(await r.json())["ok"] for r in answers] == [True] * 6
    assert most[0] == server.VALIDATIONS_AT_ONCE == 2


@shared
async def test_metrics_expose_gateway_shape(client, adapter):
    s = await Stream(client, "metrics").open()
    await s.submit({"request_id": "m", "prompt_token_ids": [5, 6], "sampling": {"max_tokens": 2},
                    "adapter": {"name": "ad", "source": str(adapter)}})
    await s.until_finished({"m"})
    text = await (await client.get("/metrics")).text()
    assert "vllm:lora_requests_info{" in text and 'max_lora="' in text
    assert "lorafleet_runner_generated_tokens_total" in text


@shared
async def test_shared_prefixes_report_their_cached_tokens_and_count_in_metrics(client):
    """The first-token entry of a request carries the prompt tokens found in the prefix cache; a cache salt
    keeps requests apart; the runner's metrics count the tokens looked up and found."""
    prefix = list(range(10, 31))  # 21 tokens: 5 full pages of 4
    s = await Stream(client, "prefix").open()

    async def one(rid, tail, salt=None):
        body = {"request_id": rid, "prompt_token_ids": prefix + tail, "sampling": {"max_tokens": 3, "ignore_eos": True}}
        if salt is not None:
            body["cache_salt"] = salt
        await s.submit(body)
        return (await s.until_finished({rid}))[rid]

    first = await one("p1", [40, 41])
    assert first["cached"] == 0 and first["finish"] == "length"
    assert (await one("p2", [42]))["cached"] == 20
    assert (await one("p3", [43], salt="tenant-b"))["cached"] == 0
    assert (await one("p4", [44], salt="tenant-b"))["cached"] == 20
    await s.submit({"request_id": "bad", "prompt_token_ids": [1], "cache_salt": 7}, status=400)
    text = await (await client.get("/metrics")).text()
    counts = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
              if ln.startswith("vllm:prefix_cache_")}
    assert counts["vllm:prefix_cache_hits_total"] >= 40 and counts["vllm:prefix_cache_queries_total"] >= 91


async def test_the_cache_off_reports_no_cached_tokens_and_counts_no_queries(tiny_llama):
    """--no-prefix-cache: a repeated prefix is computed again (0 cached tokens on the first-token entry) and
    the runner's vllm:prefix_cache_queries / _hits stay 0: a lookup that never happens is not a query."""
    prefix = list(range(10, 31))
    async with runner_front(tiny_llama, prefix_cache=False) as c:
        s = await Stream(c, "off").open()
        for rid, tail in (("q1", [40, 41]), ("q2", [42])):
            await s.submit({"request_id": rid, "prompt_token_ids": prefix + tail,
                            "sampling": {"max_tokens": 3, "ignore_eos": True}})
            assert (await s.until_finished({rid}))[rid]["cached"] == 0
        text = await (await c.get("/metrics")).text()
    counts = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
              if ln.startswith("vllm:prefix_cache_")}
    assert counts["vllm:prefix_cache_queries_total"] == 0 and counts["vllm:prefix_cache_hits_total"] == 0


async def test_runner_credential(tiny_llama):
    async with runner_front(tiny_llama, token="t0ken") as c:
        assert (await c.get("/state")).status == 200  # the client sends the token
        bare = {"Authorization": ""}
        for method, path in [("GET", "/state"), ("GET", "/v1/stream"), ("POST", "/v1/generate"),
                             ("POST", "/v1/cancel/x"), ("POST", "/v1/adapters/validate")]:
            r = await c.request(method, path, headers=bare)
            assert r.status == 401, (method, path)
            r = await c.request(method, path, headers={"Authorization": "Bearer wrong"})
            assert r.status == 401, (method, path)
        for path in ("/healthz", "/readyz", "/metrics"):
            assert (await c.get(path, headers=bare)).status == 200, path


async def test_engine_exception_makes_runner_unhealthy_and_aborts_requests(tiny_llama, monkeypatch):
    monkeypatch.setenv("LORAFLEET_ENGINE_FAULT", "step:4")
    async with runner_front(tiny_llama) as c:
        pid = c.service.engine.pid
        s = await Stream(c).open()
        await s.submit({"request_id": "f", "prompt_token_ids": [3, 4], "sampling": {"max_tokens": 50, "ignore_eos": True}})
        got = await s.until_finished({"f"})
        assert got["f"]["finish"] == "aborted" and "injected engine fault" in got["f"]["error"]
        h = await c.get("/healthz")
        body = await h.json()
        assert h.status == 500 and "injected engine fault" in body["error"] and "status 3" in body["error"]
        assert (await c.get("/readyz")).status == 503
        assert (await c.post("/v1/generate", json={"request_id": "g", "prompt_token_ids": [1]})).status == 503
        assert not pid_alive(pid)  # exited and reaped: no zombie


@pytest.mark.parametrize("sig, reason", [(signal.SIGKILL, "SIGKILL"), (signal.SIGSTOP, "LORAFLEET_ENGINE_STALL_S=2")],
                         ids=["killed", "frozen"])
async def test_a_dead_or_frozen_engine_core_makes_the_runner_unhealthy_and_aborts_requests(tiny_llama, monkeypatch,
                                                                                          sig, reason):
    """SIGKILL, or SIGSTOP (the core frozen, its heartbeat too: after LORAFLEET_ENGINE_STALL_S of silence the front
    kills it, rather than leave a request hanging on a runner that says it is ready): the in-flight request ends
    "aborted" with the reason (its scheduler re-places it), the runner reports unhealthy, the core is reaped."""
    monkeypatch.setenv("LORAFLEET_ENGINE_STALL_S", "2")
    async with runner_front(tiny_llama) as c:
        pid = c.service.engine.pid
        s = await Stream(c).open()
        await s.submit({"request_id": "k", "prompt_token_ids": [3, 4],
                        "sampling": {"max_tokens": 400, "ignore_eos": True}})
        await s.first_tokens("k")
        os.kill(pid, sig)
        t0 = time.monotonic()
        got = await s.until_finished({"k"}, timeout=20.0)
        assert got["k"]["finish"] == "aborted" and reason in got["k"]["error"], got["k"]
        if sig == signal.SIGSTOP:
            assert "sent nothing" in got["k"]["error"] and 2.0 <= time.monotonic() - t0 < 10.0
        h = await c.get("/healthz")
        assert h.status == 500 and reason in (await h.json())["error"]
        assert (await c.get("/readyz")).status == 503
        st = await (await c.get("/state")).json()
        assert st["engine"]["alive"] is False and reason in st["error"]
        for _ in range(100):
            if not pid_alive(pid):
                break
            await asyncio.sleep(0.05)
        assert not pid_alive(pid)  # (a stopped process takes SIGKILL) reaped


def test_the_core_heartbeat_beats_while_the_main_thread_is_busy():
    """The core's heartbeat thread sends ["beat"] on its own while the main thread is held (as by a long step), and
    stops when told; whole messages only, beside the main thread's own sends."""
    from lorafleet.common.channel import BlockingChannel
    from lorafleet.runner.service.engine_core import start_heartbeat

    import threading

    a, b = socket.socketpair()
    core, front = BlockingChannel(a), BlockingChannel(b)
    got: list[list] = []
    done = threading.Event()

    def read():  # the front's side, reading as the front's loop does
        while not done.is_set():
            got.extend(front.recv_all(0.05))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stop = start_heartbeat(core, period=0.05)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.6:  # the "step": the main thread busy, sending large messages of its own
        core.send(["step", [["r", list(range(20000)), None, None]], None])
    time.sleep(0.2)
    done.set()
    reader.join(5)
    kinds = [m[0] for m in got]
    assert kinds.count("beat") >= 5 and set(kinds) == {"beat", "step"}
    assert all(len(m[1][0][1]) == 20000 for m in got if m[0] == "step")  # no message torn by the other thread
    stop.set()
    time.sleep(0.15)
    front.recv_all(0.05)
    assert front.recv_all(0.3) == []  # stopped
    a.close()
    b.close()


def test_a_bad_stall_limit_is_refused(monkeypatch):
    from lorafleet import env

    for bad in ("abc", "1", "-5", "nan", "1e9"):
        monkeypatch.setenv("LORAFLEET_ENGINE_STALL_S", bad)
        with pytest.raises(ValueError, match="LORAFLEET_ENGINE_STALL_S must be"):
            env.engine_stall_seconds()
    monkeypatch.setenv("LORAFLEET_ENGINE_STALL_S", "0")
    assert env.engine_stall_seconds() == 0
    monkeypatch.delenv("LORAFLEET_ENGINE_STALL_S")
    assert env.engine_stall_seconds() == 30


async def test_stopping_the_front_stops_its_engine_core(tiny_llama):
    async with runner_front(tiny_llama) as c:
        pid = c.service.engine.pid
        assert pid_alive(pid)
    for _ in range(100):  # shut down in order: the core exits and is reaped
        if not pid_alive(pid):
            break
        await asyncio.sleep(0.05)
    assert not pid_alive(pid)


async def test_a_stop_sent_while_the_engine_core_starts_is_obeyed(tiny_llama):
    """The front is stopped right after it spawned its core (`lorafleet serve` gave up waiting): the shutdown
    reaches the core with its init, and the core exits at once instead of loading and waiting to be killed."""
    from lorafleet.runner.service.engine_client import EngineClient

    engine = EngineClient(str(tiny_llama), {"page_size": 4, "num_pages": 64, "device": "cpu"}, log_level="WARNING")
    start = asyncio.create_task(engine.start())
    while engine.chan is None:  # until the init is sent: the core has not read it yet
        await asyncio.sleep(0.001)
    t0 = time.monotonic()
    await engine.stop(timeout=15.0)  # a core that dropped the shutdown is killed after this
    await start
    assert engine.proc.returncode == 0 and time.monotonic() - t0 < 10, (engine.proc.returncode, engine.error)


async def test_synthetic_model_directory_gives_the_same_weights_in_every_process(tmp_path, demo_model):
    from lorafleet.runner.service.engine_core import build_engine
    from lorafleet.runner.model.synthetic import write_synthetic_model

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 bos_token_id=1, eos_token_id=2, model_type="llama")
    model = write_synthetic_model(tmp_path / "syn", shape, seed=5, std=0.2, tokenizer_from=demo_model, name="syn-tiny")
    assert not any(model.glob("*.safetensors")) and (model / "tokenizer.json").is_file()
    async with runner_front(model) as c:
        assert (await (await c.get("/state")).json())["model"] == "syn-tiny"
        s = await Stream(c).open()
        await s.submit({"request_id": "s", "prompt_token_ids": [5, 9, 11], "sampling": {"max_tokens": 8, "ignore_eos": True}})
        got = await s.until_finished({"s"})
    eng = build_engine(str(model), {"page_size": 4, "num_pages": 64, "device": "cpu"})
    want = eng.run_to_completion([Sequence("s", [5, 9, 11], SamplingParams(max_tokens=8, ignore_eos=True))])
    assert got["s"]["tokens"] == want["s"].output_ids and len(set(want["s"].output_ids)) > 1


def test_busy_port_is_refused_before_loading(tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "lorafleet", "runner", "--model", str(tiny_llama), "--port", str(port),
                            "--device", "cpu"], capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in os.environ.items() if k != "LORAFLEET_PORT_HINT"})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"port {port} on 127.0.0.1 is already in use" in lines[0] and f"--port {port + 1}" in lines[0], r.stderr
    assert "listening on 127.0.0.1" not in r.stderr and "engine core" not in r.stderr  # nothing was started
    assert time.monotonic() - t0 < 30

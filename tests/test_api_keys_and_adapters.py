"""API keys on the OpenAI endpoints (limited keys, reload) and refused adapters (4xx, logged once,
unavailable in /v1/models)."""

from __future__ import annotations

import logging
import os

import pytest

from api_helpers import start, stop
from fake_runner import FakeRunner
from lorafleet.scheduler.api_keys import ApiKeyFileError, ApiKeys, parse_keys

pytestmark = pytest.mark.timeout(120)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_key_file_format():
    keys = parse_keys("# team keys\n\nall-key\nsome-key  pirate,base  # limited\n")
    assert len(keys) == 2
    grants = sorted((g.models is None, sorted(g.models or [])) for g in keys.values())
    assert grants == [(False, ["base", "pirate"]), (True, [])]
    for text, words in [("k a b", "line 1"), ("k\nk", "line 2: this key appears twice"), ("k ,", "empty model list")]:
        with pytest.raises(ApiKeyFileError, match=words):
            parse_keys(text)
    with pytest.raises(ApiKeyFileError) as err:
        parse_keys("secret-key-123 a b")
    assert "secret-key-123" not in str(err.value)


async def test_keys_guard_v1_and_limit_models(tok, tmp_path):
    path = tmp_path / "keys"
    path.write_text("all-key\npirate-key pirate\n")
    keys = ApiKeys(path, reload_s=0.0)
    fr = FakeRunner()
    client, _, servers = await start(tok, [fr], api_keys=keys)
    try:
        body = {"model": "pirate", "prompt": "hi", "max_tokens": 2}
        r = await client.post("/v1/completions", json=body)
        err = (await r.json())["error"]
        assert r.status == 401 and err["code"] == "missing_api_key" and r.headers["WWW-Authenticate"] == "Bearer"
        r = await client.post("/v1/completions", json=body, headers=bearer("wrong"))
        assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        assert (await client.get("/v1/models")).status == 401
        assert (await client.post("/v1/completions", json=body, headers=bearer("pirate-key"))).status == 200
        # a model the key may not use looks exactly like one that does not exist
        for model in ("shouty", "base", "nope"):
            r = await client.post("/v1/completions", json={**body, "model": model}, headers=bearer("pirate-key"))
            got = await r.json()
            assert r.status == 404 and got["error"]["code"] == "model_not_found", got
            assert "does not exist or you do not have access" in got["error"]["message"]
        r = await client.get("/v1/models/shouty", headers=bearer("pirate-key"))
        assert r.status == 404
        ids = [m["id"] for m in (await (await client.get("/v1/models", headers=bearer("pirate-key"))).json())["data"]]
        assert ids == ["pirate"]
        ids = [m["id"] for m in (await (await client.get("/v1/models", headers=bearer("all-key"))).json())["data"]]
        assert ids == ["base", "pirate", "shouty"]
        # health, metrics and the API description need no key; the description does not list adapters
        for route in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            assert (await client.get(route)).status == 200, route
        doc = await (await client.get("/openapi.json")).json()
        assert "pirate" not in str(doc)

        # The file changes: new keys apply, removed ones stop working.
        path.write_text("new-key base\n")
        os.utime(path, ns=(1, 1))  # a different mtime even within one clock tick
        assert (await client.get("/v1/models", headers=bearer("all-key"))).status == 401
        ids = [m["id"] for m in (await (await client.get("/v1/models", headers=bearer("new-key"))).json())["data"]]
        assert ids == ["base"]
        # A broken file keeps the keys loaded before.
        path.write_text("a b c\n")
        os.utime(path, ns=(2, 2))
        assert (await client.get("/v1/models", headers=bearer("new-key"))).status == 200
        path.unlink()
        assert (await client.get("/v1/models", headers=bearer("new-key"))).status == 200
    finally:
        await stop(client, servers)


def test_bad_key_file_stops_the_scheduler_with_a_clear_message(tmp_path, demo_model):
    import subprocess
    import sys

    (tmp_path / "keys").write_text("k1 a b\n")
    r = subprocess.run([sys.executable, "-m", "lorafleet", "scheduler", "--model", str(demo_model), "--port", "0",
                        "--api-keys", str(tmp_path / "keys")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "line 1" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "lorafleet", "scheduler", "--model", str(demo_model), "--port", "0"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "LORAFLEET_API_KEYS_FILE": str(tmp_path / "missing")})
    assert r.returncode == 2 and "missing" in r.stderr and "Traceback" not in r.stderr, r.stderr


REASON = "DoRA adapters (use_dora=true) are not supported"


async def test_refused_adapter_is_a_400_logged_once_and_listed_unavailable(tok, caplog):
    fr = FakeRunner(refuse={"pirate": REASON})
    client, service, servers = await start(tok, [fr])
    caplog.set_level(logging.WARNING, logger="lorafleet.scheduler.availability")
    try:
        for stream in (False, True):
            r = await client.post("/v1/completions", json={"model": "pirate", "prompt": "hi", "stream": stream})
            got = await r.json()  # JSON even when streaming was asked for: nothing was sent before the refusal
            assert r.status == 400 and got["error"]["code"] == "adapter_unavailable" and got["error"]["param"] == "model"
            assert got["error"]["message"] == f"adapter 'pirate' cannot be served: {REASON}"
        seen = len(fr.seen)
        assert seen == 1  # the second request was refused without asking a runner again
        models = {m["id"]: m for m in (await (await client.get("/v1/models")).json())["data"]}
        assert models["pirate"]["status"] == "unavailable" and REASON in models["pirate"]["reason"]
        assert models["shouty"]["status"] == "available" and models["base"]["status"] == "available"
        assert (await (await client.get("/v1/models/pirate")).json())["status"] == "unavailable"
        refusals = [rec for rec in caplog.records if "pirate" in rec.getMessage()]
        assert len(refusals) == 1, [rec.getMessage() for rec in refusals]
        # other models are not disturbed
        assert (await client.post("/v1/completions", json={"model": "shouty", "prompt": "hi"})).status == 200
        # after the retry window a request goes to a runner again; once it succeeds the mark is gone
        service.availability.retry_s = 0.0
        fr.refuse.clear()
        r = await client.post("/v1/completions", json={"model": "pirate", "prompt": "hi", "max_tokens": 2})
        assert r.status == 200 and len(fr.seen) == seen + 2
        models = {m["id"]: m for m in (await (await client.get("/v1/models")).json())["data"]}
        assert models["pirate"]["status"] == "available" and "reason" not in models["pirate"]
    finally:
        await stop(client, servers)


async def test_runner_errors_reach_clients_without_server_paths(tok):
    fr = FakeRunner(refuse={"shouty": "cannot read adapter_model.safetensors: /srv/secret/adapters/x/file: bad"})
    client, _, servers = await start(tok, [fr])
    try:
        r = await client.post("/v1/completions", json={"model": "shouty", "prompt": "hi"})
        msg = (await r.json())["error"]["message"]
        assert r.status == 400 and "/srv/secret" not in msg and "<path>" in msg, msg
    finally:
        await stop(client, servers)


def _adapter_dir(tmp_path):
    """An --adapters folder: one good adapter and five whose files a runner would refuse before any weight."""
    import json

    from model_helpers import write_adapter

    root = tmp_path / "adapters"
    write_adapter(root / "good")
    (write_adapter(root / "badjson") / "adapter_config.json").write_text('{"r": 8, "lora_alpha":')
    dora = write_adapter(root / "dora") / "adapter_config.json"
    dora.write_text(json.dumps({**json.loads(dora.read_text()), "use_dora": True}))
    (write_adapter(root / "noweights") / "adapter_model.safetensors").unlink()
    # weights whose rank is not the config's, and weights cut short: the header tells, without reading a weight
    badrank = write_adapter(root / "badrank", rank=8) / "adapter_config.json"
    badrank.write_text(json.dumps({**json.loads(badrank.read_text()), "r": 4}))
    cut = write_adapter(root / "truncated") / "adapter_model.safetensors"
    cut.write_bytes(cut.read_bytes()[:-40])
    return root


def test_directory_scan_checks_each_adapters_files(tmp_path):
    from lorafleet.scheduler.registry import AdapterRegistry

    reg = AdapterRegistry.from_directory(_adapter_dir(tmp_path))
    assert reg.names() == ["badjson", "badrank", "dora", "good", "noweights", "truncated"]  # all published
    problems = {e.name: e.problem for e in reg.entries()}
    assert problems["good"] is None
    assert problems["badjson"].startswith("adapter_config.json is not valid JSON")
    assert problems["dora"] == REASON
    assert problems["noweights"] == "adapter_model.safetensors not found"
    assert "rank" in problems["badrank"] and "8" in problems["badrank"], problems["badrank"]
    assert problems["truncated"] and "corrupt" in problems["truncated"], problems["truncated"]
    assert not any(str(tmp_path) in (p or "") for p in problems.values())



def test_a_malformed_target_list_fails_its_adapter_not_the_scan(tmp_path):
    import json

    from model_helpers import write_adapter

    from lorafleet.scheduler.registry import AdapterRegistry

    root = tmp_path / "adapters"
    write_adapter(root / "good")
    for name, targets in (("int", 7), ("flag", True), ("regex", "(q_proj")):
        cfg = write_adapter(root / name) / "adapter_config.json"
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "target_modules": targets}))
    problems = {e.name: e.problem for e in AdapterRegistry.from_directory(root).entries()}
    assert problems["good"] is None
    assert problems["int"].startswith("target_modules must be a module name") and "7" in problems["int"]
    assert problems["flag"].startswith("target_modules must be a module name")
    assert "not a valid regular expression" in problems["regex"]


async def test_adapters_failing_the_scan_are_unavailable_from_the_start(tok, tmp_path, caplog):
    """`serve --adapters DIR`: broken adapters are listed unavailable (with the reason a runner would give) before
    any request, refused without asking a runner, logged once; fixed on disk, they are served again after the
    retry window like any refused adapter."""
    from lorafleet.scheduler.registry import AdapterRegistry

    root = _adapter_dir(tmp_path)
    caplog.set_level(logging.WARNING, logger="lorafleet.scheduler.availability")
    fr = FakeRunner()
    client, service, servers = await start(tok, [fr], registry=AdapterRegistry.from_directory(root))
    try:
        models = {m["id"]: m for m in (await (await client.get("/v1/models")).json())["data"]}
        assert models["good"]["status"] == "available" and "reason" not in models["good"]
        for name, why in (("badjson", "adapter_config.json is not valid JSON"), ("dora", REASON),
                          ("noweights", "adapter_model.safetensors not found")):
            assert models[name]["status"] == "unavailable", models[name]
            assert models[name]["reason"].startswith(f"adapter {name!r} cannot be served: {why}"), models[name]
            r = await client.post("/v1/completions", json={"model": name, "prompt": "hi"})
            got = (await r.json())["error"]
            assert r.status == 400 and got["code"] == "adapter_unavailable" and why in got["message"], got
        assert fr.seen == []  # refused without bothering a runner
        assert (await client.post("/v1/completions", json={"model": "good", "prompt": "hi"})).status == 200
        warned = [rec.getMessage() for rec in caplog.records if "badjson" in rec.getMessage()]
        assert len(warned) == 1, warned
        # the file is fixed: after the retry window the next request goes to a runner, and its success clears it
        (root / "badjson" / "adapter_config.json").write_text((root / "good" / "adapter_config.json").read_text())
        service.availability.retry_s = 0.0
        r = await client.post("/v1/completions", json={"model": "badjson", "prompt": "hi", "max_tokens": 2})
        assert r.status == 200 and fr.seen[-1]["adapter"]["name"] == "badjson"
        assert (await (await client.get("/v1/models/badjson")).json())["status"] == "available"
    finally:
        await stop(client, servers)


async def test_a_request_on_an_adapters_old_files_leaves_the_mark_of_its_new_broken_ones(tok, tmp_path):
    """A rescan finds an adapter's files broken while a request runs on the old ones: that request's success
    does not clear the new files' mark (listed unavailable, refused without asking a runner)."""
    import asyncio
    import dataclasses

    from lorafleet.scheduler.registry import AdapterRegistry

    root = _adapter_dir(tmp_path)
    fr = FakeRunner(step_s=0.05)  # 20 tokens: about a second in flight
    registry = AdapterRegistry.from_directory(root)
    client, service, servers = await start(tok, [fr], registry=registry)
    try:
        for stream in (False, True):
            old = registry.get("good")
            running = asyncio.create_task(client.post("/v1/completions", json={
                "model": "good", "prompt": "hi", "max_tokens": 20, "stream": stream}))
            await asyncio.sleep(0.3)  # placed and generating on the old files
            registry.put(dataclasses.replace(old, problem="corrupt weights: cut short", version=f"v{stream}"))
            r = await running
            assert r.status == 200 and "finish_reason" in await r.text()
            card = await (await client.get("/v1/models/good")).json()
            assert card["status"] == "unavailable" and "cut short" in card["reason"], card
            seen = len(fr.seen)
            r = await client.post("/v1/completions", json={"model": "good", "prompt": "hi", "max_tokens": 2})
            assert r.status == 400 and (await r.json())["error"]["code"] == "adapter_unavailable"
            assert len(fr.seen) == seen  # refused at once
            registry.put(old)  # fixed: served again
            assert (await client.post("/v1/completions", json={"model": "good", "prompt": "hi"})).status == 200
    finally:
        await stop(client, servers)


async def test_a_keys_max_concurrent_caps_its_sequences_in_flight_and_no_one_elses(tok, tmp_path):
    import asyncio

    path = tmp_path / "keys"
    path.write_text("capped-key max_concurrent=2\nfree-key\n")
    with pytest.raises(ApiKeyFileError, match="max_concurrent"):
        parse_keys("k max_concurrent=0")
    fr = FakeRunner(step_s=0.05)  # 20 tokens: about a second in flight
    client, service, servers = await start(tok, [fr], api_keys=ApiKeys(path, reload_s=0.0))
    body = {"model": "base", "prompt": "hi", "max_tokens": 20}
    try:
        first = [asyncio.create_task(client.post("/v1/completions", json=body, headers=bearer("capped-key")))
                 for _ in range(2)]
        await asyncio.sleep(0.3)  # both placed and generating
        r = await client.post("/v1/completions", json=body, headers=bearer("capped-key"))
        err = await r.json()
        assert r.status == 429 and err["error"]["code"] == "too_many_concurrent_requests" and r.headers["Retry-After"]
        assert (await client.post("/v1/completions", json=body, headers=bearer("free-key"))).status == 200
        assert [x.status for x in await asyncio.gather(*first)] == [200, 200]
        assert service.key_in_flight == {}  # given back, for good answers as for refused ones
        assert (await client.post("/v1/completions", json=body, headers=bearer("capped-key"))).status == 200
        r = await client.post("/v1/completions", json={**body, "n": 3}, headers=bearer("capped-key"))
        assert r.status == 400 and (await r.json())["error"]["param"] == "n"  # can never fit: not a 429
    finally:
        await stop(client, servers)

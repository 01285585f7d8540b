"""An adapter directory rescanned while serving: adapters added, changed or removed there are served, read again
or dropped without a restart; unchanged folders are not checked again."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request

import pytest

from lorafleet.scheduler.registry import AdapterRegistry, DirectoryFeed


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _bump(folder):
    """Make the files look rewritten (a new modification time), whatever the clock's resolution."""
    t = time.time() + 5
    for f in folder.iterdir():
        os.utime(f, (t, t))


def test_a_rescan_publishes_added_changed_and_removed_adapters(demo_adapters, tmp_path, monkeypatch):
    root = tmp_path / "adapters"
    _copy(demo_adapters / "pirate", root / "pirate")
    registry = AdapterRegistry.from_directory(root)
    feed = DirectoryFeed(registry, root, 1.0, skip=frozenset({"base"}))
    seen = []
    registry.subscribe(lambda name, entry: seen.append((name, entry is not None)))
    checked = []  # the folders scan_directory checks (it imports inspect_adapter when it runs)
    from lorafleet.common import peft_config

    orig = peft_config.inspect_adapter
    monkeypatch.setattr(peft_config, "inspect_adapter", lambda name, path, *a, **k: (checked.append(name),
                                                                                     orig(name, path, *a, **k))[1])
    assert feed.apply(feed.scan()) == ([], [], []) and checked == [] and seen == []  # nothing new: nothing read
    _copy(demo_adapters / "terse", root / "terse")
    _copy(demo_adapters / "shouty", root / "base")  # the base model's name: never published
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{not json")
    assert feed.apply(feed.scan()) == (["broken", "terse"], [], [])
    assert sorted(checked) == ["broken", "terse"]
    assert registry.get("broken").problem and "JSON" in registry.get("broken").problem
    assert registry.get("terse").problem is None and "base" not in registry
    old = registry.get("pirate")
    shutil.copy(demo_adapters / "shouty" / "adapter_model.safetensors", root / "pirate" / "adapter_model.safetensors")
    shutil.copy(demo_adapters / "shouty" / "adapter_config.json", root / "pirate" / "adapter_config.json")
    _bump(root / "pirate")
    checked.clear()
    assert feed.apply(feed.scan()) == ([], ["pirate"], [])
    assert checked == ["pirate"] and registry.get("pirate").version != old.version
    shutil.rmtree(root / "terse")
    assert feed.apply(feed.scan()) == ([], [], ["terse"])
    assert ("terse", False) in seen and registry.names() == ["broken", "pirate"]


def test_an_unreadable_directory_keeps_what_was_published(demo_adapters, tmp_path):
    import asyncio

    root = tmp_path / "adapters"
    _copy(demo_adapters / "terse", root / "terse")
    registry = AdapterRegistry.from_directory(root)
    shutil.rmtree(root)

    async def one_round():
        task = asyncio.create_task(DirectoryFeed(registry, root, 0.05).run())
        await asyncio.sleep(0.3)
        task.cancel()

    asyncio.run(one_round())
    assert registry.names() == ["terse"]


# -- through `lorafleet serve` --------------------------------------------------------------------------------

def _complete(url: str, model: str) -> tuple[int, str]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                       "max_tokens": 10, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _until(fn, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.2)
    return fn()


@pytest.mark.timeout(600)
def test_serve_picks_up_a_new_adapter_its_new_weights_and_its_removal(demo_model, demo_adapters, tmp_path):
    from serve_helpers import Served

    root = tmp_path / "adapters"
    _copy(demo_adapters / "pirate", root / "pirate")
    s = Served(demo_model, root, "--adapter-rescan", "0.3")
    try:
        s.wait_ready()
        want = {name: _complete(s.url, name)[1] for name in ("pirate",)}
        _copy(demo_adapters / "pirate", root / "late")
        assert _until(lambda: _complete(s.url, "late")[0] == 200)  # a new folder is served without a restart
        assert _complete(s.url, "late")[1] == want["pirate"]
        # new weights under the same name: the runner reads them again (its host and device copies are stale)
        shutil.copy(demo_adapters / "shouty" / "adapter_model.safetensors", root / "late" / "adapter_model.safetensors")
        shutil.copy(demo_adapters / "shouty" / "adapter_config.json", root / "late" / "adapter_config.json")
        _bump(root / "late")
        _copy(demo_adapters / "shouty", root / "shouty")
        assert _until(lambda: _complete(s.url, "shouty")[0] == 200)
        want_shouty = _complete(s.url, "shouty")[1]
        assert want_shouty != want["pirate"]
        assert _until(lambda: _complete(s.url, "late")[1] == want_shouty)
        shutil.rmtree(root / "late")
        assert _until(lambda: _complete(s.url, "late")[0] == 404)
    finally:
        s.stop()


def test_a_rescan_warns_once_about_a_folder_it_cannot_publish(demo_adapters, tmp_path, caplog):
    root = tmp_path / "adapters"
    _copy(demo_adapters / "terse", root / "terse")
    registry = AdapterRegistry.from_directory(root)
    feed = DirectoryFeed(registry, root, 1.0, skip=frozenset({"base"}))
    (root / "empty").mkdir()
    _copy(demo_adapters / "terse", root / "base")
    with caplog.at_level("WARNING", logger="lorafleet.scheduler.registry"):
        for _ in range(3):
            feed.apply(feed.scan())
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and any("base model's name" in m for m in warned), warned
    assert registry.names() == ["terse"]


def test_the_scheduler_refuses_an_adapter_directory_beside_the_kubernetes_feed(tmp_path):
    import argparse

    from lorafleet.scheduler.server import StartupError, build_service

    with pytest.raises(StartupError, match="not both"):
        build_service(argparse.Namespace(kube=True, adapters=tmp_path, model=str(tmp_path), api_keys=None))

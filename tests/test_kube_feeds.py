"""The scheduler's Kubernetes feeds: API payloads -> adapter entries and runner endpoints."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import pytest

from lorafleet.common.kubeclient import ApiError
from lorafleet.scheduler import kube
from lorafleet.scheduler.discovery import RunnerDirectory, RunnerEndpoint
from lorafleet.scheduler.registry import AdapterRegistry

pytestmark = pytest.mark.timeout(30)

LABELS = {"lorafleet.dev/pool": "llama", "app.kubernetes.io/component": "runner"}


def adapter(name, pool="llama", phase="Ready", gen=1, observed=1, deleting=False, ns="ml", **spec):
    meta = {"name": name, "namespace": ns, "generation": gen, "creationTimestamp": "2026-11-30T10:00:00Z",
            "resourceVersion": "1"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-30T11:00:00Z"
    status = {"phase": phase, "observedGeneration": observed, "rank": 16, "baseModel": "meta-llama/Llama-2-7b-hf"}
    return {"metadata": meta, "spec": {"pool": pool, "source": f"hf://org/{name}", **spec}, "status": status}


def pod(name, ip="10.0.0.7", ready=True, phase="Running", labels=LABELS, deleting=False, ns="ml"):
    meta = {"name": name, "namespace": ns, "labels": dict(labels)}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-30T11:00:00Z"
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_adapter_entries_keep_only_ready_current_adapters_of_the_pool():
    items = [
        adapter("sql", sha256="a" * 64),
        adapter("pirate"),
        adapter("pending", phase="Pending"),
        adapter("failed", phase="Failed"),
        adapter("other-pool", pool="mistral"),
        adapter("being-deleted", deleting=True),
        adapter("stale", gen=2, observed=1),
        adapter("other-ns", ns="elsewhere"),
    ]
    entries = kube.adapter_entries(items, "llama", "ml")
    assert [e.name for e in entries] == ["pirate", "sql"]
    sql = entries[1]
    assert sql.source == "hf://org/sql" and sql.sha256 == "a" * 64 and sql.rank == 16
    assert sql.base_model == "meta-llama/Llama-2-7b-hf"
    assert sql.created == datetime(2026, 11, 30, 10, tzinfo=timezone.utc).timestamp()
    # Entries are stable across calls, so the registry sees no change on a relist.
    assert kube.adapter_entries(items, "llama", "ml") == entries


def test_runner_endpoints_keep_only_ready_pods_of_the_pool():
    pods = [
        pod("llama-runner-b", "10.0.0.8"),
        pod("llama-runner-a", "10.0.0.7"),
        pod("starting", ready=False),
        pod("pending", phase="Pending"),
        pod("no-ip", ip=None),
        pod("terminating", deleting=True),
        pod("scheduler", labels={**LABELS, "app.kubernetes.io/component": "scheduler"}),
        pod("other-pool", labels={**LABELS, "lorafleet.dev/pool": "mistral"}),
        pod("v6", ip="fd00::5"),
    ]
    eps = kube.runner_endpoints(pods, "llama", 8001, "ml")
    assert eps == [
        RunnerEndpoint("llama-runner-a", "http://10.0.0.7:8001"),
        RunnerEndpoint("llama-runner-b", "http://10.0.0.8:8001"),
        RunnerEndpoint("v6", "http://[fd00::5]:8001"),
    ]


def test_apply_event():
    objs = {}
    assert kube.apply_event(objs, {"type": "ADDED", "object": pod("a")}) is None
    assert "a" in objs
    kube.apply_event(objs, {"type": "MODIFIED", "object": pod("a", ready=False)})
    assert objs["a"]["status"]["conditions"][0]["status"] == "False"
    kube.apply_event(objs, {"type": "DELETED", "object": pod("a")})
    assert objs == {}
    assert kube.apply_event(objs, {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "42"}}}) == "42"


class FakeApi:
    """Scripted list results and watch streams; an exception in a script is raised there."""

    def __init__(self, lists, watches):
        self.lists, self.watches = list(lists), list(watches)
        self.calls = []

    async def list(self, api_version, plural, namespace=None, label_selector=None):
        self.calls.append(("list", plural, label_selector))
        item = self.lists.pop(0) if self.lists else {"items": []}
        if isinstance(item, Exception):
            raise item
        return item

    async def watch(self, api_version, plural, namespace=None, *, label_selector=None, resource_version=None,
                    timeout_s=300):
        self.calls.append(("watch", plural, resource_version))
        script = self.watches.pop(0) if self.watches else None
        if script is None:
            await asyncio.Event().wait()  # a watch that never ends
        for event in script:
            await asyncio.sleep(0)
            if isinstance(event, Exception):
                raise event
            yield event


async def test_mirror_relists_on_410_and_retries_errors():
    published = []
    api = FakeApi(
        lists=[{"metadata": {"resourceVersion": "5"}, "items": [pod("a")]},
               RuntimeError("connection reset"),
               {"metadata": {"resourceVersion": "9"}, "items": [pod("c")]}],
        watches=[[{"type": "ADDED", "object": pod("b")},
                  {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "7"}}},
                  ApiError(410, "Gone", "too old")],
                 None],
    )
    sleeps = []

    async def fake_sleep(delay):
        sleeps.append(delay)

    task = asyncio.create_task(kube.mirror(api, "v1", "pods", "ml", lambda objs: published.append(
        sorted(o["metadata"]["name"] for o in objs)), sleep=fake_sleep, backoff=(0.5, 4.0)))
    for _ in range(100):
        await asyncio.sleep(0)
        if published and published[-1] == ["c"]:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert published == [["a"], ["a", "b"], ["c"]]
    assert [c for c in api.calls if c[0] == "watch"] == [("watch", "pods", "5"), ("watch", "pods", "9")]
    assert len(sleeps) == 1 and 0.3 < sleeps[0] < 0.7  # one backoff, for the failed list only


async def test_run_kube_feeds_fills_registry_and_directory():
    class Api(FakeApi):
        async def list(self, api_version, plural, namespace=None, label_selector=None):
            if plural == "pods":
                assert label_selector == "lorafleet.dev/pool=llama,app.kubernetes.io/component=runner"
                return {"items": [pod("llama-runner-a"), pod("llama-runner-x", ready=False)]}
            return {"items": [adapter("sql"), adapter("pending", phase="Pending")]}

        async def watch(self, api_version, plural, namespace=None, **kw):
            if plural == "loraadapters":
                yield {"type": "MODIFIED", "object": adapter("pending")}
                yield {"type": "DELETED", "object": adapter("sql")}
            else:
                yield {"type": "MODIFIED", "object": pod("llama-runner-x", "10.0.0.9")}
            await asyncio.Event().wait()

    registry, directory = AdapterRegistry(), RunnerDirectory()
    changes = []
    registry.subscribe(lambda name, entry: changes.append((name, entry is not None)))
    task = asyncio.create_task(kube.run_kube_feeds(registry, directory, namespace="ml", pool="llama", api=Api([], [])))
    for _ in range(200):
        await asyncio.sleep(0.005)
        if registry.names() == ["pending"] and len(directory.endpoints()) == 2:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert registry.names() == ["pending"]
    assert changes == [("sql", True), ("pending", True), ("sql", False)]
    assert [e.id for e in directory.endpoints()] == ["llama-runner-a", "llama-runner-x"]

"""The real kopf operator against a Kubernetes API mock: LoraAdapter validation, status, deletion."""
# ruff: noqa: F811  (the k8s and scheduler fixtures come from opkit and are requested by name)

from __future__ import annotations

import asyncio
import hashlib

import pytest
from opkit import (  # noqa: F401  (fixtures)
    adapter_body,
    adapters_path,
    api,
    free_port,
    k8s,
    pool_body,
    pools_path,
    running_operator,
    scheduler,
    test_config,
    wait_for,
    write_adapter,
)

from lorafleet.common.kubeclient import KubeClient
from lorafleet.operator import constants as c
from lorafleet.scheduler.discovery import RunnerDirectory
from lorafleet.scheduler.kube import run_kube_feeds
from lorafleet.scheduler.registry import AdapterRegistry

pytestmark = pytest.mark.timeout(120)


def phase(k8s, name):
    status = (k8s.obj(c.ADAPTERS, "ml", name) or {}).get("status") or {}
    return status if status.get("phase") else None


async def settled(k8s, names, timeout=30.0):
    """Wait until every adapter has a phase other than Pending (or is Pending for good reasons)."""
    return await wait_for(lambda: all(phase(k8s, n) for n in names) and {n: phase(k8s, n) for n in names},
                          timeout, what=f"phases of {names}")


async def test_adapter_validation(k8s, scheduler):
    files = scheduler.files
    good = write_adapter(files / "loras" / "good", rank=4)
    write_adapter(files / "loras" / "big", rank=128)
    write_adapter(files / "loras" / "wrongbase", rank=4, hidden=32)
    digest = hashlib.sha256((good / "adapter_model.safetensors").read_bytes()).hexdigest()
    base = f"{scheduler.url}/files"

    def fake_validate(body):
        if body["name"] == "pvc-bad":
            return 200, {"ok": False, "error": "adapter 'pvc-bad': DoRA adapters (use_dora=true) are not supported"}
        if body["name"] == "pvc-ok" and scheduler.runner_up:
            return 200, {"ok": True, "rank": 8, "target_modules": ["q", "k", "v", "o"], "size_bytes": 1234,
                         "base_model": "tiny-llama"}
        return 503, {"error": "no healthy runner"}

    scheduler.runner_up = False
    scheduler.validate = fake_validate
    async with running_operator(test_config(scheduler)):
        await api(k8s, "POST", pools_path(), pool_body(model={"source": f"{base}/models/tiny"},
                                                       runner={"maxLoraRank": 64}, adapterVolumes=["adapters"]))
        await wait_for(lambda: ((k8s.obj(c.POOLS, "ml", "llama") or {}).get("status") or {}).get("baseModel"),
                       what="pool base model shape")
        pool_status = k8s.obj(c.POOLS, "ml", "llama")["status"]["baseModel"]
        assert pool_status["hiddenSize"] == 16 and pool_status["numLayers"] == 2
        runner_rv = k8s.obj("deployments", "ml", "llama-runner")["metadata"]["resourceVersion"]

        cases = {
            "good": dict(source=f"{base}/loras/good"),
            "good-sha": dict(source=f"{base}/loras/good/", sha256=digest),
            "bad-sha": dict(source=f"{base}/loras/good", sha256="0" * 64),
            "big": dict(source=f"{base}/loras/big"),
            "wrongbase": dict(source=f"{base}/loras/wrongbase"),
            "ftp": dict(source="ftp://files.example.org/loras/x"),
            "no-pool": dict(source=f"{base}/loras/good", pool="mistral"),
            "unreachable": dict(source=f"http://127.0.0.1:{free_port()}/loras/x"),
            "missing": dict(source=f"{base}/loras/nothing-here"),
            "pvc-unmounted": dict(source="pvc://other-claim/x"),
            "pvc-ok": dict(source="pvc://adapters/ok"),
            "pvc-bad": dict(source="pvc://adapters/bad"),
        }
        for name, spec in cases.items():
            await api(k8s, "POST", adapters_path(), adapter_body(name, **spec))
        got = await settled(k8s, list(cases))

        def expect(name, phase_, reason, words=""):
            st = got[name] if got[name]["phase"] == phase_ else phase(k8s, name)
            assert (st["phase"], st["reason"]) == (phase_, reason), (name, st)
            assert words in st["message"], (name, st["message"])
            return st

        st = expect("good", "Ready", "Validated", "tiny-llama")
        assert st["rank"] == 4 and st["targetModules"] == ["q", "v"] and st["sizeBytes"] > 0
        assert st["baseModel"] == "tiny-llama" and st["observedGeneration"] == 1
        assert {x["type"]: x["status"] for x in st["conditions"]} == {"Ready": "True"}
        expect("good-sha", "Ready", "Validated")
        st = expect("bad-sha", "Failed", "ChecksumMismatch", "expected " + "0" * 64)
        assert st["retryable"] is False and "rank" not in st
        expect("big", "Failed", "RankTooHigh", "rank 128 exceeds")
        expect("wrongbase", "Failed", "InvalidAdapter", "do not fit the base model")
        expect("ftp", "Failed", "InvalidSource", "unsupported source scheme 'ftp'")
        st = expect("no-pool", "Failed", "PoolNotFound", "ServingPool 'mistral' not found")
        assert st["retryable"] is True
        assert expect("unreachable", "Failed", "SourceUnreachable", "unreachable")["retryable"] is True
        expect("missing", "Failed", "SourceNotFound", "404")
        expect("pvc-unmounted", "Failed", "ClaimNotMounted", "add it to spec.adapterVolumes")
        expect("pvc-ok", "Pending", "WaitingForRunner", "waiting for a ready runner")
        expect("pvc-bad", "Failed", "InvalidAdapter", "DoRA")

        # A runner comes up: the Pending adapter is retried and becomes Ready.
        scheduler.runner_up = True
        st = await wait_for(lambda: (phase(k8s, "pvc-ok") or {}).get("phase") == "Ready" and phase(k8s, "pvc-ok"),
                            what="pvc-ok Ready")
        assert st["rank"] == 8 and st["targetModules"] == ["q", "k", "v", "o"]

        # The missing pool appears: its adapter is retried and becomes Ready.
        await api(k8s, "POST", pools_path(), pool_body("mistral", model={"source": f"{base}/models/tiny"}))
        await wait_for(lambda: (phase(k8s, "no-pool") or {}).get("phase") == "Ready", what="no-pool Ready")

        # Events tell the story; nothing else was disturbed by the bad adapters.
        events = {(e["involvedObject"]["name"], e["reason"], e["type"]) for e in k8s.objs("events", "ml")}
        assert ("good", "Validated", "Normal") in events and ("bad-sha", "ChecksumMismatch", "Warning") in events
        assert k8s.obj("deployments", "ml", "llama-runner")["metadata"]["resourceVersion"] == runner_rv
        assert phase(k8s, "good")["phase"] == "Ready"

        # Fixing a spec re-validates it.
        await api(k8s, "PATCH", adapters_path(name="bad-sha"), {"spec": {"sha256": digest}}, "application/merge-patch+json")
        st = await wait_for(lambda: (phase(k8s, "bad-sha") or {}).get("phase") == "Ready" and phase(k8s, "bad-sha"),
                            what="bad-sha fixed")
        assert st["observedGeneration"] == 2

        # An annotation asks for a new check.
        before = phase(k8s, "good")["validatedAt"]
        await asyncio.sleep(1.0)  # validatedAt has a one-second resolution
        await api(k8s, "PATCH", adapters_path(name="good"), {"metadata": {"annotations": {"lorafleet.dev/recheck": "1"}}},
                  "application/merge-patch+json")
        await wait_for(lambda: phase(k8s, "good")["validatedAt"] != before, what="re-check on annotation")

        # Lowering the pool's maximum rank fails the adapters above it.
        await api(k8s, "PATCH", pools_path(name="llama"), {"spec": {"runner": {"maxLoraRank": 2}}},
                  "application/merge-patch+json")
        st = await wait_for(lambda: (phase(k8s, "good") or {}).get("phase") == "Failed" and phase(k8s, "good"),
                            what="good fails after maxLoraRank lowered")
        assert st["reason"] == "RankTooHigh" and "maxLoraRank 2" in st["message"]


async def test_deleting_an_adapter_waits_until_the_scheduler_forgets_it(k8s, scheduler):
    write_adapter(scheduler.files / "loras" / "sql", rank=4)
    base = f"{scheduler.url}/files"
    registry, directory = AdapterRegistry(), RunnerDirectory()
    hold = {"on": True}
    # The scheduler serves what its Kubernetes feed says, plus "sql" while the test holds it.
    scheduler.models = lambda: sorted(set(registry.names()) | ({"sql"} if hold["on"] else set()))
    async with running_operator(test_config(scheduler)), KubeClient(k8s.url_str) as client:
        feed = asyncio.create_task(run_kube_feeds(registry, directory, namespace="ml", pool="llama", api=client))
        try:
            await api(k8s, "POST", pools_path(), pool_body(model={"source": f"{base}/models/tiny"}))
            await wait_for(lambda: ((k8s.obj(c.POOLS, "ml", "llama") or {}).get("status") or {}).get("baseModel"))
            await api(k8s, "POST", adapters_path(), adapter_body("sql", f"{base}/loras/sql"))
            await api(k8s, "POST", adapters_path(), adapter_body("other", f"{base}/loras/sql"))
            await wait_for(lambda: registry.names() == ["other", "sql"], what="the feed serving both adapters")
            entry = registry.get("sql")
            assert entry.source == f"{base}/loras/sql" and entry.rank == 4

            await api(k8s, "DELETE", adapters_path(name="sql"))
            await wait_for(lambda: registry.names() == ["other"], what="the feed forgetting sql")
            await asyncio.sleep(1.0)
            held = k8s.obj(c.ADAPTERS, "ml", "sql")
            assert held is not None and held["metadata"].get("deletionTimestamp"), "the finalizer must hold it"
            assert ("GET", "/v1/models") in scheduler.calls
            hold["on"] = False
            await wait_for(lambda: k8s.obj(c.ADAPTERS, "ml", "sql") is None, what="sql released")
            assert registry.names() == ["other"] and phase(k8s, "other")["phase"] == "Ready"
        finally:
            feed.cancel()
            await asyncio.gather(feed, return_exceptions=True)

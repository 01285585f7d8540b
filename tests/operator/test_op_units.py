"""Pure pieces of the operator: adapter prechecks, status and conditions, merge patches, CLI, API paths."""
# ruff: noqa: F811  (the k8s and scheduler fixtures come from opkit and are requested by name)

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import pytest
from opkit import (
    REPO,
    api,
    k8s,  # noqa: F401  (fixtures)
    runner_pod,
)

from lorafleet.common.kubeclient import KubeClient, api_path
from lorafleet.operator import cli, validation
from lorafleet.operator.autoscale import History, Observation, RunnerState
from lorafleet.operator.status import PoolFacts, is_subset, merge_patch, pool_status, set_condition

pytestmark = pytest.mark.timeout(60)

POOL = {"spec": {"model": {"source": "hf://o/m"}, "adapterVolumes": ["adapters"], "runner": {"maxLoraRank": 16}}}


@pytest.mark.parametrize("spec, pool, reason, retryable", [
    ({"source": "hf://o/a"}, POOL, None, None),
    ({"pool": "p", "source": "hf://o/a"}, None, "PoolNotFound", True),
    ({"pool": "p", "source": "ftp://x/y"}, POOL, "InvalidSource", False),
    ({"pool": "p", "source": "hf://o/a", "sha256": "xyz"}, POOL, "InvalidSpec", False),
    ({"pool": "p", "source": "pvc://other/a"}, POOL, "ClaimNotMounted", True),
    ({"pool": "p", "source": "hf://o/a"}, {"spec": {}}, "PoolInvalid", True),
])
def test_precheck(spec, pool, reason, retryable):
    got = validation.precheck("a", spec, pool, "ns")
    if "pool" not in spec:
        assert got.reason == "InvalidSpec"
        return
    if reason is None:
        src, parsed = got
        assert src.scheme == "hf" and parsed.runner.max_lora_rank == 16
    else:
        assert (got.phase, got.reason, got.retryable) == ("Failed", reason, retryable)


def test_precheck_accepts_good_specs():
    src, pool = validation.precheck("a", {"pool": "p", "source": "pvc://adapters/x", "sha256": "a" * 64}, POOL, "ns")
    assert src.location == "adapters" and pool.adapter_volumes == ("adapters",)


def test_recheck():
    spec = {"pool": "p", "source": "hf://o/a"}
    assert validation.recheck(spec, {"rank": 16}, POOL, "ns") is None
    v = validation.recheck(spec, {"rank": 32}, POOL, "ns")
    assert v.reason == "RankTooHigh" and "maxLoraRank 16" in v.message
    assert validation.recheck(spec, {"rank": 8}, None, "ns").reason == "PoolNotFound"


def test_verdict_status_clears_stale_fields():
    ready = validation.Verdict("Ready", "Validated", "ok", rank=8, target_modules=("q",), size_bytes=10, base_model="b")
    st = ready.status(None, generation=3, source="hf://o/a", now="2026-01-01T00:00:00Z")
    assert st["rank"] == 8 and st["targetModules"] == ["q"] and st["observedGeneration"] == 3
    failed = validation.failed("ChecksumMismatch", "bad")
    st2 = failed.status(st, generation=3, source="hf://o/a", now="2026-01-01T00:01:00Z")
    patch = merge_patch(st, st2)
    assert patch["rank"] is None and patch["targetModules"] is None and patch["phase"] == "Failed"
    assert st2["conditions"][0]["status"] == "False" and st2["conditions"][0]["lastTransitionTime"] == "2026-01-01T00:01:00Z"


def test_set_condition_keeps_transition_time():
    a = set_condition([], "Ready", True, "Serving", "m", "t1", 1)
    b = set_condition(a, "Ready", True, "Serving", "m2", "t2", 2)
    assert b[0]["lastTransitionTime"] == "t1" and b[0]["message"] == "m2" and b[0]["observedGeneration"] == 2
    c = set_condition(b, "Ready", False, "NoRunnerReady", "m3", "t3")
    assert c[0]["lastTransitionTime"] == "t3"


def test_is_subset_and_merge_patch():
    assert is_subset({"a": {"b": 1}, "c": None}, {"a": {"b": 1, "x": 2}})
    assert not is_subset({"c": None}, {"c": 1})
    assert is_subset({"q": 4}, {"q": "4"})  # quantities come back as strings
    assert not is_subset([1, 2], [1, 2, 3])
    assert merge_patch({"a": {"x": 1, "y": 2}, "keep": 1}, {"a": {"x": 1}}) == {"a": {"y": None}}
    assert merge_patch({"a": 1}, {"a": 1}) == {}


def _facts(obs, available=True, replicas=2, error=None):
    return PoolFacts(generation=4, replicas=replicas, observation=obs, scheduler_available=available,
                     scheduler_error=error, endpoint="http://e", ingress_url=None, history=History())


def test_pool_status_conditions():
    runners = (RunnerState("a", batch_size=3), RunnerState("b"), RunnerState("c", healthy=False))
    obs = Observation(runners, 5, 3, ("a", "b", "c"), 2)
    st = pool_status(_facts(obs, replicas=3), None, "t")
    conds = {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}
    assert conds == {"Ready": ("True", "Serving"), "Progressing": ("True", "RunnersStarting"),
                     "Degraded": ("True", "UnhealthyRunners")}
    assert (st["readyRunners"], st["busyRunners"], st["idleRunners"], st["queueLength"]) == (2, 1, 1, 5)
    st = pool_status(_facts(None, error="down"), st, "t2")
    conds = {c["type"]: (c["status"], c["reason"]) for c in st["conditions"]}
    assert conds["Ready"] == ("False", "SchedulerUnreachable") and conds["Degraded"] == ("True", "SchedulerUnreachable")
    st = pool_status(_facts(None, available=False), st, "t3")
    assert {c["type"]: c["reason"] for c in st["conditions"]}["Ready"] == "SchedulerStarting"
    zero = Observation((), 0, 0, (), 0)
    st = pool_status(_facts(zero, replicas=0), None, "t")
    assert {c["type"]: c["status"] for c in st["conditions"]}["Ready"] == "True"  # a pool scaled to zero serves


def test_cli_arguments():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["-n", "ml", "--sync-interval", "3", "--runner-image", "r:1", "--no-scanning"])
    cfg = cli.config_from_args(args)
    assert args.namespace == ["ml"] and cfg.sync_interval_s == 3 and cfg.runner_image == "r:1" and not cfg.scanning
    args = parser.parse_args([])
    assert args.namespace == [] and cli.config_from_args(args).scheduler_url.startswith("http://{name}-scheduler")
    with pytest.raises(SystemExit):
        parser.parse_args(["-n", "a", "-A"])


def test_torch_free_modules_import_without_torch():
    """The operator and scheduler images have no torch: these modules must not need it."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import lorafleet.operator.main, lorafleet.operator.cli, lorafleet.scheduler.kube, lorafleet.common.sources\n"
        "import lorafleet.scheduler.server  # the operator image runs the scheduler too\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr


def test_api_path():
    assert api_path("v1", "pods", "ml", "p", "status") == "/api/v1/namespaces/ml/pods/p/status"
    assert api_path("apps/v1", "deployments", "ml", "d", "scale") == "/apis/apps/v1/namespaces/ml/deployments/d/scale"
    assert api_path("lorafleet.dev/v1alpha1", "servingpools") == "/apis/lorafleet.dev/v1alpha1/servingpools"


async def test_kube_client_against_the_mock(k8s):
    async with KubeClient(k8s.url_str) as kube:
        assert await kube.get("v1", "pods", "nope", "ml") is None
        created = await kube.apply(runner_pod("r1"), "test")  # created through the fallback
        assert created["metadata"]["uid"]
        assert (await kube.list("v1", "pods", "ml"))["items"][0]["metadata"]["name"] == "r1"
        assert await kube.plural_of("cluster.x-k8s.io/v1beta1", "MachineDeployment") == "machinedeployments"
        patched = await kube.patch("v1", "pods", "r1", {"metadata": {"labels": {"x": "y"}}}, "ml")
        assert patched["metadata"]["labels"]["x"] == "y"
        assert await kube.patch("v1", "pods", "gone", {"metadata": {}}, "ml") is None
        events = []

        async def watch():
            async for event in kube.watch("v1", "pods", "ml"):
                events.append((event["type"], event["object"]["metadata"]["name"]))

        task = asyncio.create_task(watch())
        await asyncio.sleep(0.2)
        await api(k8s, "POST", "/api/v1/namespaces/ml/pods", runner_pod("r2"))
        assert await kube.delete("v1", "pods", "r1", "ml") is True
        assert await kube.delete("v1", "pods", "r1", "ml") is False
        for _ in range(50):
            if ("DELETED", "r1") in events:
                break
            await asyncio.sleep(0.05)
        task.cancel()
        assert ("ADDED", "r1") in events and ("ADDED", "r2") in events and ("DELETED", "r1") in events


async def test_kube_client_from_kubeconfig(k8s):
    kube = await KubeClient.from_environment()
    try:
        assert kube.server == k8s.url_str and kube.current_token() == "test-token"
        assert await kube.get("v1", "pods", "nope", "ml") is None
    finally:
        await kube.close()


def test_cli_run_starts_kopf_over_the_handlers(monkeypatch):
    import kopf

    seen = {}

    async def fake_operator(**kwargs):
        seen.update(kwargs)

    async def an_api(cls, **kwargs):  # (the check that there is a Kubernetes API to talk to: there is)
        return object()

    monkeypatch.setattr(kopf, "operator", fake_operator)
    monkeypatch.setattr(KubeClient, "from_environment", classmethod(an_api))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--sync-interval", "5"])) == 0
    assert seen["clusterwide"] is True and seen["namespaces"] == [] and seen["standalone"] is True
    assert seen["liveness_endpoint"] == "http://0.0.0.0:8080/healthz"
    assert seen["memo"]["config"].sync_interval_s == 5
    assert "lorafleet.operator.main" in sys.modules
    cli.run(parser.parse_args(["-n", "ml", "-n", "team-*", "--liveness", ""]))
    assert seen["clusterwide"] is False and seen["namespaces"] == ["ml", "team-*"] and seen["liveness_endpoint"] is None


def test_node_group_verdict_holds_transient_faults_back_for_a_few_rounds():
    """A 429/5xx on the node group is said from the NODE_GROUP_PATIENCE-th round in a row, at once where the status
    already reports the group; a lasting fault is said at once; any other outcome starts the count again."""
    from types import SimpleNamespace

    from lorafleet.common.kubeclient import ApiError
    from lorafleet.operator import reconcile

    def fault(status):
        return reconcile.NodeGroupFault.of("node group Deployment/g cannot be read", ApiError(status, "", f"x{status}"))

    def run(*rounds):
        ctx = SimpleNamespace(node_group_strikes={}, node_group_errors={})
        pool = SimpleNamespace(namespace="ml", name="p")
        said, reported = [], False
        for status in rounds:
            says = reconcile.node_group_verdict(ctx, pool, None if status is None else fault(status), reported)
            said.append(None if says is None else says.rsplit("x", 1)[1])
            reported = says is not None
        return said

    assert reconcile.NODE_GROUP_PATIENCE == 3
    assert run(503, 503, 503, 503) == [None, None, "503", "503"]
    assert run(503, 429, None, 500, 502, 504) == [None, None, None, None, None, "504"]
    assert run(403, 503, 503) == ["403", "503", "503"]  # the status says it already: never cleared in between
    assert run(503, 403, 503) == [None, "403", "503"]
    assert run(501, None) == ["501", None]  # not in TRANSIENT_STATUSES
    assert not reconcile.NodeGroupFault.of("g", ApiError(404)).transient


def test_kopf_attempts_it_retries_are_warnings_its_last_failure_an_error(caplog):
    """kopf logs each failed attempt of a request it retries at ERROR (an API server answering 429 while its storage
    re-initializes made a passing run look failed); the operator makes those warnings, and keeps the final failure
    an error, on kopf's loggers old and new."""
    import logging

    import kopf._cogs.clients.watching  # noqa: F401  (one of the loggers kopf's request retries log on)

    from lorafleet.operator.main import soften_retried_requests

    soften_retried_requests()
    soften_retried_requests()  # (twice: one filter per logger)
    caplog.set_level(logging.DEBUG)
    for name in ("kopf._cogs.clients.watching", "kopf.objects"):
        log = logging.getLogger(name)
        assert sum(type(f).__name__ == "RetriedRequests" for f in log.filters) == 1
        log.error("Request attempt #1/9 failed; will retry: GET /apis/x -> %r", "APITooManyRequestsError()")
        log.error("Request attempt #9/9 failed; escalating: GET /apis/x -> %r", "APIServerError()")
        log.error("Handler 'pool' failed with an exception. Will retry.")
    levels = [(r.name, r.levelname, r.getMessage().split(":")[0]) for r in caplog.records]
    for name in ("kopf._cogs.clients.watching", "kopf.objects"):
        assert (name, "WARNING", "Request attempt #1/9 failed; will retry") in levels
        assert (name, "ERROR", "Request attempt #9/9 failed; escalating") in levels
        assert (name, "ERROR", "Handler 'pool' failed with an exception. Will retry.") in levels

"""The real kopf operator against a Kubernetes API mock: autoscaling, node groups, restarts."""
# ruff: noqa: F811  (the k8s and scheduler fixtures come from opkit and are requested by name)

from __future__ import annotations

import asyncio
import base64

import kmock
import pytest
from opkit import (  # noqa: F401  (fixtures)
    adapter_body,
    adapters_path,
    api,
    k8s,
    pool_body,
    pools_path,
    runner_pod,
    runner_state,
    running_operator,
    scheduler,
    test_config,
    wait_for,
    write_adapter,
)

from lorafleet.operator import constants as c

pytestmark = pytest.mark.timeout(120)


def replicas(k8s, plural, name):
    obj = k8s.obj(plural, "ml", name)
    return obj and obj["spec"].get("replicas")


async def test_autoscaling_runners_and_node_group(k8s, scheduler):
    await api(k8s, "POST", "/apis/cluster.x-k8s.io/v1beta1/namespaces/ml/machinedeployments",
              {"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "MachineDeployment",
               "metadata": {"name": "gpu-nodes", "namespace": "ml"}, "spec": {"replicas": 1}})
    spec = dict(minRunners=1, maxRunners=3, idleSecondsBeforeDrain=10,
                autoscaling={"scaleUpDelaySeconds": 0, "scaleUpCooldownSeconds": 0, "maxScaleUpStep": 2},
                nodeGroup={"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "MachineDeployment", "name": "gpu-nodes",
                           "gpusPerNode": 2})
    async with running_operator(test_config(scheduler)):
        await api(k8s, "POST", pools_path(), pool_body(**spec))
        await wait_for(lambda: replicas(k8s, "deployments", "llama-runner") == 1, what="one runner")
        await api(k8s, "PATCH", "/apis/apps/v1/namespaces/ml/deployments/llama-scheduler/status",
                  {"status": {"availableReplicas": 1}}, "application/merge-patch+json")

        # Requests queue and the only runner is full: two more runners, and the node group grows first.
        await api(k8s, "POST", "/api/v1/namespaces/ml/pods", runner_pod("llama-runner-a"))
        scheduler.state = {"runners": [runner_state("llama-runner-a", batch=32)], "queue_length": 40}
        await wait_for(lambda: replicas(k8s, "deployments", "llama-runner") == 3, what="scale up to 3")
        await wait_for(lambda: replicas(k8s, "machinedeployments", "gpu-nodes") == 2, what="node group 2")

        def autoscaled(*words):
            messages = [e["message"] for e in k8s.objs("events", "ml") if e["reason"] == "Autoscaled"]
            return all(any(w in m for m in messages) for w in words)

        await wait_for(lambda: autoscaled("runners 1 -> 3", "MachineDeployment/gpu-nodes: 1 -> 2"), what="events")

        # Load falls: runner b has idled past the window; it is drained, then exactly it is removed.
        for name in ("llama-runner-b", "llama-runner-c"):
            await api(k8s, "POST", "/api/v1/namespaces/ml/pods", runner_pod(name))
        scheduler.state = {"runners": [runner_state("llama-runner-a", batch=10), runner_state("llama-runner-b", idle=20),
                                       runner_state("llama-runner-c", idle=3)], "queue_length": 0}
        await wait_for(lambda: ("POST", "/admin/runners/llama-runner-b/drain") in scheduler.calls, what="drain of b")
        pod_b = await wait_for(lambda: (k8s.obj("pods", "ml", "llama-runner-b")["metadata"].get("annotations") or {})
                               .get(c.ANNOTATION_DELETION_COST), what="deletion cost on b")
        assert pod_b == c.DRAINED_DELETION_COST
        await wait_for(lambda: replicas(k8s, "deployments", "llama-runner") == 2, what="scale down to 2")
        for name in ("llama-runner-a", "llama-runner-c"):
            assert not (k8s.obj("pods", "ml", name)["metadata"].get("annotations") or {}).get(c.ANNOTATION_DELETION_COST)
        assert not any(call[1].endswith("/drain") and "llama-runner-b" not in call[1] for call in scheduler.calls)
        # The node group shrinks only after the drained pod is gone.
        await asyncio.sleep(0.6)
        assert replicas(k8s, "machinedeployments", "gpu-nodes") == 2
        await api(k8s, "DELETE", "/api/v1/namespaces/ml/pods/llama-runner-b")  # what the ReplicaSet does
        scheduler.state = {"runners": [runner_state("llama-runner-a", batch=10), runner_state("llama-runner-c", idle=3)],
                           "queue_length": 0}
        await wait_for(lambda: replicas(k8s, "machinedeployments", "gpu-nodes") == 1, what="node group 1")
        status = await wait_for(lambda: (k8s.obj(c.POOLS, "ml", "llama")["status"].get("nodeGroupReplicas") == 1
                                         and k8s.obj(c.POOLS, "ml", "llama")["status"]), what="status caught up")
        assert status["runners"] == 2 and status["autoscaler"]["draining"] == {}
        # Never below minRunners, whatever idles.
        scheduler.state = {"runners": [runner_state("llama-runner-a", idle=100), runner_state("llama-runner-c", idle=100)],
                           "queue_length": 0}
        await asyncio.sleep(1.0)
        drains = [call for call in scheduler.calls if call[1].endswith("/drain")]
        assert len(drains) <= 2 and replicas(k8s, "deployments", "llama-runner") >= 1


async def test_restart_converges_without_duplicates(k8s, scheduler):
    write_adapter(scheduler.files / "loras" / "sql", rank=4)
    base = f"{scheduler.url}/files"
    config = test_config(scheduler)
    async with running_operator(config):
        await api(k8s, "POST", pools_path(), pool_body(model={"source": f"{base}/models/tiny"}))
        await api(k8s, "POST", adapters_path(), adapter_body("sql", f"{base}/loras/sql"))
        await wait_for(lambda: ((k8s.obj(c.ADAPTERS, "ml", "sql") or {}).get("status") or {}).get("phase") == "Ready",
                       what="adapter Ready")
        await wait_for(lambda: k8s.obj("deployments", "ml", "llama-runner"))
        await asyncio.sleep(1.5)  # a resync round
    children = {(res.plural, name): obj.raw["metadata"]["resourceVersion"]
                for (res, ns, name), obj in k8s.objects.items()
                if not obj.deleted and res.plural not in ("events", c.POOLS, c.ADAPTERS)}
    token = k8s.obj("secrets", "ml", "llama-admin")["data"]["token"]
    validated_at = k8s.obj(c.ADAPTERS, "ml", "sql")["status"]["validatedAt"]
    seen = len(k8s._requests)

    async with running_operator(config):
        await asyncio.sleep(2.5)  # resume handlers, several looks and a resync
    after = k8s._requests[seen:]
    creates = [r for r in after if r.action == kmock.action.CREATE and r.resource.plural != "events"]
    assert creates == [], [str(r.url) for r in creates]
    # The credential Secrets are re-applied without being read (the operator may not read Secrets):
    # identical server-side applies, which a real API server turns into no-ops (tests/envtest checks
    # their resourceVersion stays); this mock bumps it on every write, so they are left out here.
    writes = [r for r in after if r.action in (kmock.action.UPDATE, kmock.action.DELETE)
              and r.resource.plural not in ("events", c.POOLS, c.ADAPTERS, "secrets")]
    assert writes == [], [(r.method, str(r.url)) for r in writes]
    assert all("fieldManager=lorafleet-operator" in str(r.url) for r in after
               if r.resource is not None and r.resource.plural == "secrets")
    now = {(res.plural, name): obj.raw["metadata"]["resourceVersion"]
           for (res, ns, name), obj in k8s.objects.items()
           if not obj.deleted and res.plural not in ("events", c.POOLS, c.ADAPTERS, "secrets")}
    assert now == {k: v for k, v in children.items() if k[0] != "secrets"}
    assert k8s.obj("secrets", "ml", "llama-admin")["data"]["token"] == token
    assert base64.b64decode(token)
    status = k8s.obj(c.ADAPTERS, "ml", "sql")["status"]
    assert status["phase"] == "Ready" and status["validatedAt"] == validated_at  # trusted, not re-fetched

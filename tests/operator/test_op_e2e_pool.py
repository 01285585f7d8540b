"""The real kopf operator against a Kubernetes API mock: ServingPool lifecycle."""
# ruff: noqa: F811  (the k8s and scheduler fixtures come from opkit and are requested by name)

from __future__ import annotations

import base64

import pytest
from opkit import (  # noqa: F401  (fixtures)
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
)

from lorafleet.operator import constants as c

pytestmark = pytest.mark.timeout(90)


def deployment(k8s, name):
    return k8s.obj("deployments", "ml", name)


async def test_pool_lifecycle(k8s, scheduler):
    spec = dict(
        runner={"maxBatchSize": 16, "nodeSelector": {"gpu": "h100"}, "gpusPerRunner": 1, "maxLoraRank": 32,
                "resources": {"requests": {"cpu": "8", "memory": "40Gi"}}},
        minRunners=1, maxRunners=4, adapterVolumes=["adapters"], credentialsSecret="hf",
        ingress={"enabled": True, "host": "llm.example.org", "className": "nginx"},
    )
    async with running_operator(test_config(scheduler, scheduler_image="sched:1", runner_image="runner:1")):
        pool = await api(k8s, "POST", pools_path(), pool_body(**spec))
        uid = pool["metadata"]["uid"]

        runner = await wait_for(lambda: deployment(k8s, "llama-runner"), what="runner Deployment")
        sched = await wait_for(lambda: deployment(k8s, "llama-scheduler"), what="scheduler Deployment")
        await wait_for(lambda: k8s.obj("ingresses", "ml", "llama"), what="Ingress")

        # Runner workload: GPUs, node pool, probes, graceful termination, identity, volumes.
        assert runner["spec"]["replicas"] == 1
        assert runner["metadata"]["ownerReferences"][0]["uid"] == uid
        pod = runner["spec"]["template"]["spec"]
        ctr = pod["containers"][0]
        assert ctr["image"] == "runner:1"
        assert ctr["args"][:2] == ["runner", "--host"] and "--max-batch-size" in ctr["args"]
        assert ctr["args"][ctr["args"].index("--max-batch-size") + 1] == "16"
        assert ctr["args"][ctr["args"].index("--max-lora-rank") + 1] == "32"
        assert ctr["resources"]["limits"]["nvidia.com/gpu"] == "1" and ctr["resources"]["requests"]["cpu"] == "8"
        assert pod["nodeSelector"] == {"gpu": "h100"}
        assert pod["terminationGracePeriodSeconds"] == 120 and pod["automountServiceAccountToken"] is False
        assert ctr["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert ctr["livenessProbe"]["httpGet"]["path"] == "/healthz"
        env = {e["name"]: e for e in ctr["env"]}
        assert env["LORAFLEET_RUNNER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert ctr["envFrom"] == [{"secretRef": {"name": "hf"}}]
        assert {"name": "pvc-adapters", "mountPath": "/mnt/lorafleet/pvc/adapters", "readOnly": True} in ctr["volumeMounts"]
        assert runner["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}

        # Scheduler: its command line, admin token from the Secret, its account and least-privilege Role.
        sctr = sched["spec"]["template"]["spec"]["containers"][0]
        assert sctr["image"] == "sched:1"
        assert sctr["args"] == ["scheduler", "--host", "0.0.0.0", "--port", "8000", "--model",
                                "pvc://models/llama-2-7b", "--kube", "--namespace", "ml", "--pool", "llama",
                                "--grace-seconds", "110"]
        assert sched["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 120  # the runners' period
        token_ref = {e["name"]: e for e in sctr["env"]}["LORAFLEET_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert token_ref == {"name": "llama-admin", "key": "token"}
        secret = k8s.obj("secrets", "ml", "llama-admin")
        token = base64.b64decode(secret["data"]["token"]).decode()
        assert len(token) >= 32
        # The runner credential: its own Secret, given to both ends, different from the admin token.
        runner_secret = k8s.obj("secrets", "ml", "llama-runner-token")
        runner_token = base64.b64decode(runner_secret["data"]["token"]).decode()
        assert len(runner_token) >= 32 and runner_token != token
        for ctr_ in (ctr, sctr):
            ref = {e["name"]: e for e in ctr_["env"]}["LORAFLEET_RUNNER_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "llama-runner-token", "key": "token"}
        assert k8s.obj("networkpolicies", "ml", "llama-runner")["spec"]["policyTypes"] == ["Ingress"]
        assert sched["spec"]["template"]["spec"]["serviceAccountName"] == "llama-scheduler"
        role = k8s.obj("roles", "ml", "llama-scheduler")
        granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
                   for v in rule["verbs"]}
        assert {v for _, _, v in granted} == {"get", "list", "watch"}  # read-only
        assert {r for _, r, _ in granted} == {"pods", "endpointslices", "loraadapters"}
        binding = k8s.obj("rolebindings", "ml", "llama-scheduler")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-scheduler", "namespace": "ml"}]
        assert k8s.obj("serviceaccounts", "ml", "llama-runner")["automountServiceAccountToken"] is False
        svc = k8s.obj("services", "ml", "llama-scheduler")
        assert svc["spec"]["selector"] == c.selector_labels("llama", "scheduler")
        assert k8s.obj("services", "ml", "llama-runner")["spec"]["clusterIP"] == "None"
        ing = k8s.obj("ingresses", "ml", "llama")
        assert ing["spec"]["rules"][0]["host"] == "llm.example.org"
        assert ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == "llama-scheduler"

        # Status follows the scheduler's view.
        await api(k8s, "PATCH", "/apis/apps/v1/namespaces/ml/deployments/llama-scheduler/status",
                  {"status": {"availableReplicas": 1}}, "application/merge-patch+json")
        await api(k8s, "POST", "/api/v1/namespaces/ml/pods", runner_pod("llama-runner-abc"))
        scheduler.state = {"runners": [runner_state("llama-runner-abc", batch=3)], "queue_length": 2}

        def ready():
            status = (k8s.obj(c.POOLS, "ml", "llama") or {}).get("status") or {}
            conds = {x["type"]: x for x in status.get("conditions") or ()}
            return status if conds.get("Ready", {}).get("status") == "True" else None

        status = await wait_for(ready, what="pool Ready")
        assert status["runners"] == 1 and status["readyRunners"] == 1 and status["busyRunners"] == 1
        assert status["queueLength"] == 2
        assert status["endpoint"] == "http://llama-scheduler.ml.svc:8000"
        assert status["ingressURL"] == "http://llm.example.org/v1"
        assert status["gpus"] == 1
        conds = {x["type"]: x["status"] for x in status["conditions"]}
        assert conds == {"Ready": "True", "Progressing": "False", "Degraded": "False"}
        assert f"Bearer {token}" in scheduler.tokens
        await wait_for(lambda: {"Applied", "Serving"} <= {e.get("reason") for e in k8s.objs("events", "ml")},
                       what="events Applied and Serving")

        # A spec change rolls through; turning the ingress off removes it.
        await api(k8s, "PATCH", pools_path(name="llama"),
                  {"spec": {"runner": {"maxBatchSize": 8}, "ingress": {"enabled": False}}}, "application/merge-patch+json")

        def batch_arg():
            d = deployment(k8s, "llama-runner")
            args = d["spec"]["template"]["spec"]["containers"][0]["args"]
            return args[args.index("--max-batch-size") + 1] == "8" and k8s.obj("ingresses", "ml", "llama") is None

        await wait_for(batch_arg, what="spec change applied")
        assert deployment(k8s, "llama-runner")["spec"]["replicas"] == 1
        assert base64.b64decode(k8s.obj("secrets", "ml", "llama-admin")["data"]["token"]).decode() == token

        # Deletion: the finalizer removes every child, then the pool goes. (The credential Secrets
        # are left to the garbage collector, which the mock has not: the operator cannot read
        # Secrets to check they are its own; tests/envtest checks the real collector removes them.)
        await api(k8s, "DELETE", pools_path(name="llama"))
        await wait_for(lambda: k8s.obj(c.POOLS, "ml", "llama") is None, what="pool deleted")
        for plural, name in [("deployments", "llama-runner"), ("deployments", "llama-scheduler"),
                             ("services", "llama-runner"), ("services", "llama-scheduler"), ("roles", "llama-scheduler"),
                             ("rolebindings", "llama-scheduler"), ("serviceaccounts", "llama-scheduler"),
                             ("serviceaccounts", "llama-runner"), ("networkpolicies", "llama-runner")]:
            assert k8s.obj(plural, "ml", name) is None, (plural, name)


async def test_invalid_pool_spec_is_reported(k8s, scheduler):
    async with running_operator(test_config(scheduler)):
        await api(k8s, "POST", pools_path(), pool_body(minRunners=5, maxRunners=2))

        def degraded():
            status = (k8s.obj(c.POOLS, "ml", "llama") or {}).get("status") or {}
            conds = {x["type"]: x for x in status.get("conditions") or ()}
            return conds.get("Degraded", {}).get("reason") == "InvalidSpec" and status

        status = await wait_for(degraded, what="InvalidSpec condition")
        assert "minRunners (5) must not exceed maxRunners (2)" in status["message"]
        assert deployment(k8s, "llama-runner") is None

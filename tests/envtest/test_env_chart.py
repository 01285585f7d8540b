"""The chart on a real API server: what the operator's ServiceAccount may do (RBAC as the server
decides it), and the CRDs' validation (OpenAPI and CEL rules) as the server applies it."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import yaml
from conftest import OPERATOR_NS, RELEASE

pytestmark = pytest.mark.timeout(240)

OPERATOR_SA = f"system:serviceaccount:{OPERATOR_NS}:{RELEASE}-lorafleet"


def can(cluster, who: str, verb: str, resource: str, namespace: str | None = None) -> bool:
    """The API server's own answer (a SubjectAccessReview) for a ServiceAccount:
    `resource` is `plural[.group][/subresource]`."""
    resource, _, sub = resource.partition("/")
    plural, _, group = resource.partition(".")
    ns_of_sa = who.split(":")[2]
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": {
        "user": who, "groups": ["system:serviceaccounts", f"system:serviceaccounts:{ns_of_sa}", "system:authenticated"],
        "resourceAttributes": {"verb": verb, "group": group, "resource": plural, "subresource": sub,
                               "namespace": namespace or ""}}}
    answer = cluster.plane.request("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
    return bool(answer["status"].get("allowed"))


def test_operator_cannot_read_secrets_anywhere(cluster, release):
    for ns in ("kube-system", "default", OPERATOR_NS, "ml"):
        for verb in ("get", "list", "watch"):
            assert not can(cluster, OPERATOR_SA, verb, "secrets", ns), (verb, ns)
    assert not can(cluster, OPERATOR_SA, "list", "secrets")  # cluster-wide
    # It writes the pools' credential Secrets (derived values), and deletes none of them.
    assert can(cluster, OPERATOR_SA, "create", "secrets", "ml") and can(cluster, OPERATOR_SA, "patch", "secrets", "ml")
    assert not can(cluster, OPERATOR_SA, "delete", "secrets", "ml")
    assert not can(cluster, OPERATOR_SA, "update", "secrets", "kube-system")


def test_operator_grants_are_what_pools_need_and_no_more(cluster, release):
    yes = [("patch", "deployments.apps/scale", "ml"), ("create", "deployments.apps", "ml"),
           ("create", "networkpolicies.networking.k8s.io", "ml"), ("patch", "pods", "ml"),
           ("patch", "servingpools.lorafleet.dev/status", "ml"), ("create", "roles.rbac.authorization.k8s.io", "ml"),
           ("patch", "machinedeployments.cluster.x-k8s.io/scale", "ml"), ("list", "customresourcedefinitions.apiextensions.k8s.io", None)]
    no = [("delete", "pods", "ml"), ("create", "pods", "ml"), ("create", "clusterroles.rbac.authorization.k8s.io", None),
          ("delete", "nodes", None), ("create", "pods/exec", "ml"), ("escalate", "roles.rbac.authorization.k8s.io", "ml"),
          ("impersonate", "serviceaccounts", "ml")]
    for verb, res, ns in yes:
        assert can(cluster, OPERATOR_SA, verb, res, ns), (verb, res, ns)
    for verb, res, ns in no:
        assert not can(cluster, OPERATOR_SA, verb, res, ns), (verb, res, ns)


def test_the_key_secret_is_kept_and_mounted(cluster, release):
    key = cluster.get("v1", "secrets", f"{RELEASE}-lorafleet-key", OPERATOR_NS)
    assert key is not None and key["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    pod = release["operator_pod"]
    (ctr,) = pod["spec"]["containers"]
    assert "--credentials-key-file=/etc/lorafleet/operator-key/key" in ctr["args"]
    assert pod["spec"]["serviceAccountName"] == f"{RELEASE}-lorafleet"


POOL = {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "ServingPool",
        "metadata": {"name": "check", "namespace": "default"}, "spec": {"model": {"source": "hf://org/model"}}}


def server_dry_run(cluster, obj: dict) -> str:
    return cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(obj), check=False)


@pytest.mark.parametrize("spec, error", [
    ({"runner": {"gpusPerRunner": 9}}, "should be less than or equal to 8"),
    ({"runner": {"gpusPerRunner": 0}}, "should be greater than or equal to 1"),
    ({"minRunners": 5, "maxRunners": 2}, "minRunners must not exceed maxRunners"),
    ({"runner": {"gpusPerRunner": 4}, "nodeGroup": {"apiVersion": "a/v1", "kind": "K", "name": "gpu-nodes", "gpusPerNode": 2}},
     "a runner must fit on one node"),
    ({"ingress": {"enabled": True, "path": "/"}}, "supported values: \"/v1\""),
    ({"apiKeys": {}}, "secretName: Required value"),
    ({"idleSecondsBeforeDrain": 0}, "should be greater than or equal to 1"),
    ({"prefixCache": {"saltPerApiKey": True}}, "prefixCache.saltPerApiKey needs apiKeys"),
    ({"runner": {"quantization": "int4"}}, 'supported values: "auto", "fp8"'),
    ({"runner": {"kvCacheDtype": "fp16"}}, 'supported values: "auto", "fp8"'),
])
def test_the_server_refuses_bad_pools(cluster, release, spec, error):
    obj = {**POOL, "spec": {**POOL["spec"], **spec}}
    out = server_dry_run(cluster, obj)
    assert error in out, out


def test_the_server_accepts_and_defaults_good_pools(cluster, release):
    obj = {**POOL, "spec": {**POOL["spec"], "runner": {"gpusPerRunner": 8},
                            "nodeGroup": {"apiVersion": "a/v1", "kind": "K", "name": "gpu-nodes", "gpusPerNode": 8},
                            "apiKeys": {"secretName": "keys"}, "ingress": {"enabled": True}}}
    out = cluster.kubectl("apply", "--dry-run=server", "-o", "yaml", "-f", "-", input=yaml.safe_dump(obj))
    spec = yaml.safe_load(out)["spec"]
    assert spec["runner"]["gpusPerRunner"] == 8 and spec["ingress"]["path"] == "/v1"
    assert spec["networkPolicy"] == {"enabled": True} and spec["minRunners"] == 1
    assert spec["prefixCache"] == {"enabled": True, "saltPerApiKey": False}
    assert spec["runner"]["quantization"] == "auto" and spec["runner"]["kvCacheDtype"] == "auto"
    obj["spec"]["prefixCache"] = {"saltPerApiKey": True}  # with apiKeys: accepted
    obj["spec"]["runner"].update(quantization="fp8", kvCacheDtype="fp8")
    out = cluster.kubectl("apply", "--dry-run=server", "-o", "yaml", "-f", "-", input=yaml.safe_dump(obj))
    spec = yaml.safe_load(out)["spec"]
    assert spec["prefixCache"] == {"enabled": True, "saltPerApiKey": True}
    assert spec["runner"]["quantization"] == "fp8" and spec["runner"]["kvCacheDtype"] == "fp8"


def test_operator_log_is_quiet_on_an_unreachable_model_and_a_deletion(cluster, release):
    """A pool whose base model cannot be read: one warning; deleting it: no cancelled daemons.
    (Its namespace is not run by the kubelet: its pods stay Pending, only the operator works.)"""
    from envkit import wait_for

    cluster.plane.request("POST", "/api/v1/namespaces",
                          {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "quiet"}})
    # A model server that accepts, stalls 3 s and hangs up: the pool's first handlers overlap in reading it.
    server = socket.create_server(("127.0.0.1", 0))
    stall = threading.Thread(target=_stall, args=(server,), daemon=True)
    stall.start()
    pool = {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "ServingPool",
            "metadata": {"name": "unreachable", "namespace": "quiet"},
            "spec": {"model": {"source": f"http://127.0.0.1:{server.getsockname()[1]}/models/llama"}}}
    cluster.apply(pool)
    operator = next(iter(cluster.kubelet.running(OPERATOR_NS).values()))
    wait_for(lambda: "base model shape unknown" in operator.log_tail(200_000), 60, "the base-model warning")
    wait_for(lambda: cluster.get("apps/v1", "deployments", "unreachable-runner", "quiet"), 30, "the pool applied")
    time.sleep(4)  # more looks and a resync (3 s in these tests) pass
    cluster.kubectl("delete", "servingpool", "unreachable", "-n", "quiet", "--timeout=60s")
    log = operator.log_tail(500_000)
    warnings = [line for line in log.splitlines() if "base model shape unknown" in line and "quiet/unreachable" in line]
    server.close()
    assert len(warnings) == 1, warnings
    assert "Will escalate" not in log and "Traceback" not in log


def _stall(server: socket.socket) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        threading.Timer(3.0, conn.close).start()


def test_example_manifests_pass_the_servers_validation(cluster, release):
    """`kubectl apply -f manifests/` as the README says (server-side dry run: nothing starts)."""
    from controlplane import REPO

    out = cluster.kubectl("apply", "--dry-run=server", "-n", "default", "-f", str(REPO / "manifests"))
    assert "servingpool.lorafleet.dev/llama-2-7b created (server dry run)" in out
    assert "loraadapter.lorafleet.dev/sql-lora created (server dry run)" in out

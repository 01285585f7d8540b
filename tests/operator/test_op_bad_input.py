"""Bad input, the way a Kubernetes user hits it: refused at admission by the CRDs, or reported in the
status and one event, never a traceback, a hot retry loop or a silently wrong object.

The CRD checks and the operator's handling of objects the API server refuses run against a real
control plane (`../shared/envtest`, as tests/envtest does; skipped with the reason without it).
"""
# ruff: noqa: F811  (the scheduler fixture comes from opkit and is requested by name)

from __future__ import annotations

import asyncio
import logging

import pytest
import yaml
from opkit import REPO, plane, running_operator, scheduler, test_config, wait_for  # noqa: F401  (fixtures)

from lorafleet.operator import constants as c
from lorafleet.operator import validation
from lorafleet.operator.spec import SpecError, parse_pool

pytestmark = pytest.mark.timeout(180)

GOOD = {"model": {"source": "hf://org/model"}}


# --- the operator's own checks (it must not rely on the API server having checked) ---------------


@pytest.mark.parametrize("spec, words", [
    ({"runner": {"kvFraction": 0}}, "runner.kvFraction is 0: it must be 0.05 to 0.99"),
    ({"runner": {"kvFraction": 1.5}}, "runner.kvFraction is 1.5"),
    ({"runner": {"kvFraction": -0.2}}, "runner.kvFraction is -0.2"),
    ({"model": {"source": "pvc://Bad_Claim/llama"}}, "'Bad_Claim' is not a valid PersistentVolumeClaim name"),
    ({"model": {"source": "https://[::1/llama"}}, "spec.model.source: 'https://\\[::1/llama': Invalid IPv6 URL"),
    ({"model": {"source": "ftp://host/llama"}}, "unsupported source scheme 'ftp'"),
    ({"nodeGroup": {"apiVersion": "v", "kind": "K", "name": "n", "gpusPerNode": 1, "minReplicas": 5, "maxReplicas": 2}},
     "nodeGroup.minReplicas \\(5\\) must not exceed nodeGroup.maxReplicas \\(2\\)"),
])
def test_pool_specs_the_runners_cannot_use_are_refused_by_name(spec, words):
    with pytest.raises(SpecError, match=words):
        parse_pool("p", "ns", {**GOOD, **spec})


@pytest.mark.parametrize("spec, words", [
    # wrong types: these were a ValueError, TypeError or AttributeError in the handler (a traceback retried forever)
    ({"runner": {"gpusPerRunner": "two"}}, "runner.gpusPerRunner must be an integer, got 'two'"),
    ({"runner": {"maxBatchSize": None}}, "runner.maxBatchSize must be an integer, got None"),
    ({"runner": {"kvFraction": "most"}}, "runner.kvFraction must be a number, got 'most'"),
    ({"runner": ["gpusPerRunner"]}, "runner must be an object, got list"),
    ({"autoscaling": "on"}, "autoscaling must be an object, got str 'on'"),
    ({"nodeGroup": "karpenter"}, "nodeGroup must be an object"),
    ({"runner": {"env": ["HF_TOKEN=x"]}}, "runner.env must be a list of objects with a name"),
    # silently wrong: a string read as its characters, "false" read as on, bounds the CRD sets not kept
    ({"runner": {"extraArgs": "--max-step-tokens 256"}}, "runner.extraArgs must be a list, got str"),
    ({"adapterVolumes": "loras"}, "adapterVolumes must be a list, got str 'loras'"),
    ({"autoscaling": {"enabled": "false"}}, "autoscaling.enabled must be true or false, got 'false'"),
    ({"minRunners": -1}, "minRunners is -1: it must be 0 to 1024"),
    ({"minRunners": 0, "maxRunners": 0}, "maxRunners is 0: it must be 1 to 1024"),
    ({"runner": {"maxBatchSize": 0}}, "runner.maxBatchSize is 0: it must be 1 to 1024"),
    ({"runner": {"maxLoraRank": 1000}}, "runner.maxLoraRank is 1000: it must be 1 to 128"),
    ({"runner": {"gpusPerRunner": 1.5}}, "runner.gpusPerRunner must be an integer, got 1.5"),
    ({"autoscaling": {"maxScaleUpStep": 0}}, "autoscaling.maxScaleUpStep is 0: it must be 1 to 64"),
    ({"idleSecondsBeforeDrain": -5}, "idleSecondsBeforeDrain is -5: it must be 1 to 86400"),
])
def test_pool_fields_of_the_wrong_type_or_out_of_the_crds_bounds_are_a_spec_error(spec, words):
    """Only a SpecError reaches the status and one event; any other exception was a handler traceback."""
    with pytest.raises(SpecError) as exc:
        parse_pool("p", "ns", {**GOOD, **spec})
    assert words in str(exc.value) and len(str(exc.value)) < 300, str(exc.value)


def test_a_huge_field_is_cut_short_in_the_message():
    with pytest.raises(SpecError) as exc:
        parse_pool("p", "ns", {**GOOD, "runner": {"extraArgs": "x" * 1_000_000}})
    assert len(str(exc.value)) < 200


@pytest.mark.parametrize("spec", [{"pool": ["p"], "source": "hf://org/a"}, {"pool": "p", "source": 5}])
def test_an_adapter_whose_pool_or_source_is_not_a_string_fails_as_an_invalid_spec(spec):
    """A list as the pool was a TypeError in precheck; a number as the source was looked up as a local path '5'."""
    got = validation.precheck("a", spec, {"spec": GOOD}, "ns")
    assert (got.phase, got.reason, got.retryable) == ("Failed", "InvalidSpec", False)
    assert got.message == "spec.pool and spec.source must be strings"


@pytest.mark.parametrize("name", ["a.b", "1pool", "Pool", "pool-", "p" * 41])
def test_a_pool_name_that_cannot_name_a_service_is_refused(name):
    with pytest.raises(SpecError, match="must be a DNS-1035 label"):
        parse_pool(name, "ns", GOOD)


def test_kv_fraction_bounds_are_accepted():
    assert parse_pool("p", "ns", {**GOOD, "runner": {"kvFraction": 0.05}}).runner.kv_fraction == 0.05
    assert parse_pool("p", "ns", {**GOOD, "runner": {"kvFraction": 0.99}}).runner.kv_fraction == 0.99


def test_an_adapter_source_urllib_cannot_parse_fails_as_an_invalid_source():
    got = validation.precheck("a", {"pool": "p", "source": "https://[::1/loras/a"}, {"spec": GOOD}, "ns")
    assert (got.phase, got.reason, got.retryable) == ("Failed", "InvalidSource", False)
    assert "'https://[::1/loras/a': Invalid IPv6 URL" in got.message


# --- a real API server --------------------------------------------------------------------------


def pool(name: str, **spec) -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.POOL_KIND, "metadata": {"name": name, "namespace": "ml"},
            "spec": {**GOOD, **spec}}


def server_dry_run(plane, obj: dict) -> str:
    return plane.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(obj), check=False)


@pytest.mark.parametrize("obj, error", [
    (pool("p", runner={"kvFraction": 0}), "runner.kvFraction must be between 0.05 and 0.99"),
    (pool("a.b"), "a ServingPool name must be a DNS-1035 label"),
    (pool("1pool"), "a ServingPool name must be a DNS-1035 label"),
    (pool("p", runner={"tolerations": [{"key": "gpu", "operator": "Bogus", "effect": "Nope"}]}),
     'tolerations[0].operator: Unsupported value: "Bogus"'),
    (pool("p", scheduler={"tolerations": [{"key": "gpu", "effect": "Sometimes"}]}),
     'tolerations[0].effect: Unsupported value: "Sometimes"'),
    (pool("p", runner={"env": [{"value": "no name"}]}), "spec.runner.env[0].name: Required value"),
    (pool("p", runner={"resources": {"requests": {"cpu": "lots"}}}), "spec.runner.resources.requests.cpu"),
    (pool("p", scheduler={"resources": {"limits": {"memory": "2 GB"}}}), "spec.scheduler.resources.limits.memory"),
    (pool("p", nodeGroup={"apiVersion": "a/v1", "kind": "K", "name": "nodes", "gpusPerNode": 1,
                          "minReplicas": 5, "maxReplicas": 2}),
     "nodeGroup.minReplicas must not exceed nodeGroup.maxReplicas"),
])
def test_the_api_server_refuses_pools_whose_objects_could_not_be_created(plane, obj, error):
    out = server_dry_run(plane, obj)
    assert error in out, out


def test_the_api_server_accepts_well_formed_tolerations_env_and_quantities(plane):
    obj = pool("p", runner={"kvFraction": 0.5,
                            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                                            {"key": "a", "operator": "Equal", "value": "b", "tolerationSeconds": 30}],
                            "env": [{"name": "A", "value": "b"},
                                    {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                            "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": 2}}},
                nodeGroup={"apiVersion": "a/v1", "kind": "K", "name": "nodes", "gpusPerNode": 1, "maxReplicas": 2})
    out = plane.kubectl("apply", "--dry-run=server", "-o", "yaml", "-f", "-", input=yaml.safe_dump(obj))
    runner = yaml.safe_load(out)["spec"]["runner"]
    assert runner["tolerations"][1]["tolerationSeconds"] == 30
    assert runner["env"][1]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert runner["resources"]["limits"] == {"cpu": 2}


def _get(plane, plural: str, name: str, api_version: str = c.API_VERSION) -> dict | None:
    from lorafleet.common.kubeclient import api_path

    return plane.get(api_path(api_version, plural, "ml", name))


def _condition(obj: dict | None, type_: str) -> dict:
    conds = ((obj or {}).get("status") or {}).get("conditions") or ()
    return next((x for x in conds if x["type"] == type_), {})


def _events(plane, name: str, reason: str) -> list[dict]:
    items = (plane.get("/api/v1/namespaces/ml/events") or {}).get("items") or ()
    return [e for e in items if (e.get("involvedObject") or {}).get("name") == name and e.get("reason") == reason]


async def test_objects_the_api_server_refuses_are_reported_once_and_retried_only_at_resync(
        plane, scheduler, monkeypatch, caplog):
    """A node selector key the CRD allows but a Deployment does not: Ready False (ApplyFailed) with the
    server's words, one event and one log line over several resyncs; fixing the spec heals the pool."""
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("KUBECONFIG", str(plane.kubeconfig))
    async with running_operator(test_config(scheduler)):
        plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(pool("sel", runner={"nodeSelector": {"gpu type": "h200"}})))
        ready = await wait_for(lambda: _condition(_get(plane, c.POOLS, "sel"), "Ready").get("reason") == "ApplyFailed"
                               and _condition(_get(plane, c.POOLS, "sel"), "Ready"), 30, "Ready False (ApplyFailed)")
        assert ready["status"] == "False"
        assert "the API server refused the pool's objects" in ready["message"] and "gpu type" in ready["message"]
        assert _condition(_get(plane, c.POOLS, "sel"), "Degraded")["status"] == "True"
        await asyncio.sleep(3.5)  # a dozen looks of the pool (0.2 s) and three resyncs (1 s)
        assert len(_events(plane, "sel", "ApplyFailed")) == 1, _events(plane, "sel", "ApplyFailed")
        said = [r.getMessage() for r in caplog.records if "refused the pool's objects" in r.getMessage()]
        assert len(said) == 1, said
        assert not [r.getMessage() for r in caplog.records
                    if "pool look failed" in r.getMessage() or "failed temporarily" in r.getMessage()]

        plane.kubectl("patch", "servingpool", "sel", "-n", "ml", "--type", "merge",
                      "-p", '{"spec": {"runner": {"nodeSelector": {"gpu type": null, "gpu": "h200"}}}}')
        runner = await wait_for(lambda: _get(plane, "deployments", "sel-runner", "apps/v1"), 30, "the runner Deployment")
        assert runner["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h200"}
        await wait_for(lambda: _condition(_get(plane, c.POOLS, "sel"), "Ready").get("reason") not in (None, "ApplyFailed"),
                       30, "the refusal cleared from the status")
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_sources_that_do_not_parse_are_reported_in_the_status_without_a_traceback(
        plane, scheduler, monkeypatch, caplog):
    """The CRD's pattern lets these through; the operator says what is wrong instead of crashing a handler."""
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("KUBECONFIG", str(plane.kubeconfig))
    adapter = {"apiVersion": c.API_VERSION, "kind": c.ADAPTER_KIND, "metadata": {"name": "v6", "namespace": "ml"},
               "spec": {"pool": "good", "source": "https://[::1/loras/a"}}
    async with running_operator(test_config(scheduler)):
        plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([
            pool("claim", model={"source": "pvc://Models_Claim/llama"}),
            pool("good", model={"source": "pvc://models/llama"}), adapter]))
        status = await wait_for(lambda: (_get(plane, c.POOLS, "claim") or {}).get("status", {}).get("message")
                                and _get(plane, c.POOLS, "claim")["status"], 30, "the pool's status")
        assert "'Models_Claim' is not a valid PersistentVolumeClaim name" in status["message"]
        assert _condition(_get(plane, c.POOLS, "claim"), "Ready")["reason"] == "InvalidSpec"
        assert _get(plane, "deployments", "claim-scheduler", "apps/v1") is None
        st = await wait_for(lambda: (_get(plane, c.ADAPTERS, "v6") or {}).get("status", {}).get("phase")
                            and _get(plane, c.ADAPTERS, "v6")["status"], 30, "the adapter's status")
        assert (st["phase"], st["reason"], st["retryable"]) == ("Failed", "InvalidSource", False), st
        assert "Invalid IPv6 URL" in st["message"]
        await asyncio.sleep(1.0)
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]

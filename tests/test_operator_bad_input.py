"""Hostile specs and awkward lifecycles against a real control plane (`../shared/envtest`; skipped with the
reason without it): what the API server refuses, what the operator reports in the status and one event, and
that a pool is never half built nor its adapters' verdicts left stale when the pool changes."""
# ruff: noqa: F811  (the scheduler fixture comes from opkit and is requested by name)

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import AsyncIterator

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "operator"))
from opkit import (TINY_CONFIG, plane, running_operator, scheduler, test_config, wait_for,  # noqa: E402,F401
                   write_adapter)

from lorafleet.common.kubeclient import api_path  # noqa: E402
from lorafleet.operator import constants as c  # noqa: E402
from lorafleet.operator.spec import SpecError, parse_pool  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)

NS = "ml"


@contextlib.asynccontextmanager
async def operating(plane, scheduler, monkeypatch) -> AsyncIterator[None]:
    """The real operator against the plane; what a test created is deleted (through the operator) after it."""
    monkeypatch.setenv("KUBECONFIG", str(plane.kubeconfig))
    async with running_operator(test_config(scheduler)):
        yield
        plane.kubectl("delete", "loraadapters,servingpools", "--all", "-n", NS, "--wait=false")
        await wait_for(lambda: not _items(plane, c.ADAPTERS) and not _items(plane, c.POOLS), 30, "the objects gone")


def _items(plane, plural: str) -> list[dict]:
    return (plane.get(api_path(c.API_VERSION, plural, NS)) or {}).get("items") or []


def pool(name: str, **spec) -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.POOL_KIND, "metadata": {"name": name, "namespace": NS},
            "spec": {"model": {"source": "pvc://models/llama"}, **spec}}


def adapter(name: str, source: str, pool_name: str) -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.ADAPTER_KIND, "metadata": {"name": name, "namespace": NS},
            "spec": {"pool": pool_name, "source": source}}


def apply(plane, *objs: dict) -> None:
    plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))


def merge(plane, kind: str, name: str, patch: dict) -> None:
    plane.kubectl("patch", kind, name, "-n", NS, "--type", "merge", "-p", json.dumps(patch))


def get(plane, plural: str, name: str, api_version: str = c.API_VERSION) -> dict | None:
    return plane.get(api_path(api_version, plural, NS, name))


def condition(plane, name: str, type_: str) -> dict:
    conds = ((get(plane, c.POOLS, name) or {}).get("status") or {}).get("conditions") or ()
    return next((x for x in conds if x["type"] == type_), {})


def events(plane, name: str, reason: str | None = None) -> list[dict]:
    items = (plane.get(f"/api/v1/namespaces/{NS}/events") or {}).get("items") or ()
    return [e for e in items if (e.get("involvedObject") or {}).get("name") == name
            and reason in (None, e.get("reason"))]


def adapter_status(plane, name: str) -> dict:
    return (get(plane, c.ADAPTERS, name) or {}).get("status") or {}


async def phase(plane, name: str, want: str) -> dict:
    """The adapter's status once its phase is `want`."""
    def reached() -> dict | None:
        status = adapter_status(plane, name)
        return status if status.get("phase") == want else None

    return await wait_for(reached, 30, f"{name} {want}")


def dry_run(plane, obj: dict) -> str:
    return plane.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(obj), check=False)


# --- admission -------------------------------------------------------------------------------------


REFUSED_ENV = [
    ({"runner": {"env": [{"name": "POD_IP", "value": "10.0.0.1"}]}},
     "runner.env must not set LORAFLEET_RUNNER_ID, POD_IP, LORAFLEET_RUNNER_TOKEN"),
    ({"runner": {"env": [{"name": "LORAFLEET_RUNNER_TOKEN", "value": "guess"}]}}, "the operator sets them"),
    ({"scheduler": {"env": [{"name": "HOME", "value": "/root"}]}},
     "scheduler.env must not set LORAFLEET_ADMIN_TOKEN, LORAFLEET_RUNNER_TOKEN, HOME"),
    ({"runner": {"env": [{"name": "HF_HOME", "value": "/a"}, {"name": "HF_HOME", "value": "/b"}]}},
     'spec.runner.env[1]: Duplicate value: {"name":"HF_HOME"}'),
]


def test_env_the_operator_sets_itself_or_sets_twice_is_refused_at_admission(plane):
    for spec, error in REFUSED_ENV:
        out = dry_run(plane, pool("p", **spec))
        assert error in out, out
    # The user's own variables, including names the operator sets only in the other container, are admitted.
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/a"}]
    out = dry_run(plane, pool("p", runner={"env": env}, scheduler={"env": [{"name": "POD_IP", "value": "x"}]}))
    assert "created (server dry run)" in out, out


@pytest.mark.parametrize("spec, words", [
    ({"runner": {"env": [{"name": "LORAFLEET_CACHE", "value": "/x"}]}}, "runner.env sets LORAFLEET_CACHE"),
    ({"scheduler": {"env": [{"name": "LORAFLEET_ADMIN_TOKEN", "value": "x"}]}}, "scheduler.env sets LORAFLEET_ADMIN"),
    ({"scheduler": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}}, "sets A more than once"),
])
def test_the_operator_refuses_env_it_sets_itself_without_the_crd(spec, words):
    with pytest.raises(SpecError, match=words):
        parse_pool("p", NS, {"model": {"source": "hf://org/model"}, **spec})


@pytest.mark.parametrize("name", ["Llama", "llama_2", "llama.2", "-llama"])
def test_an_adapter_naming_a_pool_that_cannot_exist_is_refused_at_admission(plane, name):
    out = dry_run(plane, adapter("a", "hf://org/lora", name))
    assert "spec.pool in body should match" in out, out


# --- applying a pool: all or nothing -------------------------------------------------------------


async def test_a_pool_whose_runner_deployment_is_refused_gets_no_objects_at_all(plane, scheduler, monkeypatch):
    async with operating(plane, scheduler, monkeypatch):
        apply(plane, pool("half", runner={"priorityClassName": "Bad Class"}))
        await wait_for(lambda: condition(plane, "half", "Ready").get("reason") == "ApplyFailed", 30, "Ready False")
        assert 'Deployment.apps "half-runner" is invalid' in condition(plane, "half", "Ready")["message"]
        for plural, name in (("deployments", "half-scheduler"), ("deployments", "half-runner")):
            assert get(plane, plural, name, "apps/v1") is None, name
        for plural, name in (("services", "half-scheduler"), ("serviceaccounts", "half-runner")):
            assert get(plane, plural, name, "v1") is None, name


async def test_a_refused_change_leaves_the_running_pool_as_it_was(plane, scheduler, monkeypatch):
    async with operating(plane, scheduler, monkeypatch):
        apply(plane, pool("upd"))
        sched = await wait_for(lambda: get(plane, "deployments", "upd-scheduler", "apps/v1"), 30, "the scheduler")
        merge(plane, "servingpool", "upd", {"spec": {"model": {"source": "pvc://models/llama-13b"},
                                                     "runner": {"priorityClassName": "Bad Class"}}})
        await wait_for(lambda: condition(plane, "upd", "Ready").get("reason") == "ApplyFailed", 30, "Ready False")
        await asyncio.sleep(1.5)  # looks and a resync
        now = get(plane, "deployments", "upd-scheduler", "apps/v1")
        assert "pvc://models/llama" in now["spec"]["template"]["spec"]["containers"][0]["args"]
        assert now["metadata"]["generation"] == sched["metadata"]["generation"]
        runner = get(plane, "deployments", "upd-runner", "apps/v1")
        assert "pvc://models/llama-13b" not in runner["spec"]["template"]["spec"]["containers"][0]["args"]


# --- what the API server and the cluster say after the apply --------------------------------------


async def test_pods_the_api_server_refuses_are_reported_in_the_status_and_one_event(plane, scheduler, monkeypatch):
    async with operating(plane, scheduler, monkeypatch):
        apply(plane, pool("prio", runner={"priorityClassName": "no-such-class"}))
        degraded = await wait_for(lambda: condition(plane, "prio", "Degraded").get("reason") == "PodCreationFailed"
                                  and condition(plane, "prio", "Degraded"), 30, "Degraded (PodCreationFailed)")
        assert degraded["status"] == "True"
        assert "Deployment prio-runner cannot create pods" in degraded["message"]
        assert "no PriorityClass with name no-such-class" in degraded["message"]
        assert condition(plane, "prio", "Progressing")["status"] == "False"
        await wait_for(lambda: events(plane, "prio", "PodCreationFailed"), 10, "the PodCreationFailed event")
        await asyncio.sleep(1.5)  # several looks of the pool
        assert len(events(plane, "prio", "PodCreationFailed")) == 1, events(plane, "prio", "PodCreationFailed")


@pytest.mark.parametrize("name, group, words", [
    ("ng-missing", {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gpu-nodes"},
     "Deployment ml/gpu-nodes not found"),
    ("ng-unserved", {"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "MachineDeployment", "name": "gpu-nodes"},
     "does not serve kind MachineDeployment in cluster.x-k8s.io/v1beta1"),
])
async def test_a_node_group_that_cannot_be_read_is_reported_and_not_scaled(plane, scheduler, monkeypatch, name, group,
                                                                          words):
    async with operating(plane, scheduler, monkeypatch):
        apply(plane, pool(name, nodeGroup={**group, "gpusPerNode": 1}))
        degraded = await wait_for(lambda: condition(plane, name, "Degraded").get("reason") == "NodeGroupUnavailable"
                                  and condition(plane, name, "Degraded"), 30, "Degraded (NodeGroupUnavailable)")
        assert f"node group {group['kind']}/gpu-nodes cannot be read" in degraded["message"]
        assert words in degraded["message"]
        await wait_for(lambda: events(plane, name, "NodeGroupUnavailable"), 10, "the NodeGroupUnavailable event")
        await asyncio.sleep(1.5)  # several looks of the pool
        assert get(plane, c.POOLS, name)["status"].get("nodeGroupReplicas") is None
        assert events(plane, name, "Autoscaled") == []
        assert len(events(plane, name, "NodeGroupUnavailable")) == 1


async def test_lowering_max_runners_removes_runners_that_never_came_up(plane, scheduler, monkeypatch):
    """No kubelet here: the runner pods stay Pending, so none can be drained; they hold no requests and go."""
    def replicas() -> int | None:
        return ((get(plane, "deployments", "cap-runner", "apps/v1") or {}).get("spec") or {}).get("replicas")

    async with operating(plane, scheduler, monkeypatch):
        apply(plane, pool("cap", minRunners=3, maxRunners=4))
        await wait_for(lambda: replicas() == 3, 30, "three runners")
        merge(plane, "servingpool", "cap", {"spec": {"minRunners": 1, "maxRunners": 1}})
        await wait_for(lambda: replicas() == 1, 30, "one runner after maxRunners was lowered to 1")
        await wait_for(lambda: get(plane, c.POOLS, "cap")["status"].get("runners") == 1, 30, "status.runners 1")
        await wait_for(lambda: events(plane, "cap", "Autoscaled"), 10, "the Autoscaled event")
        await asyncio.sleep(1.0)  # (more looks of the pool: nothing else to do)
        said = [e["message"] for e in events(plane, "cap", "Autoscaled")]
        assert said == ["runners 3 -> 1"], said


# --- adapters follow their pool ------------------------------------------------------------------


async def test_raising_max_lora_rank_admits_an_adapter_refused_for_its_rank(plane, scheduler, monkeypatch):
    async with operating(plane, scheduler, monkeypatch):
        files = scheduler.files
        write_adapter(files / "loras" / "r8", rank=8)
        base = f"{scheduler.url}/files"
        apply(plane, pool("rk", model={"source": f"{base}/models/tiny"}, runner={"maxLoraRank": 4}),
              adapter("r8", f"{base}/loras/r8", "rk"))
        st = await phase(plane, "r8", "Failed")
        assert (st["reason"], st["retryable"]) == ("RankTooHigh", False), st
        merge(plane, "servingpool", "rk", {"spec": {"runner": {"maxLoraRank": 16}}})
        st = await phase(plane, "r8", "Ready")  # (with no change to the adapter)
        assert st["rank"] == 8 and st["checkedAgainst"]["maxLoraRank"] == 16


async def test_a_ready_adapter_is_checked_again_when_its_pool_changes_model(plane, scheduler, monkeypatch):
    async with operating(plane, scheduler, monkeypatch):
        files = scheduler.files
        write_adapter(files / "loras" / "r4", rank=4)
        (files / "models" / "wide").mkdir()
        (files / "models" / "wide" / "config.json").write_text(json.dumps({**TINY_CONFIG, "hidden_size": 32,
                                                                           "_name_or_path": "wide-llama"}))
        base = f"{scheduler.url}/files"
        apply(plane, pool("mdl", model={"source": f"{base}/models/tiny"}), adapter("r4", f"{base}/loras/r4", "mdl"))
        await phase(plane, "r4", "Ready")
        merge(plane, "servingpool", "mdl", {"spec": {"model": {"source": f"{base}/models/wide"}}})
        st = await phase(plane, "r4", "Failed")
        assert st["reason"] == "InvalidAdapter" and "do not fit the base model" in st["message"], st
        await wait_for(lambda: events(plane, "r4", "InvalidAdapter"), 10, "the InvalidAdapter event")
        assert [e["reason"] for e in events(plane, "r4") if e["type"] == "Warning"] == ["InvalidAdapter"]


def test_a_ready_adapter_is_fetched_again_for_a_new_model_not_for_a_new_rank_limit():
    """A changed maxLoraRank is `recheck`'s for a Ready adapter (no fetch: a blip must not fail a served adapter);
    a changed model or pool needs the full check; a status from before `checkedAgainst` existed is not a change."""
    from lorafleet.operator import validation

    was = {"checkedAgainst": {"pool": "p", "model": "hf://a/b", "maxLoraRank": 8}}
    rank = {"pool": "p", "model": "hf://a/b", "maxLoraRank": 16}
    model = {"pool": "p", "model": "hf://a/c", "maxLoraRank": 8}
    assert validation.pool_changed(was, rank) and not validation.pool_changed(was, rank, model_only=True)
    assert validation.pool_changed(was, model) and validation.pool_changed(was, model, model_only=True)
    assert not validation.pool_changed(was, dict(was["checkedAgainst"]))
    assert not validation.pool_changed({}, model)

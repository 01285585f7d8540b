"""Hostile specs and awkward lifecycles against a real control plane (`../shared/envtest`; skipped with the
reason without it): what the API server refuses, what the operator reports in the status and one event, and
that a pool is never half built nor its adapters' verdicts left stale when the pool changes."""
# ruff: noqa: F811  (the scheduler fixture comes from opkit and is requested by name)

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import sys
import urllib.parse
from pathlib import Path
from typing import AsyncIterator

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent / "operator"))
from opkit import (TINY_CONFIG, plane, running_operator, runner_state, scheduler, test_config,  # noqa: E402,F401
                   wait_for, write_adapter)

from lorafleet.common.kubeclient import ApiError, api_path  # noqa: E402
from lorafleet.operator import constants as c  # noqa: E402
from lorafleet.operator import pools, reconcile  # noqa: E402
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
        assert len(said) == 1 and said[0].startswith("runners 3 -> 1"), said


def runner_pods(plane, pool_name: str) -> list[dict]:
    """The pool's runner pods that are not being deleted, by name."""
    query = urllib.parse.quote(c.label_selector(pool_name, c.COMPONENT_RUNNER))
    items = (plane.get(f"/api/v1/namespaces/{NS}/pods?labelSelector={query}") or {}).get("items") or ()
    return sorted((p for p in items if not p["metadata"].get("deletionTimestamp")), key=lambda p: p["metadata"]["name"])


def play_kubelet(plane, pod: dict, ready: bool, ready_since: str) -> None:
    """The status a kubelet writes: the runner container started at 10:00:00, its Ready condition as given."""
    started = "2026-01-01T10:00:00Z"
    ctr = pod["spec"]["containers"][0]
    status = {"phase": "Running", "startTime": started,
              "conditions": [{"type": "Ready", "status": str(ready), "lastTransitionTime": ready_since}],
              "containerStatuses": [{"name": ctr["name"], "image": ctr["image"], "imageID": "", "ready": ready,
                                     "restartCount": 0, "started": True, "state": {"running": {"startedAt": started}}}]}
    plane.request("PATCH", api_path("v1", "pods", NS, pod["metadata"]["name"], "status"), {"status": status})


async def test_lowering_max_runners_cuts_a_runner_that_fails_its_readiness_probe_at_once(plane, scheduler,
                                                                                        monkeypatch):
    """One runner is Ready and busy, one passed its readiness probe and fails it now, one never came up. The
    scheduler routes only to Ready runners and re-places an unready one's requests (scheduler/cluster.py `_leave`),
    so neither unready runner holds anything: lowered to one runner, both go at once and the busy one stays,
    undrained (draining it would leave the pool above maxRunners with a runner that cannot be drained)."""
    def replicas() -> int | None:
        return ((get(plane, "deployments", "lapse-runner", "apps/v1") or {}).get("spec") or {}).get("replicas")

    async with operating(plane, scheduler, monkeypatch):
        apply(plane, pool("lapse", minRunners=3, maxRunners=4))
        await wait_for(lambda: len(runner_pods(plane, "lapse")) == 3, 30, "three runner pods")
        up, lapsed, _ = runner_pods(plane, "lapse")
        play_kubelet(plane, up, True, "2026-01-01T10:01:00Z")
        play_kubelet(plane, lapsed, False, "2026-01-01T10:30:00Z")  # after it passed the probe
        up_name = up["metadata"]["name"]
        scheduler.state = {"runners": [runner_state(up_name, batch=3)], "queue_length": 0}
        merge(plane, "servingpool", "lapse", {"spec": {"minRunners": 1, "maxRunners": 1}})
        await wait_for(lambda: replicas() == 1, 30, "one runner after maxRunners was lowered to 1")
        await wait_for(lambda: [p["metadata"]["name"] for p in runner_pods(plane, "lapse")] == [up_name], 30,
                       "the two unready runners gone, the Ready one kept")
        await asyncio.sleep(1.0)  # (more looks of the pool)
        assert replicas() == 1
        assert not any(call[1].endswith("/drain") for call in scheduler.calls), scheduler.calls
        said = [e["message"] for e in events(plane, "lapse", "Autoscaled")]
        assert len(said) == 1 and said[0].startswith("runners 3 -> 1"), said


async def test_a_drained_runner_gone_before_its_removal_still_lowers_the_replicas(plane, scheduler, monkeypatch):
    """A drained, empty runner's pod goes (evicted, deleted by hand) between the operator's look and its act: the
    Deployment still drops by one (a replacement the ReplicaSet made meanwhile is not Ready and goes first), the
    status counts what the Deployment holds, and the event says the pod was already gone."""
    def replicas() -> int | None:
        return ((get(plane, "deployments", "gone-runner", "apps/v1") or {}).get("spec") or {}).get("replicas")

    look, vanish = reconcile.look, []

    async def look_then_delete(ctx, spec, admin):  # the drained pod goes right after the look that will remove it
        current = await look(ctx, spec, admin)
        seen = current.observation.runners if spec.name == "gone" and current.observation else ()
        if vanish and any(r.id == vanish[0] and r.draining for r in seen):
            plane.kubectl("delete", "pod", vanish.pop(), "-n", NS, "--wait=false")
        return current

    monkeypatch.setattr(reconcile, "look", look_then_delete)
    async with operating(plane, scheduler, monkeypatch):
        apply(plane, pool("gone", minRunners=2, maxRunners=3))
        await wait_for(lambda: len(runner_pods(plane, "gone")) == 2, 30, "two runner pods")
        busy, drained = (p["metadata"]["name"] for p in runner_pods(plane, "gone"))
        for p in runner_pods(plane, "gone"):
            play_kubelet(plane, p, True, "2026-01-01T10:01:00Z")
        scheduler.state = {"runners": [runner_state(busy, batch=3), runner_state(drained, idle=100_000)],
                           "queue_length": 0}
        vanish.append(drained)
        merge(plane, "servingpool", "gone", {"spec": {"minRunners": 1}})
        await wait_for(lambda: replicas() == 1, 30, "one runner after the drained one went")
        await wait_for(lambda: get(plane, c.POOLS, "gone")["status"].get("runners") == 1, 30, "status.runners 1")
        await wait_for(lambda: [p["metadata"]["name"] for p in runner_pods(plane, "gone")] == [busy], 30,
                       "only the busy runner left")
        assert not vanish, "the idle runner was never drained"
        line = f"runners 2 -> 1 ({drained} already gone)"
        await wait_for(lambda: line in [e["message"] for e in events(plane, "gone", "Autoscaled")], 10,
                       f"the event {line!r}")


def record_statuses(monkeypatch, name: str, written: list) -> None:
    """pools.patch_status wrapped: each status the operator writes for pool `name` is appended to `written`."""
    write = pools.patch_status

    async def recorded(ctx, plural, obj_name, namespace, old, new):
        if (plural, obj_name) == (c.POOLS, name):
            written.append(new)
        await write(ctx, plural, obj_name, namespace, old, new)

    monkeypatch.setattr(pools, "patch_status", recorded)


async def test_a_runner_deployment_gone_before_it_is_scaled_is_not_counted(plane, scheduler, monkeypatch):
    """The runner Deployment goes (deleted by hand) between the operator's look, which found it scaled below the
    fixed pool's two runners, and the scale: the status written for that round counts no runners, never the
    replicas it could not set, and the event says why; the next round puts the Deployment back with two."""
    look, written, vanish = reconcile.look, [], []

    async def look_then_delete(ctx, spec, admin):  # the Deployment goes right after the look that will scale it
        current = await look(ctx, spec, admin)
        if spec.name == "novanish" and vanish and current.runner_deployment_exists:
            plane.kubectl("delete", "deployment", vanish.pop(), "-n", NS, "--wait=true")
            written.append("deleted")
            return dataclasses.replace(current, replicas=1)  # as if scaled down by hand: the round sets it to 2
        return current

    monkeypatch.setattr(reconcile, "look", look_then_delete)
    record_statuses(monkeypatch, "novanish", written)
    async with operating(plane, scheduler, monkeypatch):
        apply(plane, pool("novanish", minRunners=2, maxRunners=2, autoscaling={"enabled": False}))
        await wait_for(lambda: ((get(plane, "deployments", "novanish-runner", "apps/v1") or {}).get("spec") or {})
                       .get("replicas") == 2, 30, "the runner Deployment")
        vanish.append("novanish-runner")
        await wait_for(lambda: not vanish and "deleted" in written
                       and len(written) > written.index("deleted") + 1, 30, "a status written after the deletion")
        after = written[written.index("deleted") + 1]
        assert after.get("runners") == 0, after
        line = "runners 1 -> 2 not set: the runner Deployment is gone"
        await wait_for(lambda: line in [e["message"] for e in events(plane, "novanish", "Autoscaled")], 10,
                       f"the event {line!r}")
        await wait_for(lambda: ((get(plane, "deployments", "novanish-runner", "apps/v1") or {}).get("spec") or {})
                       .get("replicas") == 2, 30, "the Deployment back with two runners")
        await wait_for(lambda: get(plane, c.POOLS, "novanish")["status"].get("runners") == 2, 30, "status.runners 2")


# --- node groups that fail between the look and the scale ---------------------------------------


async def test_a_node_group_gone_before_it_is_scaled_is_reported_never_its_target(plane, scheduler, monkeypatch):
    plane.kubectl("create", "deployment", "gone-nodes", "--image=registry.k8s.io/pause:3.9", "--replicas=0", "-n", NS)
    look, written = reconcile.look, []

    async def look_then_delete(ctx, spec, admin):  # the node group goes right after the pool's look read it
        current = await look(ctx, spec, admin)
        if spec.name == "vanish" and current.node_group_replicas is not None:
            plane.kubectl("delete", "deployment", "gone-nodes", "-n", NS, "--wait=false")
        return current

    monkeypatch.setattr(reconcile, "look", look_then_delete)
    record_statuses(monkeypatch, "vanish", written)
    async with operating(plane, scheduler, monkeypatch):
        apply(plane, pool("vanish", nodeGroup={"apiVersion": "apps/v1", "kind": "Deployment", "name": "gone-nodes",
                                               "gpusPerNode": 1}))
        await wait_for(lambda: condition(plane, "vanish", "Degraded").get("reason") == "NodeGroupUnavailable", 30,
                       "Degraded (NodeGroupUnavailable)")
        await asyncio.sleep(1.0)  # (more looks of the pool)
        # The status written right after the failed scale already says it, and never shows the target (1 node).
        first = next(st for st in written if st.get("nodeGroupReplicas") != 0)
        degraded = next(x for x in first["conditions"] if x["type"] == "Degraded")
        assert (first["nodeGroupReplicas"], degraded["status"], degraded["reason"]) == \
            (None, "True", "NodeGroupUnavailable"), first
        assert degraded["message"] == "node group Deployment/gone-nodes cannot be scaled: Deployment ml/gone-nodes " \
            "not found", degraded
        assert all(st.get("nodeGroupReplicas") in (0, None) for st in written), written
        assert not any("node group" in e["message"] for e in events(plane, "vanish", "Autoscaled"))
        assert len(events(plane, "vanish", "NodeGroupUnavailable")) == 1


async def test_a_node_group_read_failing_for_a_round_or_two_is_no_fault_but_one_failing_on_is(plane, scheduler,
                                                                                                 monkeypatch):
    """The API server answers 503 to the node group's read (overloaded, restarting): for a round or two the pool
    keeps its last known nodeGroupReplicas and says nothing; from the third round in a row it is Degraded."""
    plane.kubectl("create", "deployment", "blip-nodes", "--image=registry.k8s.io/pause:3.9", "--replicas=1", "-n", NS)
    read, written, plan, failed = reconcile.node_group_replicas, [], [], []

    async def flaky(ctx, spec):
        if spec.name == "blip" and plan and plan[0] != "ok":
            if plan[0] == "twice":
                failed.append(len(written))
                if len(failed) == 2:
                    plan[0] = "ok"
            else:
                failed.append(len(written))
            raise ApiError(503, "ServiceUnavailable", "the API server is restarting")
        return await read(ctx, spec)

    def said(st: dict) -> tuple:
        degraded = next((x for x in st.get("conditions") or () if x["type"] == "Degraded"), {})
        return st.get("nodeGroupReplicas"), degraded.get("reason")

    monkeypatch.setattr(reconcile, "node_group_replicas", flaky)
    record_statuses(monkeypatch, "blip", written)
    async with operating(plane, scheduler, monkeypatch):
        apply(plane, pool("blip", nodeGroup={"apiVersion": "apps/v1", "kind": "Deployment", "name": "blip-nodes",
                                             "gpusPerNode": 1}))
        await wait_for(lambda: (get(plane, c.POOLS, "blip") or {}).get("status", {}).get("nodeGroupReplicas") == 1,
                       30, "nodeGroupReplicas 1")
        plan.append("twice")
        await wait_for(lambda: len(failed) == 2, 30, "two failed reads")
        start = failed[0]
        await wait_for(lambda: len(written) > failed[1] + 3, 30, "more looks of the pool")
        assert [said(st) for st in written[start:]] == [(1, "AsExpected")] * len(written[start:]), written[start:]
        assert not events(plane, "blip", "NodeGroupUnavailable")
        plan[0] = "always"
        await wait_for(lambda: condition(plane, "blip", "Degraded").get("reason") == "NodeGroupUnavailable", 30,
                       "Degraded (NodeGroupUnavailable) once the reads keep failing")
        first = next(i for i, st in enumerate(written) if said(st)[1] == "NodeGroupUnavailable")
        misses = [i for i in failed[2:] if i <= first]
        assert len(misses) == reconcile.NODE_GROUP_PATIENCE, (misses, first)
        assert said(written[first]) == (None, "NodeGroupUnavailable"), written[first]
        assert "cannot be read: the API server is restarting" in condition(plane, "blip", "Degraded")["message"]
        await wait_for(lambda: len(events(plane, "blip", "NodeGroupUnavailable")) == 1, 10, "one warning event")


async def test_a_node_group_whose_scale_is_refused_is_reported_with_what_it_holds(plane, scheduler, monkeypatch):
    plane.kubectl("create", "deployment", "frozen-nodes", "--image=registry.k8s.io/pause:3.9", "--replicas=0",
                  "-n", NS)
    admission = "admissionregistration.k8s.io/v1"
    refuse = {"apiVersion": admission, "kind": "ValidatingAdmissionPolicy", "metadata": {"name": "frozen-nodes"},
              "spec": {"failurePolicy": "Fail",
                       "matchConstraints": {"resourceRules": [{"apiGroups": ["apps"], "apiVersions": ["v1"],
                                                               "operations": ["UPDATE"],
                                                               "resources": ["deployments/scale"]}]},
                       "validations": [{"expression": "object.metadata.name != 'frozen-nodes'",
                                        "message": "frozen-nodes keeps its size"}]}}
    binding = {"apiVersion": admission, "kind": "ValidatingAdmissionPolicyBinding",
               "metadata": {"name": "frozen-nodes"},
               "spec": {"policyName": "frozen-nodes", "validationActions": ["Deny"]}}
    apply(plane, refuse, binding)
    try:
        await wait_for(lambda: "keeps its size" in plane.kubectl("scale", "deployment/frozen-nodes", "--replicas=1",
                                                                 "-n", NS, "--dry-run=server", check=False),
                       30, "the admission policy in force")
        async with operating(plane, scheduler, monkeypatch):
            apply(plane, pool("frozen", nodeGroup={"apiVersion": "apps/v1", "kind": "Deployment",
                                                   "name": "frozen-nodes", "gpusPerNode": 1}))
            degraded = await wait_for(lambda: condition(plane, "frozen", "Degraded").get("reason")
                                      == "NodeGroupUnavailable" and condition(plane, "frozen", "Degraded"), 30,
                                      "Degraded (NodeGroupUnavailable)")
            assert degraded["message"].startswith("node group Deployment/frozen-nodes cannot be scaled: "), degraded
            assert "frozen-nodes keeps its size" in degraded["message"], degraded
            await asyncio.sleep(1.5)  # several looks and refused scales
            assert get(plane, c.POOLS, "frozen")["status"]["nodeGroupReplicas"] == 0  # what it holds, not 1
            assert not any("node group" in e["message"] for e in events(plane, "frozen", "Autoscaled"))
            assert len(events(plane, "frozen", "NodeGroupUnavailable")) == 1
    finally:
        plane.kubectl("delete", "validatingadmissionpolicybinding/frozen-nodes",
                      "validatingadmissionpolicy/frozen-nodes")
        plane.kubectl("delete", "deployment", "frozen-nodes", "-n", NS, "--ignore-not-found")


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


async def test_verdicts_from_before_checked_against_are_checked_once_more_against_their_pool(plane, scheduler,
                                                                                              monkeypatch):
    """An operator from before `status.checkedAgainst` left verdicts without it, and a pool changed its model
    meanwhile: the pool each verdict was reached against is unknown, so each adapter is checked once more (the one
    whose pool changed fails), then carries `checkedAgainst` and is not fetched again."""
    files = scheduler.files
    for name in ("kept", "moved"):
        write_adapter(files / "loras" / name, rank=4)
    (files / "models" / "wide").mkdir()
    (files / "models" / "wide" / "config.json").write_text(json.dumps({**TINY_CONFIG, "hidden_size": 32,
                                                                       "_name_or_path": "wide-llama"}))
    base = f"{scheduler.url}/files"
    tiny = {"source": f"{base}/models/tiny"}
    monkeypatch.setenv("KUBECONFIG", str(plane.kubeconfig))
    async with running_operator(test_config(scheduler)):
        apply(plane, pool("kept", model=tiny), pool("moved", model=tiny),
              adapter("old-kept", f"{base}/loras/kept", "kept"), adapter("old-moved", f"{base}/loras/moved", "moved"))
        for name in ("old-kept", "old-moved"):
            await phase(plane, name, "Ready")
    # What the older operator left behind: no checkedAgainst; and a pool changed its model while it ran.
    for name in ("old-kept", "old-moved"):
        plane.request("PATCH", api_path(c.API_VERSION, c.ADAPTERS, NS, name, "status"),
                      {"status": {"checkedAgainst": None}})
        assert "checkedAgainst" not in adapter_status(plane, name)
    merge(plane, "servingpool", "moved", {"spec": {"model": {"source": f"{base}/models/wide"}}})

    def fetches() -> int:
        return sum(1 for path in scheduler.fetched if path.startswith("/files/loras/"))

    async with operating(plane, scheduler, monkeypatch):
        st = await phase(plane, "old-moved", "Failed")
        assert st["reason"] == "InvalidAdapter" and "do not fit the base model" in st["message"], st
        assert st["checkedAgainst"] == {"pool": "moved", "model": f"{base}/models/wide", "maxLoraRank": 64}, st
        kept = await wait_for(lambda: adapter_status(plane, "old-kept").get("checkedAgainst")
                              and adapter_status(plane, "old-kept"), 30, "old-kept checked once more")
        assert kept["phase"] == "Ready" and kept["checkedAgainst"]["model"] == f"{base}/models/tiny", kept
        seen = fetches()
        await asyncio.sleep(1.5)  # five rounds of the adapters' loop
        assert fetches() == seen  # no storm: checked once, then as any adapter
        # Such a Ready verdict whose check cannot be made now (its source gone: a retryable 404) stays Ready, served,
        # not failed by a blip; it is tried again each round.
        shutil.rmtree(files / "loras" / "kept")
        before = len(scheduler.fetched)
        plane.request("PATCH", api_path(c.API_VERSION, c.ADAPTERS, NS, "old-kept", "status"),
                      {"status": {"checkedAgainst": None}})
        gone = "/files/loras/kept"
        await wait_for(lambda: sum(p.startswith(gone) for p in scheduler.fetched[before:]) >= 2, 30, "fetches tried")
        st = adapter_status(plane, "old-kept")
        assert st["phase"] == "Ready" and "checkedAgainst" not in st, st


def test_a_ready_adapter_is_fetched_again_for_a_new_model_not_for_a_new_rank_limit():
    """A changed maxLoraRank is `recheck`'s for a Ready adapter (no fetch: a blip must not fail a served adapter);
    a changed model or pool needs the full check; a verdict from before `checkedAgainst` existed was reached against
    a pool unknown now, which is a change too (once: the new verdict carries `checkedAgainst`)."""
    from lorafleet.operator import validation

    was = {"checkedAgainst": {"pool": "p", "model": "hf://a/b", "maxLoraRank": 8}}
    rank = {"pool": "p", "model": "hf://a/b", "maxLoraRank": 16}
    model = {"pool": "p", "model": "hf://a/c", "maxLoraRank": 8}
    assert validation.pool_changed(was, rank) and not validation.pool_changed(was, rank, model_only=True)
    assert validation.pool_changed(was, model) and validation.pool_changed(was, model, model_only=True)
    assert not validation.pool_changed(was, dict(was["checkedAgainst"]))
    for before in ({}, {"phase": "Ready", "rank": 4}, {"checkedAgainst": None}):
        assert validation.pool_changed(before, model) and validation.pool_changed(before, model, model_only=True)
        assert validation.pool_changed(before, None)
    verdict = validation.Verdict(validation.READY, "Validated", "files read", rank=4)
    after = verdict.status({"phase": "Ready", "rank": 4}, generation=1, source="hf://x/y", now="t",
                           checked_against=model)
    assert not validation.pool_changed(after, model) and not validation.pool_changed(after, model, model_only=True)

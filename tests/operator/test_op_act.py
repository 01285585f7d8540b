"""reconcile.autoscale's acting half against a scripted API: a scale-up decided from a look whose runner Deployment
is deleted before the scale. The replicas are reported not set, the round counts no runners, records no scale-up
in the history (whose cooldown would then hold back the real one) and leaves the node group as it is."""

from __future__ import annotations

import pytest

from lorafleet.operator import reconcile
from lorafleet.operator.autoscale import History, Observation, RunnerState
from lorafleet.operator.spec import parse_pool

pytestmark = pytest.mark.timeout(30)


class ScriptedKube:
    """The API calls autoscale makes: scale subresource patches, answered 404 (None) for the runner Deployment when
    `gone`, else as set."""

    def __init__(self, gone: bool):
        self.gone, self.patches = gone, []

    async def patch(self, api_version, plural, name, body, namespace=None, subresource=None, **kw):
        self.patches.append((plural, name, subresource, body))
        if (plural, name) == ("deployments", "p-runner") and self.gone:
            return None
        return {"spec": body.get("spec", {})}

    async def plural_of(self, api_version, kind):
        return "deployments"


class Admin:
    async def drain(self, rid):
        raise AssertionError("nothing to drain in a scale-up")

    async def undrain(self, rid):
        raise AssertionError("nothing to take back")


@pytest.mark.parametrize("gone", [False, True])
async def test_a_scale_up_whose_runner_deployment_went_is_not_counted(gone):
    pool = parse_pool("p", "ns", {"model": {"source": "hf://org/model"}, "minRunners": 1, "maxRunners": 4,
                                  "autoscaling": {"scaleUpDelaySeconds": 0},
                                  "nodeGroup": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "nodes",
                                                "gpusPerNode": 1, "minReplicas": 0, "maxReplicas": 4}})
    busy = RunnerState("p-runner-a", healthy=True, draining=False, batch_size=32, max_batch_size=32,
                       free_kv_tokens=0, total_kv_tokens=1000, idle_seconds=0.0)
    obs = Observation(runners=(busy,), queue_length=100, replicas=1, pods=("p-runner-a",), ready_pods=1)
    look = reconcile.Look(replicas=1, observation=obs, scheduler_available=True, scheduler_error=None,
                          node_group_replicas=1, runner_deployment_exists=True)
    kube = ScriptedKube(gone)
    ctx = reconcile.Context.__new__(reconcile.Context)  # (only `kube` is used on this path)
    ctx.kube = kube
    before = History(queued_since=0.0)
    got = await reconcile.autoscale(ctx, pool, Admin(), look, before, now=100.0)
    assert got.decision is not None and got.decision.replicas == 3  # the decision: two more runners
    runner_patch = [p for p in kube.patches if p[:2] == ("deployments", "p-runner")]
    assert runner_patch == [("deployments", "p-runner", "scale", {"spec": {"replicas": 3}})]
    node_patch = [p for p in kube.patches if p[:2] == ("deployments", "nodes")]
    if gone:
        assert got.replicas == 0 and got.history == before and not node_patch and got.node_group_replicas == 1
        assert got.actions == [f"runners 1 -> 3 not set: {reconcile.GONE}"], got.actions
    else:
        assert got.replicas == 3 and got.history.last_scale_up == 100.0 and got.actions[0] == "runners 1 -> 3"
        assert node_patch == [("deployments", "nodes", "scale", {"spec": {"replicas": 3}})]

"""The real kopf operator against the API mock: what it does and says while a pool's scheduler
cannot be reached (node-group floor, user-facing messages), and a quiet log on deletion and
shutdown (no cancelled daemons, one base-model warning)."""
# ruff: noqa: F811  (the k8s and scheduler fixtures come from opkit and are requested by name)

from __future__ import annotations

import asyncio
import logging

import pytest
from opkit import (  # noqa: F401  (fixtures)
    adapter_body,
    adapters_path,
    api,
    free_port,
    k8s,
    pool_body,
    pools_path,
    running_operator,
    scheduler,
    test_config,
    wait_for,
)

from lorafleet.operator import constants as c

pytestmark = pytest.mark.timeout(90)

NODE_GROUP = {"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "MachineDeployment", "name": "gpu-nodes",
              "gpusPerNode": 4, "minReplicas": 2}
RAW_EXCEPTION_WORDS = ("Error(", "Errno", "aiohttp", "ClientConnector", "Traceback", "Exception")


def replicas(k8s, plural, name):
    obj = k8s.obj(plural, "ml", name)
    return obj and obj["spec"].get("replicas")


async def test_node_group_minimum_holds_while_the_scheduler_is_unreachable(k8s, scheduler):
    await api(k8s, "POST", "/apis/cluster.x-k8s.io/v1beta1/namespaces/ml/machinedeployments",
              {"apiVersion": "cluster.x-k8s.io/v1beta1", "kind": "MachineDeployment",
               "metadata": {"name": "gpu-nodes", "namespace": "ml"}, "spec": {"replicas": 0}})
    # Nothing listens where the operator looks for the scheduler.
    config = test_config(scheduler, scheduler_url=f"http://127.0.0.1:{free_port()}")
    async with running_operator(config):
        await api(k8s, "POST", pools_path(), pool_body(minRunners=3, maxRunners=6, nodeGroup=NODE_GROUP,
                                                       runner={"gpusPerRunner": 2}))
        # minRunners 3 x 2 GPUs on 4-GPU nodes = 2 nodes, also the group's own minimum.
        await wait_for(lambda: replicas(k8s, "machinedeployments", "gpu-nodes") == 2, what="node group at its floor")
        await api(k8s, "PATCH", pools_path(name="llama"), {"spec": {"minRunners": 5}}, "application/merge-patch+json")
        await wait_for(lambda: replicas(k8s, "machinedeployments", "gpu-nodes") == 3, what="floor of 5 runners")
        await wait_for(lambda: replicas(k8s, "deployments", "llama-runner") == 5, what="5 runners")

        def unreachable():
            status = (k8s.obj(c.POOLS, "ml", "llama") or {}).get("status") or {}
            conds = {x["type"]: x for x in status.get("conditions") or ()}
            return conds.get("Degraded", {}).get("reason") == "SchedulerUnreachable" and conds["Degraded"]

        await api(k8s, "PATCH", "/apis/apps/v1/namespaces/ml/deployments/llama-scheduler/status",
                  {"status": {"availableReplicas": 1}}, "application/merge-patch+json")
        cond = await wait_for(unreachable, what="Degraded: SchedulerUnreachable")
        assert cond["message"] == "the pool's scheduler is not reachable: the connection was refused (is its pod running?)"
        # Never shrunk below the floor without the scheduler's view.
        await asyncio.sleep(0.5)
        assert replicas(k8s, "machinedeployments", "gpu-nodes") == 3


async def test_adapter_messages_carry_no_exception_text(k8s, scheduler):
    config = test_config(scheduler, scheduler_url=f"http://127.0.0.1:{free_port()}")
    async with running_operator(config):
        await api(k8s, "POST", pools_path(), pool_body(adapterVolumes=["adapters"]))
        await api(k8s, "POST", adapters_path(), adapter_body("legal", "pvc://adapters/legal"))

        def pending():
            status = (k8s.obj(c.ADAPTERS, "ml", "legal") or {}).get("status") or {}
            return status.get("phase") == "Pending" and status

        status = await wait_for(pending, what="adapter Pending")
        assert status["reason"] == "WaitingForRunner"
        assert status["message"] == ("waiting for a ready runner to read it from its volume (the pool's scheduler "
                                     "is not reachable: the connection was refused (is its pod running?))")
        assert not any(w in status["message"] for w in RAW_EXCEPTION_WORDS)


async def test_deletion_and_shutdown_cancel_no_daemon_and_warn_once(k8s, scheduler, caplog):
    caplog.set_level(logging.INFO)
    # A base model whose server stalls 1 s and hangs up: the pool's first handlers read it at the same
    # time, and the operator says it once.

    async def stall(reader, writer):
        await asyncio.sleep(1.0)
        writer.close()

    server = await asyncio.start_server(stall, "127.0.0.1", 0)
    dead = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/models/llama"
    write = scheduler.files / "loras" / "a"
    write.mkdir(parents=True)
    async with server, running_operator(test_config(scheduler)):
        await api(k8s, "POST", pools_path(), pool_body(model={"source": dead}))
        await api(k8s, "POST", adapters_path(), adapter_body("a", f"{scheduler.url}/files/loras/a"))
        await wait_for(lambda: k8s.obj("deployments", "ml", "llama-runner"), what="runner Deployment")
        await wait_for(lambda: ((k8s.obj(c.ADAPTERS, "ml", "a") or {}).get("status") or {}).get("phase"),
                       what="adapter checked")
        await asyncio.sleep(1.0)  # several looks of the pool and retries of the adapter
        await api(k8s, "DELETE", adapters_path(name="a"))
        await wait_for(lambda: k8s.obj(c.ADAPTERS, "ml", "a") is None, what="adapter gone")
        await api(k8s, "DELETE", pools_path(name="llama"))
        await wait_for(lambda: k8s.obj(c.POOLS, "ml", "llama") is None, what="pool gone")
        # A second pool is running when the operator stops.
        await api(k8s, "POST", pools_path(), pool_body(name="other"))
        await wait_for(lambda: k8s.obj("deployments", "ml", "other-runner"), what="other pool applied")
        await asyncio.sleep(0.5)
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "Will escalate" in m or "did not exit in time" in m]
    shape = [m for m in messages if "base model shape unknown" in m]
    assert len(shape) == 1, shape
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records
                                                                            if r.levelno >= logging.ERROR]

"""`kubectl apply -f manifests/` parses the examples and posts them (against the API mock)."""
# ruff: noqa: F811  (the k8s and scheduler fixtures come from opkit and are requested by name)

from __future__ import annotations

import asyncio
import shutil

import pytest
from opkit import (
    REPO,
    k8s,  # noqa: F401  (fixtures)
)

from lorafleet.operator import constants as c

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")]


async def kubectl(k8s, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        "kubectl", "--kubeconfig", str(k8s.kubeconfig), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, out.decode()
    return out.decode()


async def test_kubectl_apply_manifests(k8s):
    out = await kubectl(k8s, "apply", "--validate=false", "-f", str(REPO / "manifests"))
    assert "servingpool.lorafleet.dev/llama-2-7b created" in out
    assert "loraadapter.lorafleet.dev/sql-lora created" in out
    pool = k8s.obj(c.POOLS, "ml", "llama-2-7b")
    assert pool["spec"]["model"]["source"] == "hf://meta-llama/Llama-2-7b-hf"
    assert pool["spec"]["runner"]["gpusPerRunner"] == 1
    assert k8s.obj(c.ADAPTERS, "ml", "sql-lora")["spec"]["pool"] == "llama-2-7b"

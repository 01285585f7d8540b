"""Session fixtures of the tests on a real control plane (skipped with the reason when it cannot run).

One control plane serves all the modules of this folder; it is stopped as soon as the last of
their tests is done (not at the end of the whole session), so the rest of the suite runs
without it. Its processes exit in the background while the next tests run; the session waits
for them at its end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from controlplane import ControlPlane, Unavailable
from envkit import Cluster

HERE = Path(__file__).parent
_running: list = []  # what to stop, last started first
_stopping: list = []  # stop scripts of control planes still running


def _stop_all() -> None:
    while _running:
        done = _running.pop()
        if isinstance(done, ControlPlane):
            _stopping.append(done.stop(wait=False))
        else:
            done.stop()


def pytest_sessionfinish(session, exitstatus):
    while _stopping:
        _stopping.pop().wait(60)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if nextitem is None or HERE not in Path(str(nextitem.path)).parents:
        _stop_all()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    try:
        plane = ControlPlane.start(tmp_path_factory.mktemp("kube"))
    except Unavailable as exc:
        pytest.skip(f"no Kubernetes control plane for the envtest suite: {exc}")
    _running.append(plane)
    yield plane
    _stop_all()


@pytest.fixture(scope="session")
def cluster(control_plane, tmp_path_factory):
    """The control plane plus the process kubelet and the loopback kube-proxy."""
    c = Cluster(control_plane, tmp_path_factory.mktemp("node"), set(),
                extra_env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    c.start()
    _running.append(c)
    yield c
    _stop_all()


OPERATOR_NS = "lorafleet-system"
RELEASE = "lf"


@pytest.fixture(scope="session")
def release(cluster, helm):
    """`helm install` of the chart, with short intervals; the operator runs as a pod (a process)."""
    from controlplane import REPO
    from envkit import wait_for
    from helm_helpers import run_helm

    cluster.manage(OPERATOR_NS)
    out = run_helm(helm, "--kubeconfig", str(cluster.plane.kubeconfig), "install", RELEASE,
                   str(REPO / "charts" / "lorafleet"), "--namespace", OPERATOR_NS,
                   "--set", "operator.syncIntervalSeconds=1", "--set", "operator.resyncIntervalSeconds=3",
                   "--set", "operator.adapterRetrySeconds=1",
                   # Adapter sources are served on loopback in these tests.
                   "--set", "operator.extraEnv[0].name=LORAFLEET_ALLOW_PRIVATE_SOURCES",
                   "--set-string", "operator.extraEnv[0].value=1",
                   "--wait", "--timeout", "120s", timeout=180)
    pods = wait_for(lambda: [p for p in cluster.pods(OPERATOR_NS, f"app.kubernetes.io/instance={RELEASE}")
                             if any(c["type"] == "Ready" and c["status"] == "True"
                                    for c in (p.get("status") or {}).get("conditions") or ())],
                    60, "the operator pod Ready", on_timeout=lambda: cluster.logs(RELEASE))
    yield {"namespace": OPERATOR_NS, "name": RELEASE, "helm_output": out.stdout, "operator_pod": pods[0]}

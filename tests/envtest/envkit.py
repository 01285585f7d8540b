"""One test cluster: the control plane, the process kubelet and the loopback kube-proxy together,
plus small synchronous helpers (API calls, kubectl, helm, bounded waits)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import yaml
from controlplane import ControlPlane
from kubelet import Kubelet
from kubeproxy import KubeProxy

from lorafleet.common.kubeclient import KubeClient, api_path


class Cluster:
    def __init__(self, plane: ControlPlane, workdir: Path, namespaces: set[str], extra_env: dict[str, str]):
        self.plane = plane
        self.hosts_file = workdir / "hosts"
        self.kubelet = Kubelet(plane.server, plane.token, plane.ca_file, workdir / "pods", namespaces,
                               extra_env=extra_env, hosts_file=self.hosts_file)
        self.proxy = KubeProxy(lambda: KubeClient(plane.server, token=plane.token, ca_file=str(plane.ca_file)),
                               self.kubelet.subnet, self.kubelet.namespaces, self.hosts_file)

    def start(self) -> None:
        self.kubelet.start()
        self.kubelet.call(self.proxy.start())

    def stop(self) -> None:
        try:
            self.kubelet.call(self.proxy.stop())
        finally:
            self.kubelet.stop()

    def manage(self, namespace: str) -> None:
        """Run this namespace's pods (and proxy its Services) too; creates the namespace."""
        self.kubelet.namespaces.add(namespace)
        if self.get("v1", "namespaces", namespace) is None:
            self.plane.request("POST", "/api/v1/namespaces",
                               {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})

    # --- API --------------------------------------------------------------------------------------

    def get(self, api_version: str, plural: str, name: str, namespace: str | None = None,
            sub: str | None = None) -> dict | None:
        return self.plane.get(api_path(api_version, plural, namespace, name, sub))

    def list(self, api_version: str, plural: str, namespace: str | None = None, selector: str | None = None) -> list:
        path = api_path(api_version, plural, namespace)
        if selector:
            path += "?labelSelector=" + selector.replace("=", "%3D").replace(",", "%2C")
        return (self.plane.get(path) or {}).get("items") or []

    def patch(self, api_version: str, plural: str, name: str, body: Any, namespace: str | None = None,
              sub: str | None = None) -> dict | None:
        return self.plane.request("PATCH", api_path(api_version, plural, namespace, name, sub), body)

    def delete(self, api_version: str, plural: str, name: str, namespace: str | None = None,
               **options: Any) -> dict | None:
        return self.plane.request("DELETE", api_path(api_version, plural, namespace, name), options or None)

    def kubectl(self, *args: str, **kw: Any) -> str:
        return self.plane.kubectl(*args, **kw)

    def apply(self, *docs: dict) -> str:
        return self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

    def events(self, namespace: str, name: str | None = None) -> list[dict]:
        items = self.list("v1", "events", namespace)
        return [e for e in items if name is None or (e.get("involvedObject") or {}).get("name") == name]

    # --- services and pods -----------------------------------------------------------------------------

    def service_url(self, namespace: str, name: str, port: int, timeout: float = 30) -> str:
        addr = wait_for(lambda: self.proxy.address(namespace, name), timeout, f"a proxy address for {name}")
        return f"http://{addr}:{port}"

    def pods(self, namespace: str, selector: str) -> list[dict]:
        return [p for p in self.list("v1", "pods", namespace, selector)]

    def logs(self, prefix: str = "") -> str:
        return self.kubelet.logs(prefix)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, period: float = 0.2,
             on_timeout: Callable[[], str] | None = None) -> Any:
    """Poll until `predicate()` is truthy (bounded); the failure names what was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = on_timeout() if on_timeout else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{extra}")
        time.sleep(period)

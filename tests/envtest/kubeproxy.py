"""A loopback kube-proxy for tests: every Service with a selector in the managed namespaces gets an
address 127.A.B.N (the kubelet's subnet, from .200 up) that listens on the Service's ports and
forwards each TCP connection to one ready endpoint, as kube-proxy does. The endpoints are the
Service's selected pods that are Ready and not terminating, read at each connection: what the
EndpointSlices would hold, which kube-controller-manager cannot write here because the API
refuses loopback endpoint addresses.

Names: the proxy writes `ADDRESS NAME.NAMESPACE.svc NAME.NAMESPACE.svc.cluster.local` lines to a
hosts file; the kubelet gives pods its path as LORAFLEET_HOSTS_FILE, which the operator's HTTP
client consults (common/hosts.py), standing in for cluster DNS. Tests use `address()`.

It runs on the kubelet's loop (same thread).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from podspec import PodSpecError, container_port

from lorafleet.common.kubeclient import ApiError, KubeClient


class KubeProxy:
    def __init__(self, kube_factory, subnet: str, namespaces: set[str], hosts_file: Path):
        self._kube_factory = kube_factory
        self.kube: KubeClient | None = None
        self.namespaces = namespaces
        self.hosts_file = hosts_file
        self.free = [f"{subnet}.{n}" for n in range(200, 255)]
        self.services: dict[tuple[str, str], tuple[str, list[asyncio.AbstractServer]]] = {}
        self.connections = 0
        self.errors: list[str] = []
        self.task: asyncio.Task | None = None
        hosts_file.write_text("# services of the test cluster\n")

    async def start(self) -> None:
        self.kube = self._kube_factory()
        self.task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        for _, servers in self.services.values():
            for s in servers:
                s.close()
        if self.kube:
            await self.kube.close()

    def address(self, namespace: str, name: str) -> str | None:
        entry = self.services.get((namespace, name))
        return entry[0] if entry else None

    async def _watch(self) -> None:
        assert self.kube
        while True:
            try:
                listing = await self.kube.list("v1", "services")
                seen = set()
                for svc in listing.get("items") or ():
                    seen.add(await self._service("ADDED", svc))
                for key in set(self.services) - seen:
                    self._close(key)
                rv = (listing.get("metadata") or {}).get("resourceVersion")
                async for ev in self.kube.watch("v1", "services", resource_version=rv, timeout_s=120):
                    if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        await self._service(ev["type"], ev["object"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.errors.append(f"service watch: {exc!r}")
                await asyncio.sleep(0.5)

    async def _service(self, kind: str, svc: dict) -> tuple[str, str] | None:
        meta, spec = svc["metadata"], svc.get("spec") or {}
        key = (meta["namespace"], meta["name"])
        if meta["namespace"] not in self.namespaces or not spec.get("selector") or spec.get("clusterIP") == "None":
            return None
        if kind == "DELETED":
            self._close(key)
            return None
        if key in self.services:
            return key
        addr = self.free.pop(0)
        servers = []
        for port in spec.get("ports") or ():
            if port.get("protocol", "TCP") != "TCP":
                continue
            handler = self._handler(key, dict(spec["selector"]), port)
            servers.append(await asyncio.start_server(handler, addr, int(port["port"])))
        self.services[key] = (addr, servers)
        self._write_hosts()
        return key

    def _close(self, key: tuple[str, str]) -> None:
        entry = self.services.pop(key, None)
        if entry:
            for s in entry[1]:
                s.close()
            self.free.append(entry[0])
            self._write_hosts()

    def _write_hosts(self) -> None:
        lines = ["# services of the test cluster"]
        for (ns, name), (addr, _) in sorted(self.services.items()):
            lines.append(f"{addr} {name}.{ns}.svc {name}.{ns}.svc.cluster.local")
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.hosts_file)

    async def _endpoint(self, key: tuple[str, str], selector: dict, port: dict) -> tuple[str, int] | None:
        """A ready endpoint of the Service's port: a Ready, not terminating pod it selects."""
        assert self.kube
        ns, name = key
        try:
            pods = await self.kube.list("v1", "pods", ns, label_selector=",".join(f"{k}={v}" for k, v in selector.items()))
        except ApiError as exc:
            self.errors.append(f"endpoints of {name}: {exc}")
            return None
        choices = []
        target = port.get("targetPort", port["port"])
        for pod in pods.get("items") or ():
            status = pod.get("status") or {}
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
            if not ready or pod["metadata"].get("deletionTimestamp") or not status.get("podIP"):
                continue
            try:
                number = container_port(pod["spec"]["containers"][0], target)
            except PodSpecError:
                continue
            choices.append((status["podIP"], number))
        return random.choice(choices) if choices else None

    def _handler(self, key: tuple[str, str], selector: dict, port: dict):
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            target = await self._endpoint(key, selector, port)
            if target is None:  # no ready endpoint: refuse, as kube-proxy rejects
                writer.close()
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(*target)
            except OSError:
                writer.close()
                return
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)

        return handle


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except RuntimeError:
            pass

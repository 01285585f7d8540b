"""A process kubelet for tests: runs the pods of some namespaces as local processes.

What it does, as a kubelet would (and what differs):

- registers a Node (Ready, with `nvidia.com/gpu` capacity) and renews its Lease;
- binds every pending pod of the managed namespaces to that Node (there is no kube-scheduler);
- starts each pod's (first) container command as a local process on the pod's own loopback
  address 127.A.B.N, with its env (values, `$(VAR)`, downward-API fieldRefs such as
  `status.podIP`, Secret/ConfigMap refs), its volumes (emptyDir, secret, configMap, projected
  ServiceAccount token) as folders, and the mount paths in its args/env remapped to them
  (see podspec.py); the image is ignored: `lorafleet` is this interpreter's console script;
- in-cluster API access: KUBERNETES_SERVICE_HOST/PORT point at the API server and, when the
  pod mounts a ServiceAccount token (a TokenRequest bound to the pod), LORAFLEET_SERVICEACCOUNT_DIR
  names the folder that stands for /var/run/secrets/kubernetes.io/serviceaccount;
- patches the pod status: Running with podIP, Ready while its readiness probe (httpGet) passes,
  probed every `probe_period` seconds whatever the pod says; restarts a container that exits
  (restartPolicy Always, short backoff); liveness and startup probes are not run;
- on graceful deletion: SIGTERM, then SIGKILL after the grace period (capped by `max_grace`),
  then removes the pod object; a pod removed outright is killed at once.

All of it runs on an asyncio loop in its own thread; the test thread calls the public methods.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable

import aiohttp
from podspec import PodSpecError, command_line, container_env, container_port, field_ref, remap_paths

from lorafleet.common.kubeclient import ApiError, KubeClient

SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class PodProcess:
    namespace: str
    name: str
    uid: str
    ip: str
    dir: Path
    pod: dict
    proc: subprocess.Popen | None = None
    ready: bool = False
    restarts: int = 0
    deleting: bool = False
    exit_codes: list[int] = field(default_factory=list)
    started_at: str = ""
    task: asyncio.Task | None = None

    @property
    def log(self) -> Path:
        return self.dir / "container.log"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Kubelet:
    def __init__(self, server: str, token: str, ca_file: Path, workdir: Path, namespaces: set[str], *,
                 node: str = "envtest-node", extra_env: dict[str, str] | None = None, probe_period: float = 0.5,
                 max_grace: float = 30.0, hosts_file: Path | None = None):
        self.server, self.token, self.ca_file = server, token, ca_file
        self.workdir, self.namespaces, self.node = workdir, set(namespaces), node
        self.extra_env = dict(extra_env or {})
        self.probe_period, self.max_grace = probe_period, max_grace
        self.hosts_file = hosts_file
        # Pods get 127.A.B.N: a random /24 of the loopback range, so parallel test runs do not meet.
        self.subnet = f"127.{random.randint(100, 250)}.{random.randint(1, 250)}"
        self.free_ips = [f"{self.subnet}.{n}" for n in range(2, 200)]
        self.pods: dict[str, PodProcess] = {}  # uid -> process
        self.gone: list[PodProcess] = []  # pods that ended, for their logs
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="process-kubelet", daemon=True)
        self.kube: KubeClient | None = None
        self.http: aiohttp.ClientSession | None = None
        self.tasks: list[asyncio.Task] = []
        self.errors: list[str] = []

    # --- control from the test thread ------------------------------------------------------------

    def start(self) -> None:
        self.thread.start()
        self.call(self._start(), timeout=60)

    def stop(self) -> None:
        try:
            self.call(self._stop(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def call(self, coro: Awaitable[Any], timeout: float = 30) -> Any:
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        return fut.result(timeout)

    def running(self, namespace: str | None = None) -> dict[str, PodProcess]:
        """name -> process of the pods running now (optionally of one namespace)."""
        return {p.name: p for p in list(self.pods.values()) if namespace in (None, p.namespace) and not p.deleting}

    def find(self, name: str) -> PodProcess | None:
        for p in list(self.pods.values()) + self.gone:
            if p.name == name:
                return p
        return None

    def logs(self, prefix: str = "") -> str:
        """The tail of every container log whose pod name starts with `prefix` (for failure messages)."""
        parts = []
        for p in list(self.pods.values()) + self.gone:
            if p.name.startswith(prefix):
                parts.append(f"--- {p.namespace}/{p.name} ({p.ip}) exits={p.exit_codes}\n{p.log_tail(2000)}")
        return "\n".join(parts)

    # --- lifecycle ------------------------------------------------------------------------------

    async def _start(self) -> None:
        self.kube = KubeClient(self.server, token=self.token, ca_file=str(self.ca_file), timeout=30)
        self.http = aiohttp.ClientSession()
        await self._register_node()
        self.tasks.append(asyncio.create_task(self._heartbeat()))
        self.tasks.append(asyncio.create_task(self._watch_pods()))

    async def _stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(self._kill(p, grace=2.0) for p in list(self.pods.values())), return_exceptions=True)
        runs = [p.task for p in self.gone if p.task is not None and not p.task.done()]
        for t in runs:
            t.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
        if self.http:
            await self.http.close()
        if self.kube:
            await self.kube.close()

    async def _register_node(self) -> None:
        assert self.kube
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.node, "labels": {"kubernetes.io/hostname": self.node,
                                                           "kubernetes.io/os": "linux"}}}
        try:
            await self.kube.create(node)
        except ApiError as exc:
            if exc.status != 409:
                raise
        capacity = {"cpu": "64", "memory": "512Gi", "pods": "250", "nvidia.com/gpu": "8"}
        await self.kube.patch("v1", "nodes", self.node, {"status": {
            "capacity": capacity, "allocatable": capacity,
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": self.node}],
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "process kubelet",
                            "lastHeartbeatTime": _now(), "lastTransitionTime": _now()}],
            "nodeInfo": {"kubeletVersion": "v1.36.2", "operatingSystem": "linux", "architecture": "amd64",
                         "containerRuntimeVersion": "process://", "kernelVersion": "", "osImage": "", "machineID": "",
                         "systemUUID": "", "bootID": "", "kubeProxyVersion": ""}}}, subresource="status")

    async def _heartbeat(self) -> None:
        assert self.kube
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                 "metadata": {"name": self.node, "namespace": "kube-node-lease"},
                 "spec": {"holderIdentity": self.node, "leaseDurationSeconds": 40}}
        while True:
            try:
                lease["spec"]["renewTime"] = _micro_now()
                await self.kube.apply(lease, "process-kubelet")
                await self.kube.patch("v1", "nodes", self.node, {"status": {"conditions": [
                    {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "process kubelet",
                     "lastHeartbeatTime": _now()}]}}, subresource="status")
            except Exception as exc:  # keep beating; a missed beat is not fatal
                self.errors.append(f"heartbeat: {exc!r}")
            await asyncio.sleep(10)

    # --- pods -----------------------------------------------------------------------------------

    async def _watch_pods(self) -> None:
        assert self.kube
        while True:
            try:
                listing = await self.kube.list("v1", "pods")
                for pod in listing.get("items") or ():
                    await self._seen("ADDED", pod)
                rv = (listing.get("metadata") or {}).get("resourceVersion")
                async for ev in self.kube.watch("v1", "pods", resource_version=rv, timeout_s=120):
                    if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        await self._seen(ev["type"], ev["object"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.errors.append(f"pod watch: {exc!r}")
                await asyncio.sleep(0.5)

    async def _seen(self, kind: str, pod: dict) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        if meta.get("namespace") not in self.namespaces:
            return
        uid = meta["uid"]
        known = self.pods.get(uid)
        if kind == "DELETED":
            if known is not None and not known.deleting:
                known.deleting = True
                asyncio.create_task(self._kill(known, grace=0.5))
            return
        if not spec.get("nodeName"):
            if not meta.get("deletionTimestamp"):
                await self._bind(pod)
            return
        if spec["nodeName"] != self.node:
            return
        if meta.get("deletionTimestamp"):
            if known is not None and not known.deleting:
                known.deleting = True
                grace = float(meta.get("deletionGracePeriodSeconds") or 0)
                asyncio.create_task(self._terminate(known, grace))
            elif known is None and (pod.get("status") or {}).get("phase") != "Running":
                await self._finalize(meta["namespace"], meta["name"], uid)
            return
        if known is None and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            if not self.free_ips:
                self.errors.append("out of pod addresses")
                return
            p = PodProcess(meta["namespace"], meta["name"], uid, self.free_ips.pop(0),
                           self.workdir / f"{meta['namespace']}-{meta['name']}-{uid[:6]}", pod)
            self.pods[uid] = p
            p.task = asyncio.create_task(self._run(p))

    async def _bind(self, pod: dict) -> None:
        assert self.kube
        meta = pod["metadata"]
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": self.node}}
        try:
            await self.kube.request("POST", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding",
                                    body=body)
        except ApiError as exc:
            if exc.status not in (404, 409):
                self.errors.append(f"bind {meta['name']}: {exc}")

    # --- one pod --------------------------------------------------------------------------------

    async def _lookup_data(self, namespace: str, kind: str, name: str) -> dict[str, str] | None:
        assert self.kube
        plural = "secrets" if kind == "secret" else "configmaps"
        obj = await self.kube.get("v1", plural, name, namespace)
        if obj is None:
            return None
        if kind == "secret":
            return {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        return dict(obj.get("data") or {})

    async def _referenced(self, p: PodProcess, ctr: dict) -> dict[tuple[str, str], dict[str, str] | None]:
        """Every Secret and ConfigMap the container's env refers to, read once."""
        refs: set[tuple[str, str]] = set()
        for src in ctr.get("envFrom") or ():
            if src.get("secretRef"):
                refs.add(("secret", src["secretRef"]["name"]))
            if src.get("configMapRef"):
                refs.add(("configmap", src["configMapRef"]["name"]))
        for item in ctr.get("env") or ():
            vf = item.get("valueFrom") or {}
            if "secretKeyRef" in vf:
                refs.add(("secret", vf["secretKeyRef"]["name"]))
            if "configMapKeyRef" in vf:
                refs.add(("configmap", vf["configMapKeyRef"]["name"]))
        return {r: await self._lookup_data(p.namespace, *r) for r in refs}

    async def _volumes(self, p: PodProcess) -> dict[str, str]:
        """Make each volume a folder; return volume name -> folder."""
        assert self.kube
        spec = p.pod.get("spec") or {}
        out: dict[str, str] = {}
        for vol in spec.get("volumes") or ():
            folder = p.dir / "volumes" / vol["name"]
            folder.mkdir(parents=True, exist_ok=True)
            out[vol["name"]] = str(folder)
            files: dict[str, str] = {}
            if "secret" in vol or "configMap" in vol:
                kind, src = ("secret", vol["secret"]) if "secret" in vol else ("configmap", vol["configMap"])
                name = src.get("secretName") or src.get("name")
                data = await self._lookup_data(p.namespace, kind, name)
                if data is None and not src.get("optional"):
                    raise PodSpecError(f"{kind} {name!r} of volume {vol['name']!r} not found")
                items = src.get("items")
                files = {i["path"]: (data or {})[i["key"]] for i in items} if items else dict(data or {})
            elif "projected" in vol:
                for source in vol["projected"].get("sources") or ():
                    if "serviceAccountToken" in source:
                        files[source["serviceAccountToken"]["path"]] = await self._token(p, source["serviceAccountToken"])
                    elif "configMap" in source or "secret" in source:
                        kind, src = ("configmap", source["configMap"]) if "configMap" in source \
                            else ("secret", source["secret"])
                        data = await self._lookup_data(p.namespace, kind, src["name"]) or {}
                        for i in src.get("items") or [{"key": k, "path": k} for k in data]:
                            if i["key"] in data:
                                files[i["path"]] = data[i["key"]]
                    elif "downwardAPI" in source:
                        for i in source["downwardAPI"].get("items") or ():
                            files[i["path"]] = field_ref(p.pod, i["fieldRef"]["fieldPath"], p.ip)
            elif "emptyDir" not in vol:
                raise PodSpecError(f"volume {vol['name']!r}: only emptyDir, secret, configMap and projected volumes "
                                   "can be given to a process")
            for rel, text in files.items():
                path = folder / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                path.chmod(0o600)
        return out

    async def _token(self, p: PodProcess, source: dict) -> str:
        assert self.kube
        sa = (p.pod.get("spec") or {}).get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": int(source.get("expirationSeconds") or 3600),
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": p.name, "uid": p.uid}}}
        if source.get("audience"):
            body["spec"]["audiences"] = [source["audience"]]
        answer = await self.kube.request("POST", f"/api/v1/namespaces/{p.namespace}/serviceaccounts/{sa}/token",
                                         body=body)
        return answer["status"]["token"]

    async def _prepare(self, p: PodProcess) -> tuple[list[str], dict[str, str], dict]:
        ctr = (p.pod.get("spec") or {}).get("containers", [{}])[0]
        p.dir.mkdir(parents=True, exist_ok=True)
        (p.dir / "home").mkdir(exist_ok=True)
        volumes = await self._volumes(p)
        mounts = {m["mountPath"].rstrip("/"): volumes[m["name"]] + (("/" + m["subPath"]) if m.get("subPath") else "")
                  for m in ctr.get("volumeMounts") or ()}
        data = await self._referenced(p, ctr)

        def lookup(kind: str, name: str, key: str | None) -> Any:
            d = data.get((kind, name))
            if d is None or key is None:
                return d
            return d.get(key)

        cenv = {k: remap_paths(v, mounts) for k, v in container_env(p.pod, ctr, p.ip, lookup).items()}
        port = self.server.rsplit(":", 1)[1]
        env = {
            "PATH": os.path.dirname(sys.executable) + os.pathsep + "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(p.dir / "home"),
            "LANG": os.environ.get("LANG", "C.UTF-8"),
            "PYTHONUNBUFFERED": "1",
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": port,
            "KUBECONFIG": str(p.dir / "no-kubeconfig"),  # never the user's own
            **self.extra_env,
        }
        if self.hosts_file is not None:
            env["LORAFLEET_HOSTS_FILE"] = str(self.hosts_file)
        if SA_MOUNT in mounts:
            env["LORAFLEET_SERVICEACCOUNT_DIR"] = mounts[SA_MOUNT]
        env.update(cenv)
        argv = command_line(ctr, env, p.ip, mounts)
        exe = shutil.which(argv[0], path=env["PATH"])
        if exe is None:
            raise PodSpecError(f"command {argv[0]!r} not found")
        return [exe, *argv[1:]], env, ctr

    async def _run(self, p: PodProcess) -> None:
        """Start the pod's process, keep its status, restart it when it exits."""
        try:
            argv, env, ctr = await self._prepare(p)
        except (PodSpecError, ApiError, OSError, KeyError) as exc:
            await self._patch_status(p, phase="Pending", waiting=("CreateContainerConfigError", str(exc)))
            self.errors.append(f"{p.name}: {exc}")
            await asyncio.sleep(1.0)
            if not p.deleting:  # the Secret may come later: try again from the top
                self.pods.pop(p.uid, None)
                self.free_ips.append(p.ip)
            return
        backoff = 0.5
        while not p.deleting:
            with open(p.log, "ab") as log:
                log.write(f"=== {_now()} start: {' '.join(argv)}\n".encode())
                log.flush()
                p.proc = subprocess.Popen(argv, env=env, cwd=str(p.dir), stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
            p.started_at, p.ready = _now(), False
            await self._patch_status(p, phase="Running")
            probe = ctr.get("readinessProbe")
            while not p.deleting and p.proc.poll() is None:
                ready = await self._probe(p, ctr, probe) if probe else True
                if ready != p.ready:
                    p.ready = ready
                    await self._patch_status(p, phase="Running")
                await asyncio.sleep(self.probe_period)
            if p.deleting:
                return
            p.exit_codes.append(p.proc.returncode)
            p.restarts += 1
            p.ready = False
            await self._patch_status(p, phase="Running", waiting=("CrashLoopBackOff",
                                                                  f"exited with {p.proc.returncode}"))
            await asyncio.sleep(backoff)
            backoff = min(5.0, backoff * 2)

    async def _probe(self, p: PodProcess, ctr: dict, probe: dict) -> bool:
        assert self.http
        get = probe.get("httpGet")
        if not get:
            return True
        try:
            port = container_port(ctr, get.get("port"))
        except PodSpecError:
            return False
        url = f"http://{p.ip}:{port}{get.get('path') or '/'}"
        try:
            async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                return 200 <= resp.status < 400
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _patch_status(self, p: PodProcess, phase: str, waiting: tuple[str, str] | None = None) -> None:
        assert self.kube
        now = _now()
        ready = "True" if p.ready else "False"
        ctr_name = ((p.pod.get("spec") or {}).get("containers") or [{}])[0].get("name", "main")
        state: dict = {"running": {"startedAt": p.started_at}} if waiting is None else \
            {"waiting": {"reason": waiting[0], "message": waiting[1][:500]}}
        status = {
            "phase": phase, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": p.ip, "podIPs": [{"ip": p.ip}], "startTime": p.started_at or now,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": ready, "lastTransitionTime": now},
                {"type": "Ready", "status": ready, "lastTransitionTime": now},
            ],
            "containerStatuses": [{"name": ctr_name, "ready": p.ready, "started": waiting is None,
                                   "restartCount": p.restarts, "state": state,
                                   "image": ((p.pod.get("spec") or {}).get("containers") or [{}])[0].get("image", ""),
                                   "imageID": "", "containerID": f"process://{p.proc.pid if p.proc else 0}"}],
        }
        try:
            await self.kube.patch("v1", "pods", p.name, {"status": status}, p.namespace, subresource="status")
        except ApiError as exc:
            if exc.status not in (404, 409, 422):
                self.errors.append(f"status of {p.name}: {exc}")

    async def _terminate(self, p: PodProcess, grace: float) -> None:
        """Graceful deletion: SIGTERM, wait, SIGKILL; then the pod object goes."""
        await self._kill(p, grace=min(grace, self.max_grace))
        await self._finalize(p.namespace, p.name, p.uid)

    async def _kill(self, p: PodProcess, grace: float) -> None:
        p.deleting = True
        proc = p.proc
        if proc is not None and proc.poll() is None:
            _signal(proc, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                _signal(proc, signal.SIGKILL)
                while proc.poll() is None:
                    await asyncio.sleep(0.05)
            p.exit_codes.append(proc.returncode)
        if proc is not None:
            _signal(proc, signal.SIGKILL)  # what the process group left behind
        if self.pods.pop(p.uid, None) is not None:
            self.gone.append(p)
            self.free_ips.append(p.ip)

    async def _finalize(self, namespace: str, name: str, uid: str) -> None:
        assert self.kube
        try:
            await self.kube.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}",
                                    body={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})
        except ApiError as exc:
            if exc.status not in (404, 409):
                self.errors.append(f"delete {name}: {exc}")


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process group this kubelet started for the pod."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

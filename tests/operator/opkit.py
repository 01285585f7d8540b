"""Helpers of the operator tests: a Kubernetes API mock (kmock), a fake pool scheduler, adapter
files served over HTTP, and the real kopf operator running against them in the test's loop.
(The fixtures are re-exported by conftest.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import socket
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import aiohttp.web
import jsonpatch
import kmock
import pytest
import yaml

from lorafleet.operator import constants as c
from lorafleet.operator.config import OperatorConfig

REPO = Path(__file__).resolve().parents[2]


# --- kmock with the bits kopf needs ------------------------------------------------------------


class KubeMock(kmock.KubernetesEmulator):
    """kmock's emulator plus what a real API server does and kopf relies on: uid, resourceVersion
    (bumped on every write), generation (bumped on spec changes), creationTimestamp, names from
    generateName, 201 on create, 422 when a JSON patch's test fails."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.rv = 0

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _stamp(self, request: kmock.Request) -> None:
        data = request.data
        if request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:6]
            if request.namespace and not meta.get("namespace"):
                meta["namespace"] = request.namespace
            now = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
            meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), creationTimestamp=now, generation=1)
        elif request.action == kmock.action.UPDATE and request.name:
            key = (request.resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                return
            current = self.objects[key].raw
            generation = int(current.get("metadata", {}).get("generation") or 1)
            rv = self._next_rv()
            if isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = rv
                if request.subresource is None and "spec" in data:
                    meta["generation"] = generation + 1
            elif isinstance(data, list):
                data.append({"op": "add", "path": "/metadata/resourceVersion", "value": rv})
                if request.subresource is None and any(op.get("path", "").startswith("/spec") for op in data):
                    data.append({"op": "add", "path": "/metadata/generation", "value": generation + 1})

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is not None:
            self._stamp(request)
        try:
            response = await super()._handle(request)
        except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from None
        if request.action == kmock.action.CREATE and response.status == 200 and not response.prepared:
            response.set_status(201)
        return response

    # Test helpers -----------------------------------------------------------------------------

    def obj(self, plural: str, namespace: str | None, name: str) -> dict | None:
        for (res, ns, n), obj in self.objects.items():
            if res.plural == plural and ns == namespace and n == name and not obj.deleted:
                return obj.raw
        return None

    def objs(self, plural: str, namespace: str | None = None) -> list[dict]:
        return [obj.raw for (res, ns, _), obj in self.objects.items()
                if res.plural == plural and (namespace is None or ns == namespace) and not obj.deleted]


RESOURCES = {
    "lorafleet.dev/v1alpha1/servingpools": dict(kind="ServingPool", singular="servingpool", namespaced=True,
                                                 subresources={"status"}, shortnames={"sp", "pool"}),
    "lorafleet.dev/v1alpha1/loraadapters": dict(kind="LoraAdapter", singular="loraadapter", namespaced=True,
                                                 subresources={"status"}, shortnames={"lora"}),
    "v1/pods": dict(kind="Pod", singular="pod", namespaced=True, subresources={"status"}),
    "v1/services": dict(kind="Service", singular="service", namespaced=True),
    "v1/secrets": dict(kind="Secret", singular="secret", namespaced=True),
    "v1/serviceaccounts": dict(kind="ServiceAccount", singular="serviceaccount", namespaced=True),
    "v1/events": dict(kind="Event", singular="event", namespaced=True),
    "v1/persistentvolumeclaims": dict(kind="PersistentVolumeClaim", singular="persistentvolumeclaim", namespaced=True),
    "apps/v1/deployments": dict(kind="Deployment", singular="deployment", namespaced=True,
                                subresources={"status", "scale"}),
    "rbac.authorization.k8s.io/v1/roles": dict(kind="Role", singular="role", namespaced=True),
    "rbac.authorization.k8s.io/v1/rolebindings": dict(kind="RoleBinding", singular="rolebinding", namespaced=True),
    "networking.k8s.io/v1/ingresses": dict(kind="Ingress", singular="ingress", namespaced=True),
    "networking.k8s.io/v1/networkpolicies": dict(kind="NetworkPolicy", singular="networkpolicy", namespaced=True),
    "discovery.k8s.io/v1/endpointslices": dict(kind="EndpointSlice", singular="endpointslice", namespaced=True),
    # kopf waits for these two to be discoverable, even when it does not watch them.
    "apiextensions.k8s.io/v1/customresourcedefinitions": dict(kind="CustomResourceDefinition",
                                                              singular="customresourcedefinition", namespaced=False),
    "v1/namespaces": dict(kind="Namespace", singular="namespace", namespaced=False),
    "cluster.x-k8s.io/v1beta1/machinedeployments": dict(kind="MachineDeployment", singular="machinedeployment",
                                                         namespaced=True, subresources={"scale"}),
}
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


@pytest.fixture
async def k8s(tmp_path, monkeypatch) -> AsyncIterator[KubeMock]:
    """A kmock API server on loopback, with a kubeconfig pointing at it ($KUBECONFIG)."""
    async with KubeMock() as mock, kmock.Server(mock) as server:
        for res, info in RESOURCES.items():
            mock.resources[res] = kmock.ResourceInfo(verbs=VERBS, **info)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": str(server.url).rstrip("/")}}],
            "users": [{"name": "kmock", "user": {"token": "test-token"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "ml"}}],
        }))
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        mock.url_str = str(server.url).rstrip("/")
        mock.kubeconfig = kubeconfig
        yield mock


async def api(k8s: KubeMock, method: str, path: str, body: Any = None, ctype: str = "application/json") -> dict:
    """Call the mock API like kubectl would; raises on errors."""
    async with aiohttp.ClientSession() as s:
        kw = {"data": json.dumps(body), "headers": {"Content-Type": ctype}} if body is not None else {}
        async with s.request(method, k8s.url_str + path, **kw) as resp:
            text = await resp.text()
            assert resp.status < 400, f"{method} {path}: {resp.status} {text[:500]}"
            return json.loads(text) if text else {}


async def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll `predicate` (sync or async) until it returns something truthy."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# --- adapter files and a fake scheduler -------------------------------------------------------


from model_helpers import write_adapter, write_safetensors  # noqa: E402,F401  (shared with test_sources)


TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
               "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 64,
               "_name_or_path": "tiny-llama"}


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    """etcd + kube-apiserver + kube-controller-manager (`tests/envtest/controlplane.py`) with the project's CRDs and
    a namespace `ml`; the test is skipped, with the reason, where there is no control plane."""
    import sys

    sys.path.insert(0, str(REPO / "tests" / "envtest"))
    from controlplane import ControlPlane, Unavailable

    try:
        cp = ControlPlane.start(tmp_path_factory.mktemp("kube"))
    except Unavailable as exc:
        pytest.skip(f"no Kubernetes control plane: {exc}")
    try:
        cp.kubectl("apply", "-f", str(REPO / "crds"))
        cp.kubectl("wait", "--for=condition=Established", "crd/servingpools.lorafleet.dev",
                   "crd/loraadapters.lorafleet.dev", "--timeout=60s")
        cp.kubectl("create", "namespace", "ml")
        yield cp
    finally:
        cp.stop()


class FakeScheduler:
    """The admin API of docs/api.md, scripted by the test, plus static files under /files/."""

    def __init__(self, files: Path):
        self.files = files
        self.state: dict[str, Any] = {"runners": [], "queue_length": 0}
        self.validate: Callable[[dict], tuple[int, dict]] = lambda body: (503, {"error": "no healthy runner"})
        self.models: Callable[[], list[str]] = lambda: []
        self.calls: list[tuple[str, str]] = []
        self.fetched: list[str] = []  # paths of the static files served
        self.tokens: set[str] = set()
        self.url = ""
        self.key_file: Path | None = None  # the operator's credentials key (see test_config)

    def _auth(self, request: aiohttp.web.Request) -> None:
        self.tokens.add(request.headers.get("Authorization", ""))
        self.calls.append((request.method, request.path))

    async def get_state(self, request):
        self._auth(request)
        return aiohttp.web.json_response(self.state)

    async def drain(self, request):
        self._auth(request)
        rid, verb = request.match_info["id"], request.match_info["verb"]
        for r in self.state["runners"]:
            if r["id"] == rid:
                r["draining"] = verb == "drain"
                return aiohttp.web.json_response({"id": rid, "draining": r["draining"], "batch_size": r["batch_size"],
                                                  "empty": r["batch_size"] == 0})
        return aiohttp.web.json_response({"error": "unknown runner"}, status=404)

    async def validate_adapter(self, request):
        self._auth(request)
        status, body = self.validate(await request.json())
        return aiohttp.web.json_response(body, status=status)

    async def list_models(self, request):
        self.calls.append((request.method, request.path))
        return aiohttp.web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models()]})

    @aiohttp.web.middleware
    async def record_files(self, request, handler):
        if request.path.startswith("/files/"):
            self.fetched.append(request.path)
        return await handler(request)

    def app(self) -> aiohttp.web.Application:
        app = aiohttp.web.Application(middlewares=[self.record_files])
        app.router.add_get("/admin/state", self.get_state)
        app.router.add_post("/admin/runners/{id}/{verb:drain|undrain}", self.drain)
        app.router.add_post("/admin/adapters/validate", self.validate_adapter)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_static("/files/", self.files)
        return app


@pytest.fixture
async def scheduler(tmp_path) -> AsyncIterator[FakeScheduler]:
    files = tmp_path / "files"
    files.mkdir()
    (files / "models" / "tiny").mkdir(parents=True)
    (files / "models" / "tiny" / "config.json").write_text(json.dumps(TINY_CONFIG))
    fake = FakeScheduler(files)
    fake.key_file = tmp_path / "operator-key"
    fake.key_file.write_text("a-test-key-of-the-operator-0123456789")
    runner = aiohttp.web.AppRunner(fake.app())
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://127.0.0.1:{port}"
    try:
        yield fake
    finally:
        await runner.cleanup()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_config(scheduler: FakeScheduler, **kw: Any) -> OperatorConfig:
    base = dict(scheduler_url=scheduler.url, sync_interval_s=0.2, resync_interval_s=1.0, adapter_retry_s=0.3,
                adapter_release_timeout_s=5.0, http_timeout_s=2.0, fetch_timeout_s=5.0, scanning=False,
                credentials_key_file=str(scheduler.key_file))
    base.update(kw)
    return OperatorConfig(**base)


test_config.__test__ = False  # not a test


@contextlib.asynccontextmanager
async def running_operator(config: OperatorConfig) -> AsyncIterator[asyncio.Task]:
    """The real kopf operator over lorafleet.operator.main, in this loop, cluster-wide."""
    import kopf

    import lorafleet.operator.main  # noqa: F401  (registers the handlers)

    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(kopf.operator(clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready,
                                             memo=kopf.Memo(config=config)))
    await asyncio.wait_for(ready.wait(), 15)
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def pool_body(name: str = "llama", namespace: str = "ml", **spec: Any) -> dict:
    body = {"apiVersion": c.API_VERSION, "kind": c.POOL_KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"source": "pvc://models/llama-2-7b"}, **spec}}
    return body


def adapter_body(name: str, source: str, pool: str = "llama", namespace: str = "ml", **spec: Any) -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.ADAPTER_KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": {"pool": pool, "source": source, **spec}}


def pools_path(namespace: str = "ml", name: str | None = None, sub: str | None = None) -> str:
    path = f"/apis/{c.API_VERSION}/namespaces/{namespace}/{c.POOLS}"
    return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def adapters_path(namespace: str = "ml", name: str | None = None) -> str:
    return f"/apis/{c.API_VERSION}/namespaces/{namespace}/{c.ADAPTERS}" + (f"/{name}" if name else "")


def runner_pod(name: str, pool: str = "llama", namespace: str = "ml", ready: bool = True, ip: str = "10.0.0.7") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": c.labels(pool, c.COMPONENT_RUNNER)},
            "status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def runner_state(rid: str, batch: int = 0, idle: float = 0.0, draining: bool = False) -> dict:
    return {"id": rid, "url": "http://10.0.0.7:8001", "healthy": True, "draining": draining, "batch_size": batch,
            "max_batch_size": 32, "free_kv_tokens": 16000 - batch * 400, "total_kv_tokens": 16000,
            "idle_seconds": idle, "adapters": []}

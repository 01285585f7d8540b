"""A small asyncio client of the Kubernetes API over aiohttp (no torch, no blocking calls).

Used by the operator (create, apply, patch, scale) and the scheduler's feeds (list, watch).
Objects are plain dicts. Credentials: the pod's service account when running in a cluster,
otherwise the current kubeconfig context (read with the `kubernetes` package's loader).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Mapping

import aiohttp

from lorafleet import env

log = logging.getLogger(__name__)

# (apiVersion, kind) -> plural, for the kinds this project writes; others use discovery.
KNOWN_PLURALS = {
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Service"): "services",
    ("v1", "Secret"): "secrets",
    ("v1", "Pod"): "pods",
    ("v1", "ConfigMap"): "configmaps",
    ("apps/v1", "Deployment"): "deployments",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("networking.k8s.io/v1", "Ingress"): "ingresses",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("lorafleet.dev/v1alpha1", "ServingPool"): "servingpools",
    ("lorafleet.dev/v1alpha1", "LoraAdapter"): "loraadapters",
}


class ApiError(Exception):
    """A non-2xx answer of the API server."""

    def __init__(self, status: int, reason: str = "", message: str = ""):
        self.status = status
        self.reason = reason
        self.message = message
        super().__init__(f"HTTP {status} {reason}: {message}".strip())


def api_path(api_version: str, plural: str, namespace: str | None = None, name: str | None = None,
             subresource: str | None = None) -> str:
    """/api/v1/namespaces/ns/pods/name or /apis/group/version/... for any resource."""
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    parts = [base]
    if namespace:
        parts.append(f"namespaces/{namespace}")
    parts.append(plural)
    if name:
        parts.append(name)
        if subresource:
            parts.append(subresource)
    return "/".join(parts)


class KubeClient:
    """An API server connection. Create it inside the event loop that uses it."""

    def __init__(
        self,
        server: str,
        *,
        token: str | None = None,
        token_file: str | Path | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        verify: bool = True,
        timeout: float = 30.0,
        reload: Callable[[], "KubeClient"] | None = None,
    ):
        self.server = server.rstrip("/")
        self.ca_file, self.cert_file, self.key_file, self.verify = ca_file, cert_file, key_file, verify
        self._token = token
        self._token_file = Path(token_file) if token_file else None
        self._timeout = timeout
        self._reload = reload
        self._plurals: dict[tuple[str, str], str] = dict(KNOWN_PLURALS)
        self._ssl: ssl.SSLContext | bool | None = None
        if self.server.startswith("https://"):
            if not verify:
                self._ssl = False
            else:
                ctx = ssl.create_default_context(cafile=ca_file)
                if cert_file:
                    ctx.load_cert_chain(cert_file, key_file)
                self._ssl = ctx
        self._session: aiohttp.ClientSession | None = None

    # --- construction --------------------------------------------------------------------------

    @classmethod
    async def from_environment(cls, *, context: str | None = None, timeout: float = 30.0) -> "KubeClient":
        """In a pod: its service account. Elsewhere: the kubeconfig ($KUBECONFIG or ~/.kube/config).

        The service account's files are looked for in `env.service_account_dir()` (the usual
        /var/run/secrets/kubernetes.io/serviceaccount unless LORAFLEET_SERVICEACCOUNT_DIR says otherwise).
        """
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        sa_dir = env.service_account_dir()
        if host and (sa_dir / "token").is_file():
            if ":" in host:
                host = f"[{host}]"
            return cls(f"https://{host}:{port}", token_file=sa_dir / "token", ca_file=str(sa_dir / "ca.crt"),
                       timeout=timeout)
        return await asyncio.to_thread(cls._from_kubeconfig, context, timeout)

    @classmethod
    def _from_kubeconfig(cls, context: str | None, timeout: float) -> "KubeClient":
        from kubernetes import client, config

        cfg = client.Configuration()
        # $KUBECONFIG is read now: the kubernetes package captures it once, at import.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None, client_configuration=cfg,
                                context=context)
        token = cfg.api_key.get("BearerToken") or cfg.api_key.get("authorization")
        if token and not token.lower().startswith("bearer "):
            token = f"Bearer {token}"
        return cls(
            cfg.host,
            token=token[len("Bearer "):] if token else None,
            ca_file=cfg.ssl_ca_cert,
            cert_file=cfg.cert_file,
            key_file=cfg.key_file,
            verify=bool(cfg.verify_ssl),
            timeout=timeout,
            reload=lambda: cls._from_kubeconfig(context, timeout),
        )

    def current_token(self) -> str | None:
        """The bearer token in use now (re-read from the service account file when there is one)."""
        return self._headers().get("Authorization", "")[len("Bearer "):] or None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "KubeClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # --- plumbing ------------------------------------------------------------------------------

    async def reload(self) -> None:
        """Load the credentials again (after a 401: e.g. an expired token from a kubeconfig plugin)."""
        if self._reload is not None:
            fresh = await asyncio.to_thread(self._reload)
            self._token, self._ssl = fresh._token, fresh._ssl

    def _headers(self) -> dict[str, str]:
        token = self._token
        if self._token_file is not None:
            try:
                token = self._token_file.read_text().strip()  # rotated by the kubelet
            except OSError:
                token = self._token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(read_bufsize=1 << 22)
        return self._session

    async def request(self, method: str, path: str, *, params: Mapping[str, str] | None = None,
                      body: Any = None, content_type: str = "application/json") -> Any:
        """One API call; returns the decoded JSON answer or raises ApiError."""
        for attempt in (0, 1):
            headers = {**self._headers(), "Accept": "application/json"}
            data = None
            if body is not None:
                headers["Content-Type"] = content_type
                data = json.dumps(body)
            async with self._http().request(
                method, self.server + path, params=params, data=data, headers=headers, ssl=self._ssl,
                timeout=aiohttp.ClientTimeout(total=self._timeout),
            ) as resp:
                text = await resp.text()
                if resp.status == 401 and attempt == 0 and self._reload is not None:
                    await self.reload()
                    continue
                if resp.status >= 400:
                    raise _error(resp.status, text)
                return json.loads(text) if text else {}
        raise AssertionError("unreachable")

    async def plural_of(self, api_version: str, kind: str) -> str:
        """The resource name of a kind, from the API's discovery document (cached)."""
        key = (api_version, kind)
        if key not in self._plurals:
            base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
            doc = await self.request("GET", base)
            for res in doc.get("resources", []):
                if "/" not in res.get("name", "") and res.get("kind") not in (None, ""):
                    self._plurals.setdefault((api_version, res["kind"]), res["name"])
            if key not in self._plurals:
                raise ApiError(404, "NotFound", f"the API has no kind {kind} in {api_version}")
        return self._plurals[key]

    # --- verbs ---------------------------------------------------------------------------------

    async def get(self, api_version: str, plural: str, name: str, namespace: str | None = None,
                  subresource: str | None = None) -> dict | None:
        try:
            return await self.request("GET", api_path(api_version, plural, namespace, name, subresource))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, api_version: str, plural: str, namespace: str | None = None,
                   label_selector: str | None = None) -> dict:
        params = {"labelSelector": label_selector} if label_selector else None
        return await self.request("GET", api_path(api_version, plural, namespace), params=params)

    async def create(self, obj: Mapping[str, Any]) -> dict:
        plural = await self.plural_of(obj["apiVersion"], obj["kind"])
        ns = obj.get("metadata", {}).get("namespace")
        return await self.request("POST", api_path(obj["apiVersion"], plural, ns), body=obj)

    async def patch(self, api_version: str, plural: str, name: str, patch: Any, namespace: str | None = None,
                    subresource: str | None = None, *, json_patch: bool = False) -> dict | None:
        """A merge patch (or a JSON patch); None when the object does not exist."""
        ctype = "application/json-patch+json" if json_patch else "application/merge-patch+json"
        try:
            return await self.request("PATCH", api_path(api_version, plural, namespace, name, subresource),
                                      body=patch, content_type=ctype)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def apply(self, obj: Mapping[str, Any], field_manager: str) -> dict:
        """Server-side apply (forced) of a whole object; creates it when missing."""
        plural = await self.plural_of(obj["apiVersion"], obj["kind"])
        meta = obj["metadata"]
        path = api_path(obj["apiVersion"], plural, meta.get("namespace"), meta["name"])
        params = {"fieldManager": field_manager, "force": "true"}
        try:
            return await self.request("PATCH", path, params=params, body=obj,
                                      content_type="application/apply-patch+yaml")
        except ApiError as exc:
            if exc.status != 404:
                raise
            # API servers without server-side apply of missing objects (and test mocks).
            try:
                return await self.create(obj)
            except ApiError as again:
                if again.status != 409:  # created meanwhile by someone else: apply over it
                    raise
                return await self.request("PATCH", path, params=params, body=obj,
                                          content_type="application/apply-patch+yaml")

    async def delete(self, api_version: str, plural: str, name: str, namespace: str | None = None) -> bool:
        """Delete (background propagation); False when it was already gone."""
        try:
            await self.request("DELETE", api_path(api_version, plural, namespace, name),
                               body={"propagationPolicy": "Background"})
            return True
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise

    async def watch(self, api_version: str, plural: str, namespace: str | None = None, *,
                    label_selector: str | None = None, resource_version: str | None = None,
                    timeout_s: int = 300) -> AsyncIterator[dict]:
        """Stream watch events ({"type", "object"}) until the server ends the watch.

        An ERROR event (e.g. 410 Gone: the resource version is too old) raises ApiError, so
        the caller lists again.
        """
        params = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_s)}
        if label_selector:
            params["labelSelector"] = label_selector
        if resource_version and resource_version.isdigit():
            params["resourceVersion"] = resource_version
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._timeout, sock_read=timeout_s + 30)
        async with self._http().get(self.server + api_path(api_version, plural, namespace), params=params,
                                    headers={**self._headers(), "Accept": "application/json"}, ssl=self._ssl,
                                    timeout=timeout) as resp:
            if resp.status >= 400:
                raise _error(resp.status, await resp.text())
            async for line in resp.content:
                line = line.strip()
                if not line:
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    raise ApiError(int(status.get("code") or 500), status.get("reason", ""), status.get("message", ""))
                yield event


def _error(status: int, text: str) -> ApiError:
    try:
        doc = json.loads(text)
        return ApiError(status, str(doc.get("reason", "")), str(doc.get("message", ""))[:500])
    except ValueError:
        return ApiError(status, "", text[:500])

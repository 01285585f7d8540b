"""Pure helpers of the process kubelet: a pod's container -> the command line and environment of
a local process. No I/O here (the kubelet passes in what it read from the API).

- `$(VAR)` in env values refers to variables defined earlier in the container's env; in
  command and args to any of them; `$$(VAR)` stays literal (Kubernetes' expansion rules).
- Volume mounts are remapped: a process has no filesystem of its own, so any argument or
  env value that is a mount path (or below one) is rewritten to the host folder of that volume.
- Wildcard binds are narrowed: a process has no network namespace of its own, so `0.0.0.0`
  (as an argument, or as the host of a URL argument) becomes the pod's loopback address.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

Obj = Mapping[str, Any]
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class PodSpecError(ValueError):
    """A pod this kubelet cannot run (the message goes into the pod's status)."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined names are replaced, unknown ones stay as written,
    `$$` is one literal `$`."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return _REF.sub(sub, text)


def field_ref(pod: Obj, path: str, pod_ip: str) -> str:
    """The value of a downward-API fieldRef."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": "127.0.0.1",
    }
    if path in simple:
        return str(simple[path] or "")
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    raise PodSpecError(f"unsupported fieldRef {path!r}")


def container_env(pod: Obj, container: Obj, pod_ip: str,
                  lookup: Callable[[str, str, str], str | None]) -> dict[str, str]:
    """The container's environment: envFrom first, then env in order, with $(VAR) expansion.

    `lookup(kind, name, key)` reads a Secret or ConfigMap key (None when absent); kind is
    "secret" or "configmap"; key None asks for the whole object as {key: value}.
    """
    env: dict[str, str] = {}
    for src in container.get("envFrom") or ():
        prefix = src.get("prefix") or ""
        for kind, field in (("secret", "secretRef"), ("configmap", "configMapRef")):
            ref = src.get(field)
            if ref:
                data = lookup(kind, ref["name"], None)
                if data is None and not ref.get("optional"):
                    raise PodSpecError(f"{kind} {ref['name']!r} not found")
                for k, v in (data or {}).items():  # type: ignore[union-attr]
                    env[prefix + k] = v
    for item in container.get("env") or ():
        name = item["name"]
        if "value" in item:
            env[name] = expand(str(item["value"]), env)
            continue
        vf = item.get("valueFrom") or {}
        if "fieldRef" in vf:
            env[name] = field_ref(pod, vf["fieldRef"]["fieldPath"], pod_ip)
        elif "secretKeyRef" in vf or "configMapKeyRef" in vf:
            kind, ref = ("secret", vf["secretKeyRef"]) if "secretKeyRef" in vf else ("configmap", vf["configMapKeyRef"])
            value = lookup(kind, ref["name"], ref["key"])
            if value is None:
                if ref.get("optional"):
                    continue
                raise PodSpecError(f"{kind} {ref['name']!r} has no key {ref['key']!r} (or does not exist)")
            env[name] = value
        elif "resourceFieldRef" in vf:
            env[name] = "1"
        else:
            env[name] = ""
    return env


def narrow_binds(arg: str, pod_ip: str) -> str:
    """`0.0.0.0` as a whole argument, after `=`, or as a URL's host -> the pod's address."""
    if arg == "0.0.0.0":
        return pod_ip
    return re.sub(r"(^|=|://)0\.0\.0\.0(?=:|/|$)", lambda m: m.group(1) + pod_ip, arg)


def remap_paths(value: str, mounts: Mapping[str, str]) -> str:
    """A mount path (or a path below one, also after `=`) -> the volume's host folder."""
    for mount in sorted(mounts, key=len, reverse=True):
        host = mounts[mount]
        m = re.fullmatch(rf"(.*?=)?{re.escape(mount)}(/.*)?", value)
        if m:
            return (m.group(1) or "") + host + (m.group(2) or "")
    return value


def command_line(container: Obj, env: Mapping[str, str], pod_ip: str, mounts: Mapping[str, str]) -> list[str]:
    """command + args, expanded, remapped and narrowed."""
    argv = [str(x) for x in (container.get("command") or [])] + [str(x) for x in (container.get("args") or [])]
    if not argv:
        raise PodSpecError("the container has no command (an image's entrypoint cannot be run here)")
    return [narrow_binds(remap_paths(expand(a, env), mounts), pod_ip) for a in argv]


def container_port(container: Obj, port: Any) -> int:
    """A probe's or Service's target port (a number or a container port name) as a number."""
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports") or ():
        if p.get("name") == port:
            return int(p["containerPort"])
    raise PodSpecError(f"no container port named {port!r}")

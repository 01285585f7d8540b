"""The scheduler's Kubernetes feeds, level-triggered.

- LoraAdapter objects of this pool in phase Ready (and not being deleted) -> `AdapterRegistry`.
- The pool's runner pods that are Ready, with an IP -> `RunnerDirectory`.

Each feed lists, then watches, and after every event hands the *whole* current set to the
registry or directory, which apply only the difference. A broken watch relists after a
backoff; until then the last known set stays (the scheduler health-checks runners itself).
The pure functions below turn API objects into entries and endpoints; they also filter by
label and namespace, so they are right even when the server ignored a selector.
"""

from __future__ import annotations

import asyncio
import logging
import random
from datetime import datetime
from typing import Any, Awaitable, Callable, Iterable, Mapping

from lorafleet.common.kubeclient import ApiError, KubeClient
from lorafleet.operator import constants as c
from lorafleet.scheduler.discovery import RunnerDirectory, RunnerEndpoint
from lorafleet.scheduler.registry import AdapterEntry, AdapterRegistry

log = logging.getLogger(__name__)

Obj = Mapping[str, Any]


def _timestamp(value: str | None) -> float:
    if not value:
        return 0.0
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def adapter_entry(obj: Obj, pool: str) -> AdapterEntry | None:
    """The registry entry of one LoraAdapter, or None when this pool must not serve it.

    Served: `spec.pool` is this pool, `status.phase` is Ready for the current generation,
    and no deletion is pending (the finalizer holds deleted objects until we forgot them).
    """
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    if spec.get("pool") != pool or meta.get("deletionTimestamp") or status.get("phase") != "Ready":
        return None
    generation, observed = meta.get("generation"), status.get("observedGeneration")
    if generation is not None and observed is not None and int(observed) != int(generation):
        return None  # the spec changed since it was validated
    if not meta.get("name") or not spec.get("source"):
        return None
    return AdapterEntry(
        name=meta["name"],
        source=str(spec["source"]),
        sha256=spec.get("sha256") or None,
        rank=status.get("rank"),
        base_model=status.get("baseModel") or None,
        created=_timestamp(meta.get("creationTimestamp")),
    )


def adapter_entries(items: Iterable[Obj], pool: str, namespace: str | None = None) -> list[AdapterEntry]:
    out = []
    for obj in items:
        if namespace is not None and (obj.get("metadata") or {}).get("namespace") not in (None, namespace):
            continue
        entry = adapter_entry(obj, pool)
        if entry is not None:
            out.append(entry)
    return sorted(out, key=lambda e: e.name)


def _pod_ready(pod: Obj) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(cond.get("type") == "Ready" and cond.get("status") == "True" for cond in status.get("conditions") or ())


def runner_endpoint(pod: Obj, pool: str, port: int = c.RUNNER_PORT) -> RunnerEndpoint | None:
    """The endpoint of one runner pod, or None unless it belongs to the pool and is Ready."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(c.LABEL_POOL) != pool or labels.get(c.LABEL_COMPONENT) != c.COMPONENT_RUNNER:
        return None
    if meta.get("deletionTimestamp") or not _pod_ready(pod):
        return None
    ip = (pod.get("status") or {}).get("podIP")
    if not ip or not meta.get("name"):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return RunnerEndpoint(id=meta["name"], url=f"http://{host}:{port}")


def runner_endpoints(pods: Iterable[Obj], pool: str, port: int = c.RUNNER_PORT,
                     namespace: str | None = None) -> list[RunnerEndpoint]:
    out = []
    for pod in pods:
        if namespace is not None and (pod.get("metadata") or {}).get("namespace") not in (None, namespace):
            continue
        ep = runner_endpoint(pod, pool, port)
        if ep is not None:
            out.append(ep)
    return sorted(out, key=lambda e: e.id)


def apply_event(objects: dict[str, Obj], event: Obj) -> str | None:
    """Fold one watch event into `objects` (name -> object); return the new resourceVersion."""
    kind = event.get("type")
    obj = event.get("object") or {}
    meta = obj.get("metadata") or {}
    if kind == "BOOKMARK":
        return meta.get("resourceVersion")
    name = meta.get("name")
    if not name:
        return None
    if kind == "DELETED":
        objects.pop(name, None)
    elif kind in ("ADDED", "MODIFIED"):
        objects[name] = obj
    return meta.get("resourceVersion")


async def mirror(
    api: KubeClient,
    api_version: str,
    plural: str,
    namespace: str,
    publish: Callable[[list[Obj]], None],
    *,
    label_selector: str | None = None,
    watch_timeout_s: int = 300,
    backoff: tuple[float, float] = (0.5, 30.0),
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """List + watch one resource forever; call `publish(all objects)` after every change."""
    delay = backoff[0]
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        try:
            listing = await api.list(api_version, plural, namespace, label_selector=label_selector)
            objects = {o["metadata"]["name"]: o for o in listing.get("items") or () if o.get("metadata", {}).get("name")}
            publish(list(objects.values()))
            version = (listing.get("metadata") or {}).get("resourceVersion")
            delay = backoff[0]
            async for event in api.watch(api_version, plural, namespace, label_selector=label_selector,
                                         resource_version=version, timeout_s=watch_timeout_s):
                version = apply_event(objects, event) or version
                if event.get("type") != "BOOKMARK":
                    publish(list(objects.values()))
            # The server closed the watch: list again (cheap, and it heals any drift).
            if loop.time() - started > 1.0:
                continue
        except asyncio.CancelledError:
            raise
        except ApiError as exc:
            if exc.status == 410:
                continue
            log.warning("watching %s in %s failed: %s; retrying in %.1fs", plural, namespace, exc, delay)
        except Exception as exc:  # network errors, malformed answers: retry with backoff
            log.warning("watching %s in %s failed: %r; retrying in %.1fs", plural, namespace, exc, delay)
        await sleep(delay * (0.8 + 0.4 * random.random()))
        delay = min(backoff[1], delay * 2)


async def run_kube_feeds(
    registry: AdapterRegistry,
    directory: RunnerDirectory,
    *,
    namespace: str,
    pool: str,
    api: KubeClient | None = None,
    runner_port: int = c.RUNNER_PORT,
    watch_timeout_s: int = 300,
    backoff: tuple[float, float] = (0.5, 30.0),
) -> None:
    """Feed `registry` and `directory` from the Kubernetes API until cancelled."""
    own = api is None
    if api is None:
        api = await KubeClient.from_environment()

    def adapters(items: list[Obj]) -> None:
        registry.replace_all(adapter_entries(items, pool, namespace))

    def runners(items: list[Obj]) -> None:
        directory.set_endpoints(runner_endpoints(items, pool, runner_port, namespace))

    try:
        await asyncio.gather(
            mirror(api, c.API_VERSION, c.ADAPTERS, namespace, adapters,
                   watch_timeout_s=watch_timeout_s, backoff=backoff),
            mirror(api, "v1", "pods", namespace, runners, label_selector=c.label_selector(pool, c.COMPONENT_RUNNER),
                   watch_timeout_s=watch_timeout_s, backoff=backoff),
        )
    finally:
        if own:
            await api.close()

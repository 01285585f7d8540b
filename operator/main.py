"""kopf handlers of the lorafleet operator. Thin: the work is in reconcile, validation, autoscale.

ServingPool: create/update/resume apply its children; a daemon per pool looks at it every
`sync_interval_s` (status, autoscaler, periodic re-apply); deletion removes its children.
LoraAdapter: create/update validate it; resume re-checks it; a daemon per adapter retries
Pending or retryably Failed ones and re-checks Ready ones; deletion (finalizer) waits until
the pool's scheduler no longer serves it.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Mapping

import aiohttp
import kopf

from lorafleet.common.kubeclient import ApiError, KubeClient
from lorafleet.operator import builders, reconcile, validation
from lorafleet.operator import constants as c
from lorafleet.operator.admin import SchedulerUnavailable
from lorafleet.operator.autoscale import History
from lorafleet.operator.config import OperatorConfig
from lorafleet.operator.spec import PoolSpec, SpecError, parse_pool
from lorafleet.operator.status import PoolFacts, merge_patch, now_iso, pool_status


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config: OperatorConfig = memo.get("config") or OperatorConfig()
    settings.persistence.finalizer = c.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=c.GROUP, key="last-handled-configuration")
    settings.posting.reporting_component = c.MANAGED_BY
    settings.scanning.disabled = not config.scanning
    settings.execution.max_workers = 8
    kube = await KubeClient.from_environment()
    memo["ctx"] = reconcile.Context(config=config, kube=kube, http=aiohttp.ClientSession())


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    ctx = memo.get("ctx")
    if ctx is not None:
        await ctx.close()


# --- ServingPool -------------------------------------------------------------------------------


@kopf.index(c.GROUP, c.VERSION, c.POOLS)
def pools(namespace: str, name: str, spec: Mapping, status: Mapping, meta: Mapping, **_: Any) -> dict:
    """(namespace, name) -> a copy of the pool's spec and status, for adapter handlers."""
    return {(namespace, name): {"spec": copy.deepcopy(dict(spec)), "status": copy.deepcopy(dict(status)),
                                "deleting": bool(meta.get("deletionTimestamp"))}}


def _pool_spec(name: str, namespace: str, spec: Mapping, body: Any) -> PoolSpec | None:
    try:
        return parse_pool(name, namespace, spec)
    except SpecError as exc:
        kopf.warn(body, reason="InvalidSpec", message=str(exc))
        return None


async def _apply_pool(body: Any, name: str, namespace: str, spec: Mapping, status: Mapping, meta: Mapping,
                      patch: kopf.Patch, memo: kopf.Memo) -> None:
    ctx: reconcile.Context = memo["ctx"]
    pool = _pool_spec(name, namespace, spec, body)
    if pool is None:
        patch.status["message"] = "invalid spec"
        return
    try:
        written = await reconcile.apply_pool(ctx, pool, body)
    except ApiError as exc:
        raise kopf.TemporaryError(f"applying the pool's objects failed: {exc}", delay=10) from None
    if written:
        kopf.info(body, reason="Applied", message=", ".join(written))
    shape = await reconcile.learn_base_shape(ctx, pool, status)
    if shape:
        patch.status["baseModel"] = shape
    patch.status["endpoint"] = builders.endpoint_url(pool)


@kopf.on.create(c.GROUP, c.VERSION, c.POOLS)
async def pool_created(**kw: Any) -> None:
    await _apply_pool(kw["body"], kw["name"], kw["namespace"], kw["spec"], kw["status"], kw["meta"], kw["patch"], kw["memo"])


@kopf.on.update(c.GROUP, c.VERSION, c.POOLS)
async def pool_updated(**kw: Any) -> None:
    await _apply_pool(kw["body"], kw["name"], kw["namespace"], kw["spec"], kw["status"], kw["meta"], kw["patch"], kw["memo"])


@kopf.on.resume(c.GROUP, c.VERSION, c.POOLS)
async def pool_resumed(**kw: Any) -> None:
    await _apply_pool(kw["body"], kw["name"], kw["namespace"], kw["spec"], kw["status"], kw["meta"], kw["patch"], kw["memo"])


@kopf.on.delete(c.GROUP, c.VERSION, c.POOLS)
async def pool_deleted(body: Any, name: str, namespace: str, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    ctx: reconcile.Context = memo["ctx"]
    try:
        deleted = await reconcile.delete_pool_children(ctx, name, namespace)
    except ApiError as exc:
        raise kopf.TemporaryError(f"deleting the pool's objects failed: {exc}", delay=10) from None
    logger.info("deleted %s", ", ".join(deleted) or "nothing (already gone)")


async def _pool_tick(ctx: reconcile.Context, body: Any, logger: Any) -> None:
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), dict(body.get("status") or {})
    name, namespace = meta["name"], meta["namespace"]
    try:
        pool = parse_pool(name, namespace, spec)
    except SpecError as exc:
        facts_err = str(exc)
        new = pool_status(PoolFacts(meta.get("generation"), 0, None, False, None, "", None, History(),
                                    spec_error=facts_err), status, now_iso())
        await _patch_status(ctx, c.POOLS, name, namespace, status, new)
        return
    last = ctx.last_apply.get((namespace, name))
    if last is None or time.monotonic() - last >= ctx.config.resync_interval_s:
        written = await reconcile.apply_pool(ctx, pool, body)  # level-triggered: heal drift
        if written:
            kopf.info(body, reason="Applied", message=", ".join(written))
        shape = await reconcile.learn_base_shape(ctx, pool, status)
        if shape:
            status_patch = {"baseModel": shape}
            await ctx.kube.patch(c.API_VERSION, c.POOLS, name, {"status": status_patch}, namespace, subresource="status")
    admin = await reconcile.admin_client(ctx, namespace, name)
    current = await reconcile.look(ctx, pool, admin)
    history = History.from_status(status.get("autoscaler"))
    try:
        history, actions, decision = await reconcile.autoscale(ctx, pool, admin, current, history, time.time())
    except SchedulerUnavailable as exc:
        actions, decision = [], None
        logger.warning("autoscaler: %s", exc)
    for action in actions:
        kopf.info(body, reason="Autoscaled", message=action)
    facts = PoolFacts(
        generation=meta.get("generation"),
        replicas=decision.replicas if decision else current.replicas,
        observation=current.observation,
        scheduler_available=current.scheduler_available,
        scheduler_error=current.scheduler_error,
        endpoint=builders.endpoint_url(pool),
        ingress_url=builders.ingress_url(pool),
        history=history,
        node_group_replicas=(decision.node_group_replicas if decision and decision.node_group_replicas is not None
                             else current.node_group_replicas),
    )
    new = pool_status(facts, status, now_iso())
    before = {x.get("type"): x.get("status") for x in status.get("conditions") or ()}
    await _patch_status(ctx, c.POOLS, name, namespace, status, new)
    for cond in new["conditions"]:
        if cond["type"] == "Ready" and before.get("Ready") != cond["status"]:
            emit = kopf.info if cond["status"] == "True" else kopf.warn
            emit(body, reason=cond["reason"], message=cond["message"] or cond["reason"])


async def _patch_status(ctx: reconcile.Context, plural: str, name: str, namespace: str,
                        old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    diff = merge_patch(old, new)
    if diff:
        await ctx.kube.patch(c.API_VERSION, plural, name, {"status": diff}, namespace, subresource="status")


@kopf.daemon(c.GROUP, c.VERSION, c.POOLS, cancellation_timeout=10.0)
async def pool_loop(stopped: kopf.DaemonStopped, body: Any, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Every sync interval: status from the scheduler's view, autoscaling, periodic re-apply."""
    ctx: reconcile.Context = memo["ctx"]
    while not stopped:
        try:
            await _pool_tick(ctx, body, logger)
        except ApiError as exc:
            logger.warning("pool look failed: %s", exc)
        except Exception:  # keep the loop alive; the next round starts from the API again
            logger.exception("pool look failed")
        await stopped.wait(ctx.config.sync_interval_s)


# --- LoraAdapter -------------------------------------------------------------------------------


def _pool_of(pools: kopf.Index, namespace: str, pool: str | None) -> dict | None:
    if not pool:
        return None
    for entry in pools.get((namespace, pool), ()):
        if not entry.get("deleting"):
            return entry
    return None


def _announce(body: Any, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    if (old.get("phase"), old.get("reason")) == (new["phase"], new["reason"]):
        return
    emit = kopf.warn if new["phase"] == validation.FAILED else kopf.info
    emit(body, reason=new["reason"], message=f"{new['phase']}: {new['message']}")


async def _check_adapter(body: Any, name: str, namespace: str, spec: Mapping, status: Mapping, meta: Mapping,
                         memo: kopf.Memo, pools: kopf.Index, full: bool) -> dict | None:
    """The adapter's new status, or None when nothing changes."""
    ctx: reconcile.Context = memo["ctx"]
    pool_body = _pool_of(pools, namespace, spec.get("pool"))
    generation = meta.get("generation")
    current = (status.get("phase") == validation.READY and status.get("source") == spec.get("source")
               and status.get("observedGeneration") in (None, generation))
    if not full and current:
        verdict = validation.recheck(spec, status, pool_body, namespace)
        if verdict is None:
            return None
    else:
        admin = await reconcile.admin_client(ctx, namespace, spec["pool"]) if pool_body else None
        verdict = await validation.validate_adapter(name, namespace, spec, pool_body, admin=admin,
                                                    fetch_timeout=ctx.config.fetch_timeout_s)
    new = verdict.status(status, generation=generation, source=spec.get("source"), now=now_iso())
    _announce(body, status, new)
    return new


async def _adapter_changed(kw: dict, full: bool) -> None:
    status = dict(kw["status"] or {})
    new = await _check_adapter(kw["body"], kw["name"], kw["namespace"], kw["spec"], status, kw["meta"],
                               kw["memo"], kw["pools"], full)
    if new is not None:
        kw["patch"].status.update(merge_patch(status, new))


@kopf.on.create(c.GROUP, c.VERSION, c.ADAPTERS)
async def adapter_created(**kw: Any) -> None:
    await _adapter_changed(kw, full=True)


@kopf.on.update(c.GROUP, c.VERSION, c.ADAPTERS)
async def adapter_updated(**kw: Any) -> None:
    await _adapter_changed(kw, full=True)


@kopf.on.resume(c.GROUP, c.VERSION, c.ADAPTERS)
async def adapter_resumed(**kw: Any) -> None:
    await _adapter_changed(kw, full=False)


@kopf.daemon(c.GROUP, c.VERSION, c.ADAPTERS, cancellation_timeout=5.0)
async def adapter_loop(stopped: kopf.DaemonStopped, body: Any, name: str, namespace: str, memo: kopf.Memo,
                       pools: kopf.Index, logger: Any, **_: Any) -> None:
    """Retry Pending and retryably Failed adapters; re-check Ready ones against their pool."""
    ctx: reconcile.Context = memo["ctx"]
    while not stopped:
        await stopped.wait(ctx.config.adapter_retry_s)
        if stopped:
            break
        meta, spec, status = body.get("metadata", {}), body.get("spec", {}), dict(body.get("status") or {})
        if status.get("observedGeneration") not in (None, meta.get("generation")):
            continue  # the update handler is checking the new spec
        phase = status.get("phase")
        if phase not in (None, validation.READY) and not status.get("retryable"):
            continue
        try:
            new = await _check_adapter(body, name, namespace, spec, status, meta, memo, pools,
                                       full=phase != validation.READY)
            if new is not None:
                await _patch_status(ctx, c.ADAPTERS, name, namespace, status, new)
        except ApiError as exc:
            logger.warning("adapter re-check failed: %s", exc)
        except Exception:
            logger.exception("adapter re-check failed")


@kopf.on.delete(c.GROUP, c.VERSION, c.ADAPTERS)
async def adapter_deleted(name: str, namespace: str, spec: Mapping, memo: kopf.Memo, pools: kopf.Index,
                          runtime: Any, logger: Any, **_: Any) -> None:
    """Hold the finalizer until the pool's scheduler no longer serves the adapter."""
    ctx: reconcile.Context = memo["ctx"]
    if _pool_of(pools, namespace, spec.get("pool")) is None:
        return
    admin = await reconcile.admin_client(ctx, namespace, spec["pool"])
    if admin is None:
        return
    try:
        served = await admin.models()
    except SchedulerUnavailable:
        return  # nothing routes through a scheduler that is down; it relists when it comes back
    if name not in served:
        return
    if runtime.total_seconds() < ctx.config.adapter_release_timeout_s:
        raise kopf.TemporaryError(f"the scheduler still serves {name}; waiting", delay=1)
    logger.warning("the scheduler still serves %s after %.0fs; releasing it anyway", name, runtime.total_seconds())

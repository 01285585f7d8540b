"""What the operator does for one ServingPool: apply its objects, and look at it periodically."""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import kopf

from lorafleet.common.kubeclient import ApiError
from lorafleet.operator import builders, reconcile
from lorafleet.operator import constants as c
from lorafleet.operator.admin import SchedulerUnavailable
from lorafleet.operator.autoscale import History
from lorafleet.operator.spec import PoolSpec, SpecError, parse_pool
from lorafleet.operator.status import (NODE_GROUP_UNAVAILABLE, POD_CREATION_FAILED, PoolFacts, merge_patch,
                                       now_iso, pool_status)

log = logging.getLogger(__name__)


async def patch_status(ctx: reconcile.Context, plural: str, name: str, namespace: str,
                       old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """Write only what changed in a status."""
    diff = merge_patch(old, new)
    if diff:
        await ctx.kube.patch(c.API_VERSION, plural, name, {"status": diff}, namespace, subresource="status")


async def publish_base_shape(ctx: reconcile.Context, pool: Any, status: Mapping[str, Any]) -> None:
    """Learn the base model's shape (once per source) and put it in the pool's status."""
    shape = await reconcile.learn_base_shape(ctx, pool, status)
    if shape:
        await ctx.kube.patch(c.API_VERSION, c.POOLS, pool.name, {"status": {"baseModel": shape}}, pool.namespace,
                             subresource="status")


def applied(ctx: reconcile.Context, body: Any, pool: PoolSpec, written: list[str]) -> None:
    """The pool's objects were written: forget an earlier refusal, say what changed."""
    ctx.apply_errors.pop((pool.namespace, pool.name), None)
    if written:
        kopf.info(body, reason="Applied", message=", ".join(written))


def apply_refused(ctx: reconcile.Context, body: Any, pool: PoolSpec, exc: ApiError) -> None:
    """The API server refused one of the pool's objects: an event and a log line once per refusal, the
    pool's status says it (see `tick`), and the next try is a resync interval away, not the next look."""
    key = (pool.namespace, pool.name)
    ctx.last_apply[key] = time.monotonic()
    message = f"the API server refused the pool's objects: {exc.message or exc}"
    if ctx.apply_errors.get(key) == message:
        return
    ctx.apply_errors[key] = message
    log.warning("pool %s/%s: %s", pool.namespace, pool.name, message)
    kopf.warn(body, reason="ApplyFailed", message=message)


async def apply(ctx: reconcile.Context, body: Any, patch: kopf.Patch) -> None:
    """A pool was created, changed or found at start-up: make its objects match its spec."""
    meta, status = body["metadata"], dict(body.get("status") or {})
    try:
        pool = parse_pool(meta["name"], meta["namespace"], body.get("spec") or {})
    except SpecError as exc:
        kopf.warn(body, reason="InvalidSpec", message=str(exc))
        return  # the pool's loop reports it in the status
    try:
        await publish_base_shape(ctx, pool, status)  # first: this pool's adapters wait for it
        written = await reconcile.apply_pool(ctx, pool, body)
    except ApiError as exc:
        if not reconcile.refused(exc):
            raise kopf.TemporaryError(f"applying the pool's objects failed: {exc}", delay=10) from None
        apply_refused(ctx, body, pool, exc)  # retrying will not help: the pool's loop reports it
        return
    applied(ctx, body, pool, written)
    patch.status["endpoint"] = builders.endpoint_url(pool)


async def delete(ctx: reconcile.Context, name: str, namespace: str, logger: Any) -> None:
    try:
        deleted = await reconcile.delete_pool_children(ctx, name, namespace)
    except ApiError as exc:
        raise kopf.TemporaryError(f"deleting the pool's objects failed: {exc}", delay=10) from None
    logger.info("deleted %s", ", ".join(deleted) or "nothing (already gone)")


async def tick(ctx: reconcile.Context, body: Any, logger: Any) -> None:
    """One look at a pool: re-apply (every resync interval), autoscale, and write its status."""
    meta, spec, status = body.get("metadata", {}), body.get("spec", {}), dict(body.get("status") or {})
    name, namespace = meta["name"], meta["namespace"]
    try:
        pool = parse_pool(name, namespace, spec)
    except SpecError as exc:
        facts = PoolFacts(meta.get("generation"), 0, None, False, None, "", None, History(), spec_error=str(exc))
        await patch_status(ctx, c.POOLS, name, namespace, status, pool_status(facts, status, now_iso()))
        return
    last = ctx.last_apply.get((namespace, name))
    if last is None or time.monotonic() - last >= ctx.config.resync_interval_s:
        try:
            written = await reconcile.apply_pool(ctx, pool, body)  # level-triggered: heals drift
        except ApiError as exc:
            if not reconcile.refused(exc):
                raise
            apply_refused(ctx, body, pool, exc)
        else:
            applied(ctx, body, pool, written)
        await publish_base_shape(ctx, pool, status)
    admin = reconcile.admin_client(ctx, namespace, name)
    current = await reconcile.look(ctx, pool, admin)
    history = History.from_status(status.get("autoscaler"))
    try:
        done = await reconcile.autoscale(ctx, pool, admin, current, history, time.time())
    except SchedulerUnavailable as exc:
        done = reconcile.Round(history, [], None, current.replicas, current.node_group_replicas,
                               current.node_group_error)
        logger.warning("autoscaler: %s", exc)
    for action in done.actions:
        kopf.info(body, reason="Autoscaled", message=action)
    before = {x.get("type"): x for x in status.get("conditions") or ()}
    was = before.get("Degraded", {})
    reported = (was.get("status"), was.get("reason")) == ("True", NODE_GROUP_UNAVAILABLE)
    node_group_says = reconcile.node_group_verdict(ctx, pool, done.node_group_error, reported)
    nodes = done.node_group_replicas
    if nodes is None and done.node_group_error is not None and node_group_says is None:
        nodes = status.get("nodeGroupReplicas")  # a transient fault held back: what the group held when last read
    facts = PoolFacts(
        generation=meta.get("generation"),
        replicas=done.replicas,
        observation=current.observation,
        scheduler_available=current.scheduler_available,
        scheduler_error=current.scheduler_error,
        endpoint=builders.endpoint_url(pool),
        ingress_url=builders.ingress_url(pool),
        history=done.history,
        node_group_replicas=nodes,  # what the group holds, not a target it did not take
        gpus_per_runner=pool.runner.gpus,
        apply_error=ctx.apply_errors.get((namespace, name)),
        node_group_error=node_group_says,
        replica_failures=current.replica_failures,
    )
    new = pool_status(facts, status, now_iso())
    await patch_status(ctx, c.POOLS, name, namespace, status, new)
    after = {x["type"]: x for x in new["conditions"]}
    ready, degraded = after["Ready"], after["Degraded"]
    said = None
    if before.get("Ready", {}).get("status") != ready["status"] and ready["reason"] != "ApplyFailed":  # (apply_refused)
        emit = kopf.info if ready["status"] == "True" else kopf.warn
        emit(body, reason=ready["reason"], message=ready["message"] or ready["reason"])
        said = ready["reason"]
    # Causes only the user can remove: one event when they appear.
    if degraded["reason"] in (POD_CREATION_FAILED, NODE_GROUP_UNAVAILABLE) and degraded["reason"] != said \
            and (was.get("status"), was.get("reason")) != ("True", degraded["reason"]):
        kopf.warn(body, reason=degraded["reason"], message=degraded["message"])

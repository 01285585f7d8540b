"""What the operator does for one LoraAdapter: check it, and hold its deletion until it is forgotten."""

from __future__ import annotations

from typing import Any, Mapping

import kopf

from lorafleet.operator import constants as c
from lorafleet.operator import reconcile, validation
from lorafleet.operator.admin import SchedulerUnavailable
from lorafleet.operator.pools import patch_status
from lorafleet.operator.status import merge_patch, now_iso


def pool_of(pools: Mapping[Any, Any], namespace: str, pool: str | None) -> dict | None:
    """The pool an adapter names, from the operator's index of pools (None if absent or being deleted)."""
    if not pool:
        return None
    for entry in pools.get((namespace, pool), ()):
        if not entry.get("deleting"):
            return entry
    return None


def announce(body: Any, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """An event when the phase or the reason changes."""
    if (old.get("phase"), old.get("reason")) == (new["phase"], new["reason"]):
        return
    emit = kopf.warn if new["phase"] == validation.FAILED else kopf.info
    emit(body, reason=new["reason"], message=f"{new['phase']}: {new['message']}")


async def check(ctx: reconcile.Context, body: Any, pools: Mapping[Any, Any], *, full: bool) -> dict | None:
    """The adapter's new status, or None when nothing changes.

    `full` checks the files again; otherwise a Ready adapter for its current spec is only
    re-checked against its pool (cheap, no I/O: a changed maxLoraRank against its rank), unless the pool's
    model changed since the verdict or is not known (a verdict from before `checkedAgainst`: checked once more; a
    Ready one keeps its verdict until that check gives a final answer).
    """
    meta, spec, status = body["metadata"], body.get("spec") or {}, dict(body.get("status") or {})
    name, namespace = meta["name"], meta["namespace"]
    pool_body = pool_of(pools, namespace, spec.get("pool"))
    against = validation.checked_against(spec, pool_body, namespace)
    generation = meta.get("generation")
    current = (status.get("phase") == validation.READY and status.get("source") == spec.get("source")
               and status.get("observedGeneration") in (None, generation))
    verdict = validation.recheck(spec, status, pool_body, namespace) if not full and current else None
    if verdict is None and not full and current and not validation.pool_changed(status, against, model_only=True):
        return None
    if verdict is None:
        admin = reconcile.admin_client(ctx, namespace, spec["pool"]) if pool_body else None
        verdict = await validation.validate_adapter(name, namespace, spec, pool_body, admin=admin,
                                                    fetch_timeout=ctx.config.fetch_timeout_s, executor=ctx.fetch_pool)
        if current and not status.get("checkedAgainst") and verdict.phase != validation.READY and verdict.retryable:
            # A served verdict from before `checkedAgainst` that cannot be checked now (source unreachable, no ready
            # runner): it stands, and is checked again next round; only a final verdict replaces it.
            return None
    new = verdict.status(status, generation=generation, source=spec.get("source"), now=now_iso(),
                         checked_against=against)
    announce(body, status, new)
    return new


async def changed(ctx: reconcile.Context, body: Any, patch: kopf.Patch, pools: Mapping[Any, Any], *,
                  full: bool) -> None:
    """Created, changed, or found at start-up: the status goes into kopf's patch."""
    status = dict(body.get("status") or {})
    new = await check(ctx, body, pools, full=full)
    if new is not None:
        patch.status.update(merge_patch(status, new))


async def retry(ctx: reconcile.Context, body: Any, pools: Mapping[Any, Any]) -> None:
    """One round of the adapter's loop: retry Pending and retryably Failed, re-check Ready, and check
    again any adapter whose pool's model or maxLoraRank changed since its verdict."""
    meta, spec, status = body["metadata"], body.get("spec") or {}, dict(body.get("status") or {})
    if status.get("observedGeneration") not in (None, meta.get("generation")):
        return  # the change handler is checking the new spec
    phase = status.get("phase")
    if phase not in (None, validation.READY) and not status.get("retryable"):
        against = validation.checked_against(spec, pool_of(pools, meta["namespace"], spec.get("pool")),
                                             meta["namespace"])
        if not validation.pool_changed(status, against):
            return
    new = await check(ctx, body, pools, full=phase != validation.READY)
    # A retry with the same outcome changes nothing but the time: no write.
    if new is not None and merge_patch(status, {**new, "validatedAt": status.get("validatedAt")}):
        await patch_status(ctx, c.ADAPTERS, meta["name"], meta["namespace"], status, new)


async def release(ctx: reconcile.Context, body: Any, pools: Mapping[Any, Any], runtime: float, logger: Any) -> None:
    """The finalizer: returns once the pool's scheduler no longer serves the adapter (or cannot)."""
    meta, spec = body["metadata"], body.get("spec") or {}
    name, namespace = meta["name"], meta["namespace"]
    if pool_of(pools, namespace, spec.get("pool")) is None:
        return
    admin = reconcile.admin_client(ctx, namespace, spec["pool"])
    try:
        served = await admin.models()
    except SchedulerUnavailable:
        return  # nothing routes through a scheduler that is down; it relists when it comes back
    if name not in served:
        return
    if runtime < ctx.config.adapter_release_timeout_s:
        raise kopf.TemporaryError(f"the scheduler still serves {name}; waiting", delay=1)
    logger.warning("the scheduler still serves %s after %.0fs; releasing it anyway", name, runtime)

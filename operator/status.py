"""Pure functions that compute the `status` of ServingPools and LoraAdapters."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterable, Mapping

from lorafleet.operator.autoscale import History, Observation
from lorafleet.operator.constants import COMPONENT_SCHEDULER


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def set_condition(conditions: Iterable[Mapping[str, Any]] | None, type_: str, status: bool, reason: str,
                  message: str, now: str, generation: int | None = None) -> list[dict[str, Any]]:
    """The condition list with one condition set; lastTransitionTime moves only on a change."""
    out = [dict(c) for c in conditions or () if c.get("type") != type_]
    old = next((c for c in conditions or () if c.get("type") == type_), None)
    value = "True" if status else "False"
    since = old.get("lastTransitionTime") if old and old.get("status") == value else now
    cond: dict[str, Any] = {"type": type_, "status": value, "reason": reason, "message": message,
                            "lastTransitionTime": since or now}
    if generation is not None:
        cond["observedGeneration"] = generation
    out.append(cond)
    return sorted(out, key=lambda c: c["type"])


def is_subset(want: Any, have: Any) -> bool:
    """Whether `have` already holds everything in `want` (extra keys in `have` are fine).

    None in `want` means "absent". Scalars compare by their text, because the API server
    turns some numbers into strings (resource quantities).
    """
    if isinstance(want, Mapping):
        if not isinstance(have, Mapping):
            return False
        return all(is_subset(v, have.get(k)) if v is not None else k not in have or have[k] is None
                   for k, v in want.items())
    if isinstance(want, (list, tuple)):
        if not isinstance(have, (list, tuple)) or len(want) != len(have):
            return False
        return all(is_subset(w, h) for w, h in zip(want, have))
    if isinstance(want, bool) or isinstance(have, bool):
        return want == have
    return want == have or (have is not None and str(want) == str(have))


@dataclass(frozen=True)
class PoolFacts:
    """What the operator found out about a pool in one look."""

    generation: int | None
    replicas: int
    observation: Observation | None  # None: the scheduler could not be read
    scheduler_available: bool
    scheduler_error: str | None
    endpoint: str
    ingress_url: str | None
    history: History
    node_group_replicas: int | None = None
    spec_error: str | None = None
    gpus_per_runner: int = 1
    apply_error: str | None = None  # why the API server refused the pool's objects, while it does
    node_group_error: str | None = None  # why the node group could not be read (then not scaled) or scaled
    replica_failures: Mapping[str, str] = field(default_factory=dict)  # component -> why its pods are refused


POD_CREATION_FAILED = "PodCreationFailed"
NODE_GROUP_UNAVAILABLE = "NodeGroupUnavailable"


def pool_status(facts: PoolFacts, previous: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
    """The pool's status: counts, endpoint, autoscaler memory and Ready/Progressing/Degraded."""
    prev = previous or {}
    obs = facts.observation
    runners = list(obs.runners) if obs else []
    healthy = [r for r in runners if r.healthy]
    draining = [r for r in healthy if r.draining]
    busy = [r for r in healthy if r.batch_size > 0]
    idle = [r for r in healthy if r.batch_size == 0 and not r.draining]
    starting = max(0, facts.replicas - (obs.ready_pods if obs else 0))
    status: dict[str, Any] = {
        "observedGeneration": facts.generation,
        "runners": facts.replicas,
        "gpus": facts.replicas * facts.gpus_per_runner,
        "readyRunners": len(healthy),
        "busyRunners": len(busy),
        "idleRunners": len(idle),
        "drainingRunners": len(draining),
        "queueLength": obs.queue_length if obs else 0,
        "endpoint": facts.endpoint,
        "ingressURL": facts.ingress_url,
        "autoscaler": facts.history.to_status(),
        "nodeGroupReplicas": facts.node_group_replicas,
    }
    conds = prev.get("conditions") or []
    gen = facts.generation
    if facts.spec_error:
        conds = set_condition(conds, "Ready", False, "InvalidSpec", facts.spec_error, now, gen)
        conds = set_condition(conds, "Progressing", False, "InvalidSpec", facts.spec_error, now, gen)
        conds = set_condition(conds, "Degraded", True, "InvalidSpec", facts.spec_error, now, gen)
        status["message"] = facts.spec_error
        status["conditions"] = conds
        return status
    refused = dict(facts.replica_failures or {})
    if facts.apply_error:
        ready = (False, "ApplyFailed", facts.apply_error)
    elif not facts.scheduler_available and COMPONENT_SCHEDULER in refused:
        ready = (False, POD_CREATION_FAILED, refused[COMPONENT_SCHEDULER])
    elif not facts.scheduler_available:
        ready = (False, "SchedulerStarting", "the scheduler Deployment has no available replica yet")
    elif obs is None:
        ready = (False, "SchedulerUnreachable", facts.scheduler_error or "the scheduler's admin API did not answer")
    elif not healthy and facts.replicas > 0:
        ready = (False, "NoRunnerReady", "no runner is ready yet")
    else:
        ready = (True, "Serving", f"{len(healthy)} runner(s) ready, {len(busy)} busy")
    if facts.apply_error:
        progressing = (False, "ApplyFailed", facts.apply_error)
    elif refused:  # nothing starts until the cause is removed
        progressing = (False, POD_CREATION_FAILED, "; ".join(refused.values()))
    elif starting:
        progressing = (True, "RunnersStarting", f"{starting} runner(s) starting")
    elif not facts.scheduler_available:
        progressing = (True, "SchedulerStarting", "waiting for the scheduler")
    else:
        progressing = (False, "Stable", "all runners are up")
    unhealthy = [r.id for r in runners if not r.healthy]
    if facts.apply_error:
        degraded = (True, "ApplyFailed", facts.apply_error)
    elif refused:
        degraded = (True, POD_CREATION_FAILED, "; ".join(refused.values()))
    elif facts.scheduler_available and obs is None:
        degraded = (True, "SchedulerUnreachable", facts.scheduler_error or "the scheduler's admin API did not answer")
    elif facts.node_group_error:
        degraded = (True, NODE_GROUP_UNAVAILABLE, facts.node_group_error)
    elif unhealthy:
        degraded = (True, "UnhealthyRunners", f"unhealthy runner(s): {', '.join(sorted(unhealthy))}")
    else:
        degraded = (False, "AsExpected", "")
    conds = set_condition(conds, "Ready", *ready, now, gen)
    conds = set_condition(conds, "Progressing", *progressing, now, gen)
    conds = set_condition(conds, "Degraded", *degraded, now, gen)
    status["conditions"] = conds
    status["message"] = ready[2]
    return status


def merge_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any], *, top_level_only: bool = True) -> dict[str, Any]:
    """A JSON merge patch that turns `old` into `new` (empty when nothing changes).

    Keys of `old` missing from `new` become None (deleted) inside nested objects; at the top
    level they are kept when `top_level_only`, so a status patch leaves fields that other
    code owns alone.
    """
    old = old or {}
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            sub = merge_patch(before, value, top_level_only=False)
            if sub:
                patch[key] = sub
        elif value != before:
            patch[key] = value
    if not top_level_only:
        for key in old:
            if key not in new:
                patch[key] = None
    return patch

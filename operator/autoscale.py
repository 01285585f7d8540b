"""The autoscaler's decision: a pure function of (observation, policy, history, now).

Rules, in order:

- Pressure = requests have queued for at least `scale_up_delay_s` and no active runner is
  lightly loaded (batch below `light_load` of its maximum and that share of KV free).
  Under pressure, draining runners are taken back first (they still hold a GPU); otherwise
  runners are added, `ceil(queue / max_batch)` at a time but at most `max_step`, never above
  `max_runners`, not while earlier runners are still starting, and not twice within
  `scale_up_cooldown_s`.
- With no queue, and no scale-up within the cooldown, one runner that has been idle (empty
  batch) for `idle_seconds` is drained per decision, never taking the active runners below
  `min_runners`. Runners above `max_runners` (the spec was lowered) go at once while they are
  not up yet (one replica fewer each: the ReplicaSet removes pending and unready pods before
  ready ones); the others are drained regardless of idleness, least loaded first.
- A draining runner whose scheduler view shows it draining and empty is removed (unless
  requests are queuing again, when it may soon be taken back): its pod gets
  the lowest deletion cost and the replica count drops by one, so exactly that pod goes. This
  waits until no runner pod is starting (the ReplicaSet would remove an unready pod first) and
  until the pod removed last is gone (so one drained runner is never removed twice).
- A node group, when configured, grows as soon as the runners need more GPUs and shrinks only
  when no runner is draining, starting or terminating. Nodes are counted in GPUs: a runner takes
  `gpus_per_runner` GPUs of one node (a tensor-parallel group never spans nodes), so a node holds
  `gpus_per_node // gpus_per_runner` runners. The node group never goes below what `min_runners`
  needs nor below its own minimum, and that floor follows from the spec alone (`node_floor`),
  so it holds even while the scheduler cannot be read.

History (timestamps and the runners being drained) lives in the pool's status, so a
restarted operator continues the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from lorafleet.operator.spec import PoolSpec


@dataclass(frozen=True)
class RunnerState:
    """One runner as the scheduler's `GET /admin/state` reports it."""

    id: str
    healthy: bool = True
    draining: bool = False
    batch_size: int = 0
    max_batch_size: int = 1
    free_kv_tokens: int = 0
    total_kv_tokens: int = 0
    idle_seconds: float = 0.0

    def lightly_loaded(self, fraction: float) -> bool:
        batch_ok = self.batch_size < fraction * max(1, self.max_batch_size)
        kv_ok = self.total_kv_tokens <= 0 or self.free_kv_tokens >= (1 - fraction) * self.total_kv_tokens
        return batch_ok and kv_ok

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "RunnerState":
        return cls(
            id=str(d["id"]),
            healthy=bool(d.get("healthy", True)),
            draining=bool(d.get("draining", False)),
            batch_size=int(d.get("batch_size", 0)),
            max_batch_size=int(d.get("max_batch_size", 1) or 1),
            free_kv_tokens=int(d.get("free_kv_tokens", 0)),
            total_kv_tokens=int(d.get("total_kv_tokens", 0)),
            idle_seconds=float(d.get("idle_seconds", 0.0)),
        )


@dataclass(frozen=True)
class Observation:
    """What the operator sees: the scheduler's view plus the runner workload's pods."""

    runners: tuple[RunnerState, ...]
    queue_length: int
    replicas: int  # the runner Deployment's spec.replicas
    pods: tuple[str, ...] = ()  # runner pods that exist and are not terminating
    ready_pods: int = 0  # of those, how many are Ready
    terminating: int = 0  # runner pods being deleted (they still hold their GPUs)
    node_group_replicas: int | None = None

    @classmethod
    def from_state(cls, state: Mapping[str, Any], **kw: Any) -> "Observation":
        runners = tuple(RunnerState.from_json(r) for r in state.get("runners") or ())
        return cls(runners=runners, queue_length=int(state.get("queue_length", 0)), **kw)


@dataclass(frozen=True)
class Policy:
    min_runners: int
    max_runners: int
    idle_seconds: float
    scale_up_delay_s: float = 10.0
    scale_up_cooldown_s: float = 60.0
    max_step: int = 2
    max_batch_size: int = 32
    light_load: float = 0.5
    gpus_per_runner: int = 1
    gpus_per_node: int | None = None
    node_min: int = 0
    node_max: int | None = None

    @classmethod
    def from_pool(cls, pool: PoolSpec) -> "Policy":
        ng = pool.node_group
        return cls(
            min_runners=pool.min_runners,
            max_runners=pool.max_runners,
            idle_seconds=pool.idle_seconds,
            scale_up_delay_s=pool.autoscaling.scale_up_delay_s,
            scale_up_cooldown_s=pool.autoscaling.scale_up_cooldown_s,
            max_step=pool.autoscaling.max_step,
            max_batch_size=pool.runner.max_batch_size,
            gpus_per_runner=pool.runner.gpus,
            gpus_per_node=ng.gpus_per_node if ng else None,
            node_min=ng.min_replicas if ng else 0,
            node_max=ng.max_replicas if ng else None,
        )


@dataclass(frozen=True)
class History:
    last_scale_up: float | None = None
    last_scale_down: float | None = None
    queued_since: float | None = None
    draining: Mapping[str, float] = field(default_factory=dict)  # runner id -> when the drain began

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"draining": dict(sorted(self.draining.items()))}
        for key, value in (("lastScaleUp", self.last_scale_up), ("lastScaleDown", self.last_scale_down),
                           ("queuedSince", self.queued_since)):
            if value is not None:
                out[key] = round(value, 3)
        return out

    @classmethod
    def from_status(cls, d: Mapping[str, Any] | None) -> "History":
        d = d or {}
        return cls(
            last_scale_up=d.get("lastScaleUp"),
            last_scale_down=d.get("lastScaleDown"),
            queued_since=d.get("queuedSince"),
            draining={str(k): float(v) for k, v in (d.get("draining") or {}).items()},
        )


@dataclass(frozen=True)
class Decision:
    replicas: int
    history: History
    drain: tuple[str, ...] = ()
    undrain: tuple[str, ...] = ()
    remove: tuple[str, ...] = ()
    node_group_replicas: int | None = None
    reasons: tuple[str, ...] = ()


def gpus_for(runners: int, p: Policy) -> int:
    """GPUs that `runners` runners hold."""
    return max(0, runners) * p.gpus_per_runner


def nodes_for(replicas: int, p: Policy) -> int:
    """Nodes of the node group that `replicas` runners need, within the group's bounds.

    Whole runners per node: with 8-GPU nodes and 3-GPU runners a node holds 2 runners (6 GPUs).
    """
    assert p.gpus_per_node
    per_node = max(1, p.gpus_per_node // max(1, p.gpus_per_runner))
    need = math.ceil(max(0, replicas) / per_node)
    need = max(p.node_min, need)
    return min(p.node_max, need) if p.node_max is not None else need


def node_floor(p: Policy, replicas: int = 0) -> int | None:
    """The fewest nodes the spec alone asks for: what `max(replicas, min_runners)` runners need,
    never below the group's minimum. None without a node group. Needs no view of the scheduler."""
    if not p.gpus_per_node:
        return None
    return nodes_for(max(replicas, p.min_runners), p)


def decide(obs: Observation, policy: Policy, history: History, now: float) -> Decision:
    """What to do now. Pure: same inputs, same decision."""
    reasons: list[str] = []
    pods = set(obs.pods)
    state = {r.id: r for r in obs.runners}
    # Runners being drained: ours (history) plus any the scheduler reports draining; gone pods drop out.
    draining = {rid: t for rid, t in history.draining.items() if rid in pods}
    for r in obs.runners:
        if r.draining and r.id in pods and r.id not in draining:
            draining[r.id] = now
    active = [r for r in obs.runners if r.id in pods and r.healthy and r.id not in draining]
    replicas = obs.replicas
    starting = max(0, replicas - obs.ready_pods)
    last_up, last_down = history.last_scale_up, history.last_scale_down
    drain: list[str] = []
    undrain: list[str] = []
    remove: list[str] = []

    queued = obs.queue_length > 0
    queued_since = (history.queued_since if history.queued_since is not None else now) if queued else None
    light = any(r.lightly_loaded(policy.light_load) for r in active)
    pressure = queued and not light and now - queued_since >= policy.scale_up_delay_s  # type: ignore[operator]
    cooling = last_up is not None and now - last_up < policy.scale_up_cooldown_s

    if replicas < policy.min_runners:
        reasons.append(f"below minRunners: {replicas} -> {policy.min_runners}")
        replicas = policy.min_runners
    # maxRunners lowered below the runners there are: those not up yet hold no requests and go at once.
    cut = min(starting, replicas - len(draining) - policy.max_runners)
    if cut > 0:
        reasons.append(f"above maxRunners ({policy.max_runners}): {replicas} -> {replicas - cut}, "
                       f"{cut} runner(s) not up yet")
        replicas -= cut
        starting -= cut

    if pressure:
        if draining:
            undrain = sorted(draining)
            draining = {}
            last_up = now
            reasons.append(f"queue of {obs.queue_length}: taking back draining runners {undrain}")
        elif replicas >= policy.max_runners:
            reasons.append(f"queue of {obs.queue_length} but at maxRunners ({policy.max_runners})")
        elif starting:
            reasons.append(f"queue of {obs.queue_length}: waiting for {starting} starting runner(s)")
        elif cooling:
            reasons.append(f"queue of {obs.queue_length}: scale-up cooldown")
        else:
            per = max([r.max_batch_size for r in active] + [policy.max_batch_size, 1])
            step = max(1, math.ceil(obs.queue_length / per))
            step = min(step, policy.max_step, policy.max_runners - replicas)
            reasons.append(f"queue of {obs.queue_length} and no lightly loaded runner: {replicas} -> {replicas + step} "
                           f"runners ({gpus_for(replicas, policy)} -> {gpus_for(replicas + step, policy)} GPUs)")
            replicas += step
            last_up = now
    else:
        # Remove drained runners the scheduler shows draining and empty.
        floor_room = replicas - policy.min_runners
        for rid in sorted(draining, key=lambda k: (draining[k], k)):
            r = state.get(rid)
            if r is None or not r.draining or r.batch_size > 0:
                continue
            if queued:  # demand is back: keep it, pressure may take it back
                break
            if starting:
                reasons.append(f"{rid} is drained; waiting for starting runners before removing it")
                break
            if len(pods) > replicas:  # an earlier removal is still under way
                reasons.append(f"{rid} is drained; waiting for the last removed pod to go")
                break
            if len(remove) >= floor_room:
                break
            remove.append(rid)
        if remove:
            for rid in remove:
                draining.pop(rid)
            replicas -= len(remove)
            last_down = now
            reasons.append(f"removing drained runner(s) {remove}: {replicas + len(remove)} -> {replicas}")
        # minRunners was raised while runners were draining: take the surplus drains back.
        keep = replicas - policy.min_runners
        if len(draining) > max(0, keep):
            back = sorted(draining, key=lambda k: (-draining[k], k))[: len(draining) - max(0, keep)]
            for rid in back:
                draining.pop(rid)
            undrain = sorted(back)
            reasons.append(f"minRunners needs {undrain} back")
        # Too many runners for maxRunners: drain the least loaded, idle or not.
        excess = replicas - len(draining) - policy.max_runners
        if excess > 0:
            pick = sorted(active, key=lambda r: (r.batch_size, -r.idle_seconds, r.id))[:excess]
            drain += [r.id for r in pick]
            reasons.append(f"above maxRunners ({policy.max_runners}): draining {[r.id for r in pick]}")
        elif not queued and not cooling:
            idle = [r for r in active if r.batch_size == 0 and r.idle_seconds >= policy.idle_seconds]
            room = min(len(active), replicas - len(draining)) - policy.min_runners
            if idle and room > 0:
                r = sorted(idle, key=lambda r: (-r.idle_seconds, r.id))[0]
                drain.append(r.id)
                reasons.append(f"{r.id} idle for {r.idle_seconds:.0f}s: draining it")
        for rid in drain:
            draining[rid] = now

    # Drains the scheduler forgot (it restarted): ask again, level-triggered.
    redrain = [rid for rid in draining if rid in state and not state[rid].draining and rid not in drain]
    drain += sorted(redrain)

    node_target = None
    if policy.gpus_per_node:
        need = nodes_for(replicas, policy)
        cur = obs.node_group_replicas
        settled = not draining and not remove and not starting and obs.terminating == 0 and len(pods) <= replicas
        if cur is None or need > cur:
            node_target = need
        elif need < cur and settled:
            node_target = need
        if node_target is not None and node_target != cur:
            reasons.append(f"node group: {cur} -> {node_target} nodes for {gpus_for(replicas, policy)} GPUs")
        else:
            node_target = None

    new_history = History(last_scale_up=last_up, last_scale_down=last_down, queued_since=queued_since,
                          draining=dict(sorted(draining.items())))
    return Decision(
        replicas=replicas,
        history=new_history,
        drain=tuple(drain),
        undrain=tuple(undrain),
        remove=tuple(remove),
        node_group_replicas=node_target,
        reasons=tuple(reasons),
    )


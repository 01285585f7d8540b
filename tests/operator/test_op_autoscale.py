"""The autoscaler's pure decision: single decisions, then scripted load traces on a toy cluster."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest

from lorafleet.operator.autoscale import (
    Decision,
    History,
    Observation,
    Policy,
    RunnerState,
    decide,
    gpus_for,
    node_floor,
    nodes_for,
)

pytestmark = pytest.mark.timeout(60)

POLICY = Policy(min_runners=1, max_runners=8, idle_seconds=600, scale_up_delay_s=10, scale_up_cooldown_s=60,
                max_step=2, max_batch_size=32)


def runner(rid, batch=0, idle=0.0, draining=False, healthy=True, free=1000, total=1000):
    return RunnerState(rid, healthy=healthy, draining=draining, batch_size=batch, max_batch_size=32,
                       free_kv_tokens=free, total_kv_tokens=total, idle_seconds=idle)


def obs(runners, queue=0, replicas=None, ready=None, pods=None, **kw):
    ids = tuple(r.id for r in runners) if pods is None else tuple(pods)
    replicas = len(ids) if replicas is None else replicas
    return Observation(runners=tuple(runners), queue_length=queue, replicas=replicas, pods=ids,
                       ready_pods=len(ids) if ready is None else ready, **kw)


# --- single decisions ------------------------------------------------------------------------


def test_queue_must_persist_before_scaling_up():
    o = obs([runner("r0", batch=32)], queue=40)
    d = decide(o, POLICY, History(), now=100)
    assert d.replicas == 1 and d.history.queued_since == 100
    d = decide(o, POLICY, d.history, now=105)
    assert d.replicas == 1
    d = decide(o, POLICY, d.history, now=110)
    assert d.replicas == 3 and d.history.last_scale_up == 110  # ceil(40/32)=2 runners, within max_step


def test_no_scale_up_while_a_runner_is_lightly_loaded():
    o = obs([runner("r0", batch=32), runner("r1", batch=4)], queue=5)
    d = decide(o, POLICY, History(queued_since=0), now=100)
    assert d.replicas == 2 and not d.drain
    # KV nearly full counts as loaded even with a small batch.
    o = obs([runner("r0", batch=32), runner("r1", batch=4, free=100)], queue=5)
    assert decide(o, POLICY, History(queued_since=0), now=100).replicas == 3


def test_scale_up_waits_for_starting_runners_and_cooldown_and_max():
    busy = [runner(f"r{i}", batch=32) for i in range(3)]
    d = decide(obs(busy, queue=100, replicas=4, ready=3), POLICY, History(queued_since=0), now=100)
    assert d.replicas == 4 and any("starting" in r for r in d.reasons)
    d = decide(obs(busy, queue=100), POLICY, History(queued_since=0, last_scale_up=90), now=100)
    assert d.replicas == 3 and any("cooldown" in r for r in d.reasons)
    full = [runner(f"r{i}", batch=32) for i in range(8)]
    d = decide(obs(full, queue=100), POLICY, History(queued_since=0), now=100)
    assert d.replicas == 8 and any("maxRunners" in r for r in d.reasons)
    seven = [runner(f"r{i}", batch=32) for i in range(7)]
    assert decide(obs(seven, queue=500), POLICY, History(queued_since=0), now=100).replicas == 8


def test_scale_from_zero():
    p = Policy(min_runners=0, max_runners=4, idle_seconds=600, scale_up_delay_s=0)
    d = decide(obs([], queue=3), p, History(), now=5)
    assert d.replicas == 1


def test_below_min_is_raised():
    assert decide(obs([], replicas=0), POLICY, History(), now=0).replicas == 1


def test_drains_only_idle_runners_above_min():
    runners = [runner("r0", batch=3), runner("r1", idle=700), runner("r2", idle=900), runner("r3", idle=100)]
    d = decide(obs(runners), POLICY, History(), now=1000)
    assert d.drain == ("r2",) and d.replicas == 4 and d.history.draining == {"r2": 1000}
    # One drain per decision; the next one picks the next idle runner.
    runners[2] = runner("r2", idle=910, draining=True)
    d2 = decide(obs(runners), POLICY, d.history, now=1010)
    assert d2.drain == ("r1",)
    # Nothing idle past the window: nothing drained.
    assert decide(obs([runner("r0", idle=599), runner("r1", batch=1)]), POLICY, History(), now=0).drain == ()
    # Never below minRunners.
    assert decide(obs([runner("r0", idle=5000)]), POLICY, History(), now=0).drain == ()
    # No drain right after a scale-up, nor while requests queue.
    two_idle = [runner("r0", idle=5000), runner("r1", idle=5000)]
    assert decide(obs(two_idle), POLICY, History(last_scale_up=990), now=1000).drain == ()
    assert decide(obs(two_idle, queue=1), POLICY, History(), now=1000).drain == ()


def test_removes_exactly_the_drained_empty_runner():
    h = History(draining={"r1": 50})
    busy_drain = [runner("r0", batch=5), runner("r1", batch=2, draining=True), runner("r2")]
    d = decide(obs(busy_drain), POLICY, h, now=100)
    assert d.remove == () and d.replicas == 3  # still finishing its requests
    empty = [runner("r0", batch=5), runner("r1", draining=True), runner("r2")]
    d = decide(obs(empty), POLICY, h, now=110)
    assert d.remove == ("r1",) and d.replicas == 2 and d.history.draining == {}
    assert d.history.last_scale_down == 110
    # Not while another runner is starting: the ReplicaSet would delete the unready pod instead.
    d = decide(obs(empty, replicas=4, ready=3), POLICY, h, now=110)
    assert d.remove == () and d.replicas == 4
    # Right after a removal the pod may linger (still listed, still draining): never removed twice.
    after = decide(obs(empty, replicas=2, ready=3), POLICY, d.history, now=120)
    assert after.remove == () and after.replicas == 2


def test_pressure_takes_draining_runners_back_first():
    h = History(draining={"r1": 50}, queued_since=0)
    d = decide(obs([runner("r0", batch=32), runner("r1", batch=20, draining=True)], queue=10), POLICY, h, now=100)
    assert d.undrain == ("r1",) and d.replicas == 2 and d.history.draining == {}


def test_raised_min_takes_drains_back():
    p = Policy(min_runners=3, max_runners=8, idle_seconds=600)
    h = History(draining={"r2": 10})
    d = decide(obs([runner("r0"), runner("r1"), runner("r2", draining=True, batch=1)]), p, h, now=100)
    assert d.undrain == ("r2",) and d.remove == ()


def test_lowered_max_drains_least_loaded_even_if_busy():
    p = Policy(min_runners=1, max_runners=2, idle_seconds=600)
    d = decide(obs([runner("r0", batch=9), runner("r1", batch=2), runner("r2", batch=5)]), p, History(), now=0)
    assert d.drain == ("r1",)


def test_drain_is_repeated_when_the_scheduler_forgot_it():
    h = History(draining={"r1": 10})
    d = decide(obs([runner("r0", batch=1), runner("r1", batch=0)]), POLICY, h, now=20)
    assert "r1" in d.drain and d.history.draining == {"r1": 10}


def test_gone_pods_leave_the_history():
    h = History(draining={"gone": 10})
    d = decide(obs([runner("r0", batch=1)]), POLICY, h, now=20)
    assert d.history.draining == {}


@pytest.mark.parametrize("gpus_per_runner, gpus_per_node, runners, nodes", [
    (1, 8, 9, 2),   # 9 GPUs on 8-GPU nodes
    (2, 8, 6, 2),   # 12 GPUs: 4 runners per node
    (3, 8, 3, 2),   # a node holds 2 runners of 3 GPUs (6 of its 8); never a runner across two nodes
    (3, 4, 4, 4),   # by GPU count 12/4 = 3 nodes, but one 3-GPU runner per 4-GPU node: 4
    (8, 8, 5, 5),   # one 8-GPU (TP=8) runner per node
    (4, 8, 0, 0),
])
def test_nodes_count_whole_runners_per_node(gpus_per_runner, gpus_per_node, runners, nodes):
    p = Policy(min_runners=0, max_runners=64, idle_seconds=60, gpus_per_runner=gpus_per_runner,
               gpus_per_node=gpus_per_node)
    assert nodes_for(runners, p) == nodes
    assert gpus_for(runners, p) == runners * gpus_per_runner


def test_node_floor_follows_from_the_spec_alone():
    p = Policy(min_runners=3, max_runners=8, idle_seconds=60, gpus_per_runner=2, gpus_per_node=4, node_min=1,
               node_max=5)
    assert node_floor(p) == 2  # minRunners 3 x 2 GPUs on 4-GPU nodes: 2 runners per node
    assert node_floor(p, replicas=7) == 4  # more runners than the minimum: what they need
    assert node_floor(p, replicas=20) == 5  # capped by the group's maximum
    assert node_floor(Policy(min_runners=0, max_runners=2, idle_seconds=60, gpus_per_node=8, node_min=2)) == 2
    assert node_floor(Policy(min_runners=1, max_runners=2, idle_seconds=60)) is None  # no node group


def test_tensor_parallel_runners_scale_nodes_by_gpus():
    p = Policy(min_runners=1, max_runners=8, idle_seconds=600, scale_up_delay_s=0, max_step=2, gpus_per_runner=4,
               gpus_per_node=8, node_min=1)
    d = decide(obs([runner("r0", batch=32)], queue=64, node_group_replicas=1), p, History(), now=0)
    assert d.replicas == 3 and d.node_group_replicas == 2  # 3 runners x 4 GPUs: 2 per node
    assert any("12 GPUs" in r for r in d.reasons)


def test_node_group_grows_first_and_shrinks_only_when_settled():
    p = Policy(min_runners=1, max_runners=16, idle_seconds=600, scale_up_delay_s=0, gpus_per_runner=2,
               gpus_per_node=8, node_min=1, node_max=3)
    busy = [runner(f"r{i}", batch=32) for i in range(4)]
    d = decide(obs(busy, queue=64, node_group_replicas=1), p, History(), now=0)
    assert d.replicas == 6 and d.node_group_replicas == 2  # 6 runners x 2 GPUs / 8 per node
    # Capped by node_max.
    d = decide(obs([runner(f"r{i}", batch=32) for i in range(12)], queue=64, node_group_replicas=3), p, History(), now=0)
    assert d.replicas == 14 and d.node_group_replicas is None
    # Shrinking waits while a runner drains, then while the removed pod terminates.
    h = History(draining={"r3": 1})
    four = [runner("r0", batch=1), runner("r1", batch=1), runner("r2", batch=1), runner("r3", draining=True)]
    d = decide(obs(four, node_group_replicas=2), p, h, now=10)
    assert d.remove == ("r3",) and d.replicas == 3 and d.node_group_replicas is None
    three = four[:3]
    d = decide(obs(three, terminating=1, node_group_replicas=2), p, History(), now=20)
    assert d.node_group_replicas is None
    d = decide(obs(three, node_group_replicas=2), p, History(), now=30)
    assert d.node_group_replicas == 1


def test_history_round_trips_through_status():
    h = History(last_scale_up=1.5, last_scale_down=None, queued_since=3.25, draining={"b": 2.0, "a": 1.0})
    assert History.from_status(h.to_status()) == h
    assert History.from_status(None) == History()


def test_observation_from_state_json():
    state = {"runners": [{"id": "r0", "url": "http://x", "healthy": True, "draining": False, "batch_size": 3,
                          "max_batch_size": 32, "free_kv_tokens": 12000, "total_kv_tokens": 16384,
                          "idle_seconds": 0.0, "adapters": ["pirate"]}], "queue_length": 2}
    o = Observation.from_state(state, replicas=1, pods=("r0",), ready_pods=1)
    assert o.runners[0] == RunnerState("r0", True, False, 3, 32, 12000, 16384, 0.0) and o.queue_length == 2


# --- scripted traces on a toy cluster ---------------------------------------------------------


@dataclass
class Pod:
    name: str
    ready_at: float
    draining: bool = False
    idle: float = 0.0
    batch: int = 0
    cost: int = 0


@dataclass
class Cluster:
    """Pods start after `start_s`; demand is packed onto the fullest runners (ties: highest id)."""

    policy: Policy
    start_s: float = 40.0
    tick_s: float = 10.0
    now: float = 0.0
    replicas: int = 0
    pods: dict[str, Pod] = field(default_factory=dict)
    history: History = field(default_factory=History)
    serial: int = 0
    log: list[Decision] = field(default_factory=list)
    drained_when: list[tuple[str, int, float]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    replica_trace: list[int] = field(default_factory=list)
    queue_trace: list[int] = field(default_factory=list)
    nodes: int | None = None
    node_trace: list[int | None] = field(default_factory=list)

    def __post_init__(self):
        self.replicas = self.policy.min_runners
        self._reconcile_pods()
        for p in self.pods.values():
            p.ready_at = 0

    def _reconcile_pods(self):
        while len(self.pods) < self.replicas:
            self.serial += 1
            name = f"r{self.serial:03d}"
            self.pods[name] = Pod(name, ready_at=self.now + self.start_s)
        while len(self.pods) > self.replicas:  # the ReplicaSet: unready first, then lowest deletion cost
            victim = min(self.pods.values(), key=lambda p: (p.ready_at <= self.now, p.cost, p.name))
            self.removed.append(victim.name)
            del self.pods[victim.name]

    def step(self, demand: int) -> Decision:
        ready = [p for p in self.pods.values() if p.ready_at <= self.now]
        for p in ready:
            p.batch = 0
        queue = demand
        for p in sorted((p for p in ready if not p.draining), key=lambda p: p.name, reverse=True):
            take = min(queue, self.policy.max_batch_size)
            p.batch, queue = take, queue - take
        for p in ready:
            p.idle = p.idle + self.tick_s if p.batch == 0 else 0.0
        runners = [RunnerState(p.name, True, p.draining, p.batch, self.policy.max_batch_size, 1000 - p.batch * 30,
                               1000, p.idle) for p in ready]
        o = Observation(tuple(runners), queue, self.replicas, tuple(sorted(self.pods)), len(ready),
                        node_group_replicas=self.nodes)
        d = decide(o, self.policy, self.history, self.now)
        for rid in d.drain:
            self.drained_when.append((rid, self.pods[rid].batch, self.pods[rid].idle))
            self.pods[rid].draining = True
        for rid in d.undrain:
            self.pods[rid].draining = False
        for rid in d.remove:
            assert self.pods[rid].draining and self.pods[rid].batch == 0
            self.pods[rid].cost = -1000000
        self.replicas = d.replicas
        self._reconcile_pods()
        if d.node_group_replicas is not None:
            self.nodes = d.node_group_replicas
        self.node_trace.append(self.nodes)
        self.history = d.history
        self.log.append(d)
        self.replica_trace.append(self.replicas)
        self.queue_trace.append(queue)
        self.now += self.tick_s
        assert self.policy.min_runners <= self.replicas <= self.policy.max_runners
        return d

    def run(self, demand_fn, seconds: float):
        for _ in range(int(seconds / self.tick_s)):
            self.step(demand_fn(self.now))


def direction_changes(trace: list[int]) -> int:
    moves = [b - a for a, b in zip(trace, trace[1:]) if b != a]
    return sum(1 for x, y in zip(moves, moves[1:]) if (x > 0) != (y > 0))


def test_trace_ramp_up_steady_ramp_down():
    c = Cluster(POLICY)
    c.run(lambda t: min(200, int(t / 3)), 900)  # ramp to 200 concurrent requests over 10 minutes
    assert c.replicas == math.ceil(200 / 32) == 7
    assert c.queue_trace[-1] == 0
    steady_from = len(c.replica_trace)
    c.run(lambda t: 200, 1800)  # steady
    assert set(c.replica_trace[steady_from:]) == {7}
    c.run(lambda t: 40, 3600)  # ramp down: two runners' worth
    assert c.replicas == 2 and c.queue_trace[-1] == 0
    assert direction_changes(c.replica_trace) == 1  # up, then down: never back and forth
    # Only idle runners were drained, and exactly the drained pods were removed.
    assert c.drained_when and all(batch == 0 and idle >= POLICY.idle_seconds for _, batch, idle in c.drained_when)
    assert sorted(c.removed) == sorted(rid for rid, _, _ in c.drained_when)


def test_trace_short_bursts_do_not_scale():
    c = Cluster(POLICY)
    c.replicas, c.pods = 2, {}
    c._reconcile_pods()
    for p in c.pods.values():
        p.ready_at = 0
    # 10-second spikes above capacity every two minutes: shorter than the scale-up delay.
    c.run(lambda t: 100 if t % 120 < 10 else 20, 3600)
    assert set(c.replica_trace) <= {1, 2}
    assert all(batch == 0 for _, batch, _ in c.drained_when)


def test_trace_long_bursts_scale_up_without_flapping():
    c = Cluster(POLICY)
    # Five minutes of heavy load every 15 minutes: the pool grows and stays (idle window 10 min).
    c.run(lambda t: 180 if (t % 900) < 300 else 30, 4 * 3600)
    assert max(c.replica_trace) >= 6
    changes = direction_changes(c.replica_trace)
    assert changes <= 1, c.replica_trace
    # After the bursts stop, the pool shrinks to what the load needs, never below minRunners.
    c.run(lambda t: 0, 7200)
    assert c.replicas == POLICY.min_runners
    assert all(batch == 0 for _, batch, _ in c.drained_when)


def test_trace_node_group_follows_runners():
    p = Policy(min_runners=1, max_runners=8, idle_seconds=300, scale_up_delay_s=10, scale_up_cooldown_s=30,
               gpus_per_runner=1, gpus_per_node=4)
    c = Cluster(p)
    c.run(lambda t: 220 if t < 1200 else 10, 4800)
    # Enough nodes for the runners at every moment (growth comes with or before the runners).
    assert all(n is not None and n * 4 >= r for n, r in zip(c.node_trace, c.replica_trace))
    assert max(c.node_trace) == 2 and c.node_trace[-1] == 1 and c.replicas == 1
    assert direction_changes([n for n in c.node_trace if n is not None]) == 1


def test_evicted_and_deleted_pods_are_no_replicas():
    """An evicted pod (phase Failed) stays listed until it is garbage-collected, long after its ReplicaSet replaced
    it: counted as a replica it would hold back every drained runner's removal ("an earlier removal is still under
    way") and the node group's shrinking for good. A pod being deleted holds its GPU until it has gone."""
    from lorafleet.operator.reconcile import replica_pods

    def pod(name, phase="Running", deleting=False):
        meta = {"name": name, **({"deletionTimestamp": "2026-01-01T10:00:00Z"} if deleting else {})}
        return {"metadata": meta, "status": {"phase": phase}}

    pods = [pod("up"), pod("pending", "Pending"), pod("evicted", "Failed"), pod("done", "Succeeded"),
            pod("going", deleting=True), pod("gone-evicted", "Failed", deleting=True), {"metadata": {"name": "new"}}]
    alive, deleting = replica_pods(pods)
    assert [p["metadata"]["name"] for p in alive] == ["up", "pending", "new"]
    assert deleting == 1
    # A drained, empty runner is removed while an evicted pod of the pool lingers (counted, it was held back).
    h = History(draining={"r1": 50})
    empty = [runner("r0", batch=5), runner("r1", draining=True), runner("r2")]
    lingering = [pod("r0"), pod("r1"), pod("r2"), pod("r9", "Failed")]
    names = tuple(x["metadata"]["name"] for x in replica_pods(lingering)[0])
    d = decide(obs(empty, pods=names), POLICY, h, now=110)
    assert d.remove == ("r1",) and d.replicas == 2
    d = decide(obs(empty, replicas=3, pods=names + ("r9",), ready=3), POLICY, h, now=110)
    assert d.remove == () and d.replicas == 3  # what counting it did

"""The operator's side effects: apply a pool's children, look at a pool, act on decisions.

Everything here is idempotent: it reads the current state from the API and the scheduler and
writes only what differs, so running it again (or after a restart) changes nothing.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import aiohttp

from lorafleet.common import sources
from lorafleet.common.kubeclient import ApiError, KubeClient, api_path
from lorafleet.operator import builders
from lorafleet.operator import constants as c
from lorafleet.operator.admin import AdminClient, SchedulerUnavailable
from lorafleet.operator.autoscale import Decision, History, Observation, Policy, decide, node_floor
from lorafleet.operator.config import OperatorConfig
from lorafleet.operator.credentials import Credentials
from lorafleet.operator.spec import PoolSpec, SpecError, base_shape_from_config, base_shape_status
from lorafleet.operator.status import is_subset

log = logging.getLogger(__name__)

SHAPE_RETRY_S = 600.0  # how long to wait before reading an unreachable base model's config.json again


@dataclass
class Context:
    """What handlers share: settings, the API client, an HTTP session, the credentials key."""

    config: OperatorConfig
    kube: KubeClient
    http: aiohttp.ClientSession
    credentials: Credentials
    last_apply: dict[tuple[str, str], float] = field(default_factory=dict)
    apply_errors: dict[tuple[str, str], str] = field(default_factory=dict)  # pool -> why the API refused its objects
    node_group_errors: dict[tuple[str, str], str] = field(default_factory=dict)  # pool -> its node group error
    node_group_strikes: dict[tuple[str, str], int] = field(default_factory=dict)  # pool -> transient errors in a row
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    shape_failures: dict[str, float] = field(default_factory=dict)  # model source -> when reading it failed
    shape_reads: dict[str, asyncio.Task] = field(default_factory=dict)  # model source -> the read under way
    closed: bool = False
    # Blocking source reads run here, not on the loop's default executor (aiohttp needs that one
    # for name resolution), and at most this many at a time.
    fetch_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=4, thread_name_prefix="lorafleet-fetch"))

    async def blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.fetch_pool, functools.partial(fn, *args, **kwargs))

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """One writer per pool at a time (its change handlers and its daemon)."""
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    async def close(self) -> None:
        self.closed = True  # daemons that outlive the cleanup stop at their next round
        self.fetch_pool.shutdown(wait=False, cancel_futures=True)
        await self.http.close()
        await self.kube.close()


# --- applying children -------------------------------------------------------------------------


def applied_hash(obj: Mapping[str, Any]) -> str:
    """Hash of what we apply, without the replica count (the autoscaler owns it)."""
    body = json.loads(json.dumps(obj))
    if body.get("kind") == "Deployment":
        body.get("spec", {}).pop("replicas", None)
    body.get("metadata", {}).get("annotations", {}).pop(c.ANNOTATION_APPLIED, None)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


async def stale(kube: KubeClient, obj: dict[str, Any]) -> bool:
    """Whether the live object differs from `obj` (stamping `obj` with the hash that says what was applied)."""
    digest = applied_hash(obj)
    meta = obj["metadata"]
    plural = await kube.plural_of(obj["apiVersion"], obj["kind"])
    live = await kube.get(obj["apiVersion"], plural, meta["name"], meta.get("namespace"))
    if live is not None:
        live_hash = (live.get("metadata", {}).get("annotations") or {}).get(c.ANNOTATION_APPLIED)
        if live_hash == digest and is_subset(obj, live):
            return False
    meta.setdefault("annotations", {})[c.ANNOTATION_APPLIED] = digest
    return True


async def dry_run(kube: KubeClient, obj: Mapping[str, Any]) -> None:
    """Server-side apply of `obj` with dryRun=All: raises the ApiError the real write would meet
    (validation, admission), writes nothing. A server that cannot dry-run a missing object (404) passes."""
    meta = obj["metadata"]
    plural = await kube.plural_of(obj["apiVersion"], obj["kind"])
    path = api_path(obj["apiVersion"], plural, meta.get("namespace"), meta["name"])
    params = {"fieldManager": c.FIELD_MANAGER, "force": "true", "dryRun": "All"}
    try:
        await kube.request("PATCH", path, params=params, body=obj, content_type="application/apply-patch+yaml")
    except ApiError as exc:
        if exc.status != 404:
            raise


async def apply_credentials(ctx: Context, pool: PoolSpec, owner: Mapping[str, Any]) -> None:
    """Write the pool's credential Secrets (server-side apply, a no-op when unchanged).

    Their values are derived from the operator's key (credentials.py), so they are written
    without reading them first: the operator needs create/patch on Secrets, never get/list/watch.
    """
    creds = ctx.credentials
    for secret in builders.credential_secrets(pool, creds.admin_token(pool.namespace, pool.name),
                                              creds.runner_token(pool.namespace, pool.name), owner):
        await ctx.kube.apply(secret, c.FIELD_MANAGER)


def wanted_replicas(pool: PoolSpec, live: Mapping[str, Any] | None) -> int:
    """The runner replica count to apply: the live one (the autoscaler's), within the bounds."""
    if not pool.autoscaling.enabled:
        return pool.min_runners
    current = (live or {}).get("spec", {}).get("replicas")
    if current is None:
        return pool.min_runners
    # Above maxRunners the autoscaler drains the surplus first, so only raise to the minimum here.
    return max(pool.min_runners, int(current))


async def apply_pool(ctx: Context, pool: PoolSpec, owner: Mapping[str, Any]) -> list[str]:
    """Create or update every child of a pool; return the kinds/names that were written."""
    async with ctx.lock(pool.namespace, pool.name):
        return await _apply_pool(ctx, pool, owner)


async def _apply_pool(ctx: Context, pool: PoolSpec, owner: Mapping[str, Any]) -> list[str]:
    await apply_credentials(ctx, pool, owner)
    live_runner = await ctx.kube.get("apps/v1", "deployments", c.runner_name(pool.name), pool.namespace)
    objs = builders.children(pool, ctx.config, wanted_replicas(pool, live_runner), owner, ctx.credentials.fingerprint)
    changed = [obj for obj in objs if await stale(ctx.kube, obj)]
    # All or nothing: an object the API server would refuse stops the apply before anything is written,
    # so a pool never runs half of a spec (e.g. a new scheduler beside the old runners, or no runners).
    for obj in changed:
        await dry_run(ctx.kube, obj)
    written = []
    for obj in changed:
        await ctx.kube.apply(obj, c.FIELD_MANAGER)
        written.append(f"{obj['kind']}/{obj['metadata']['name']}")
    if not pool.ingress.enabled:
        if await delete_owned(ctx.kube, "networking.k8s.io/v1", "ingresses", c.ingress_name(pool.name), pool):
            written.append(f"Ingress/{c.ingress_name(pool.name)} (deleted)")
    if not pool.network_policy.enabled:
        name = c.network_policy_name(pool.name)
        if await delete_owned(ctx.kube, "networking.k8s.io/v1", "networkpolicies", name, pool):
            written.append(f"NetworkPolicy/{name} (deleted)")
    ctx.last_apply[(pool.namespace, pool.name)] = time.monotonic()
    return written


def refused(exc: ApiError) -> bool:
    """Whether the API server refused an object we sent for what it is (invalid, unknown fields, bad
    quantities): sending it again changes nothing until the pool's spec does. Conflicts, throttling,
    RBAC and an unavailable server are not refusals."""
    if exc.status in (400, 422):
        return True
    # Server-side apply answers 500 when it cannot even type the object (a field a kind does not declare,
    # a quantity that does not parse).
    return exc.status == 500 and exc.message.startswith(("failed to create typed patch object", "failed to convert"))


def owned_by(obj: Mapping[str, Any], pool: str) -> bool:
    """Whether an object carries this operator's labels for `pool` (never touch anyone else's)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(c.LABEL_MANAGED_BY) == c.MANAGED_BY and labels.get(c.LABEL_POOL) == pool


async def delete_owned(kube: KubeClient, api_version: str, plural: str, name: str, pool: PoolSpec | str,
                       namespace: str | None = None) -> bool:
    """Delete an object of the pool's if it exists; True when a deletion was requested."""
    pool_name = pool if isinstance(pool, str) else pool.name
    ns = namespace if namespace is not None else (pool.namespace if not isinstance(pool, str) else None)
    live = await kube.get(api_version, plural, name, ns)
    if live is None or live.get("metadata", {}).get("deletionTimestamp"):
        return False
    if not owned_by(live, pool_name):
        log.warning("not deleting %s %s/%s: it is not managed by this operator for pool %s", plural, ns, name, pool_name)
        return False
    return await kube.delete(api_version, plural, name, ns)


# The credential Secrets are not listed: the operator cannot read Secrets (to check they are its
# own), so the garbage collector removes them through their owner reference to the pool.
CHILDREN = (
    ("networking.k8s.io/v1", "ingresses", c.ingress_name),
    ("networking.k8s.io/v1", "networkpolicies", c.network_policy_name),
    ("apps/v1", "deployments", c.runner_name),
    ("v1", "services", c.runner_name),
    ("apps/v1", "deployments", c.scheduler_name),
    ("v1", "services", c.scheduler_name),
    ("rbac.authorization.k8s.io/v1", "rolebindings", c.scheduler_name),
    ("rbac.authorization.k8s.io/v1", "roles", c.scheduler_name),
    ("v1", "serviceaccounts", c.scheduler_name),
    ("v1", "serviceaccounts", c.runner_name),
)


async def delete_pool_children(ctx: Context, name: str, namespace: str) -> list[str]:
    """Delete what a pool owns (owner references would too; this does not wait for the GC)."""
    deleted = []
    for api_version, plural, naming in CHILDREN:
        if await delete_owned(ctx.kube, api_version, plural, naming(name), name, namespace):
            deleted.append(f"{plural}/{naming(name)}")
    ctx.last_apply.pop((namespace, name), None)
    ctx.apply_errors.pop((namespace, name), None)
    ctx.node_group_errors.pop((namespace, name), None)
    ctx.node_group_strikes.pop((namespace, name), None)
    ctx.locks.pop((namespace, name), None)
    return deleted


# --- the scheduler -----------------------------------------------------------------------------


def admin_client(ctx: Context, namespace: str, pool: str) -> AdminClient:
    """A client of the pool scheduler's admin API (its token is derived, nothing is read)."""
    url = ctx.config.scheduler_url.format(name=pool, namespace=namespace)
    return AdminClient(ctx.http, url, ctx.credentials.admin_token(namespace, pool), ctx.config.http_timeout_s)


async def learn_base_shape(ctx: Context, pool: PoolSpec, status: Mapping[str, Any] | None) -> dict | None:
    """Read config.json of a remote base model once per source: the status' `baseModel`.

    Callers at the same time (a pool's resume handler and its first look) share one read, so a
    failure is reported once; after a failure the source is not read again for SHAPE_RETRY_S.
    """
    known = (status or {}).get("baseModel") or {}
    if known.get("source") == pool.model_source:
        return None
    src = sources.parse_source(pool.model_source)
    if not src.remote:
        return None  # a PVC or image path: runners check adapters against it instead
    failed_at = ctx.shape_failures.get(pool.model_source)
    if failed_at is not None and time.monotonic() - failed_at < SHAPE_RETRY_S:
        return None
    task = ctx.shape_reads.get(pool.model_source)
    if task is None:
        task = asyncio.ensure_future(_read_base_shape(ctx, pool))
        ctx.shape_reads[pool.model_source] = task
        task.add_done_callback(lambda _t, key=pool.model_source: ctx.shape_reads.pop(key, None))
    return await asyncio.shield(task)


async def _read_base_shape(ctx: Context, pool: PoolSpec) -> dict | None:
    try:
        cfg = await ctx.blocking(sources.read_model_config, pool.model_source, timeout=ctx.config.fetch_timeout_s)
        shape = base_shape_from_config(cfg)
    except (sources.SourceError, SpecError) as exc:
        log.warning("pool %s/%s: base model shape unknown (runners will check adapters): %s",
                    pool.namespace, pool.name, exc)
        ctx.shape_failures[pool.model_source] = time.monotonic()
        if isinstance(exc, SpecError) and str(exc).startswith("base model:"):
            return {"source": pool.model_source, "error": str(exc)}  # a family the runners cannot serve
        return None
    return base_shape_status(shape, pool.model_source)


# --- looking at a pool and acting --------------------------------------------------------------


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or ()
    return any(x.get("type") == "Ready" and x.get("status") == "True" for x in conds)


FINISHED_PHASES = ("Succeeded", "Failed")  # an evicted or finished pod: no replica any more, no GPU held


def replica_pods(pods: list[dict]) -> tuple[list[dict], int]:
    """Of a Deployment's pods, the replicas it has now (not being deleted, not finished: an evicted pod stays listed
    until it is garbage-collected, long after its ReplicaSet replaced it) and how many are being deleted while they
    may still run (they hold their GPUs until they go)."""
    def phase(p: dict) -> str | None:
        return (p.get("status") or {}).get("phase")

    alive = [p for p in pods if not p["metadata"].get("deletionTimestamp") and phase(p) not in FINISHED_PHASES]
    deleting = sum(1 for p in pods if p["metadata"].get("deletionTimestamp") and phase(p) not in FINISHED_PHASES)
    return alive, deleting


async def runner_pods(ctx: Context, pool: PoolSpec) -> list[dict]:
    listing = await ctx.kube.list("v1", "pods", pool.namespace, label_selector=c.label_selector(pool.name, c.COMPONENT_RUNNER))
    want = c.selector_labels(pool.name, c.COMPONENT_RUNNER)
    return [p for p in listing.get("items") or ()
            if all((p.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in want.items())]


async def node_group_replicas(ctx: Context, pool: PoolSpec) -> int | None:
    """The node group's replicas from its scale subresource; ApiError saying what is wrong when it cannot be read."""
    ng = pool.node_group
    if ng is None:
        return None
    try:
        plural = await ctx.kube.plural_of(ng.api_version, ng.kind)
    except ApiError as exc:
        if exc.status != 404:
            raise
        raise ApiError(404, "NotFound", f"the API server does not serve kind {ng.kind} in {ng.api_version} "
                       "(is its CRD installed?)") from None
    where = ng.namespace or pool.namespace
    scale = await ctx.kube.get(ng.api_version, plural, ng.name, where, subresource="scale")
    if scale is None:
        raise ApiError(404, "NotFound", f"{ng.kind} {where}/{ng.name} not found")
    return int((scale.get("spec") or {}).get("replicas") or 0)


# HTTP answers that the next round may not get (429 Too Many Requests; 500, 502, 503, 504: an overloaded or
# restarting API server): a node group read or scale that gets one is reported only from the NODE_GROUP_PATIENCE-th
# round in a row.
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
NODE_GROUP_PATIENCE = 3


@dataclass(frozen=True)
class NodeGroupFault:
    """Why a pool's node group could not be read or scaled; transient where the API answered 429 or 5xx."""

    message: str
    transient: bool = False

    @classmethod
    def of(cls, what: str, exc: ApiError) -> NodeGroupFault:
        return cls(f"{what}: {exc.message or exc}", exc.status in TRANSIENT_STATUSES)


def replica_failure(deployment: Mapping[str, Any] | None) -> str | None:
    """Why a Deployment cannot create its pods (its ReplicaFailure condition: a missing PriorityClass,
    a quota, an admission webhook), or None."""
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or ():
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            name = (deployment or {}).get("metadata", {}).get("name")
            return f"Deployment {name} cannot create pods: {cond.get('message') or cond.get('reason')}"
    return None


@dataclass(frozen=True)
class Look:
    """One look at a pool: what the autoscaler and the status need."""

    replicas: int
    observation: Observation | None
    scheduler_available: bool
    scheduler_error: str | None
    node_group_replicas: int | None  # None: no node group, or it could not be read (node_group_error)
    runner_deployment_exists: bool
    node_group_error: NodeGroupFault | None = None
    replica_failures: Mapping[str, str] = field(default_factory=dict)  # component -> why its pods are refused


async def look(ctx: Context, pool: PoolSpec, admin: AdminClient | None) -> Look:
    runner = await ctx.kube.get("apps/v1", "deployments", c.runner_name(pool.name), pool.namespace)
    sched = await ctx.kube.get("apps/v1", "deployments", c.scheduler_name(pool.name), pool.namespace)
    replicas = int(((runner or {}).get("spec") or {}).get("replicas") or 0)
    available = int(((sched or {}).get("status") or {}).get("availableReplicas") or 0) > 0
    failures = {component: why for component, why in ((c.COMPONENT_SCHEDULER, replica_failure(sched)),
                                                       (c.COMPONENT_RUNNER, replica_failure(runner))) if why}
    pods = await runner_pods(ctx, pool)
    alive, terminating = replica_pods(pods)
    names = tuple(sorted(p["metadata"]["name"] for p in alive))
    ready = sum(1 for p in alive if _pod_ready(p))
    nodes, nodes_error = None, None
    try:
        nodes = await node_group_replicas(ctx, pool)
    except ApiError as exc:
        ng = pool.node_group
        assert ng is not None
        nodes_error = NodeGroupFault.of(f"node group {ng.kind}/{ng.name} cannot be read", exc)
    state, error = None, None
    if admin is not None:
        try:
            state = await admin.state()
        except SchedulerUnavailable as exc:
            error = str(exc)
    obs = None
    if state is not None:
        obs = Observation.from_state(state, replicas=replicas, pods=names, ready_pods=ready,
                                     terminating=terminating, node_group_replicas=nodes)
    return Look(replicas, obs, available, error, nodes, runner is not None, nodes_error, failures)


async def scale_runners(ctx: Context, pool: PoolSpec, replicas: int) -> bool:
    """Set the runner Deployment's replicas; False when it is gone (deleted since the look)."""
    return await ctx.kube.patch("apps/v1", "deployments", c.runner_name(pool.name), {"spec": {"replicas": replicas}},
                                pool.namespace, subresource="scale") is not None


GONE = "the runner Deployment is gone"  # (an action line: it went between the look and the scale)


async def act(ctx: Context, pool: PoolSpec, admin: AdminClient, decision: Decision,
              current: Look) -> tuple[list[str], int | None]:
    """Carry out a decision's runner changes in a safe order; return one line per action taken and the runner
    Deployment's replicas after them (None: it went since the look, so they were not set)."""
    done = []
    for rid in decision.undrain:
        await admin.undrain(rid)
        done.append(f"undrained runner {rid}")
    for rid in decision.drain:
        await admin.drain(rid)
        done.append(f"draining idle runner {rid}")
    removed, gone = [], []
    for rid in decision.remove:
        # Exactly this pod must go: lowest deletion cost first, then one replica fewer. For a pod that went since
        # the look the replicas drop too (decide() removes nothing while a runner starts, so every other pod was
        # Ready): a replacement the ReplicaSet made meanwhile is unscheduled or Pending, which a ReplicaSet deletes
        # before any Running pod.
        cost = {"metadata": {"annotations": {c.ANNOTATION_DELETION_COST: c.DRAINED_DELETION_COST}}}
        patched = await ctx.kube.patch("v1", "pods", rid, cost, pool.namespace)
        (removed if patched is not None else gone).append(rid)
    if decision.replicas != current.replicas:
        scaled = await scale_runners(ctx, pool, decision.replicas)
        what = [f"removing {', '.join(removed)}"] if removed else []
        what += [f"{', '.join(gone)} already gone"] if gone else []
        done.append(f"runners {current.replicas} -> {decision.replicas}" + (f" ({'; '.join(what)})" if what else "")
                    + ("" if scaled else f" not set: {GONE}"))
        if not scaled:
            return done, None
    return done, decision.replicas


@dataclass(frozen=True)
class Round:
    """One autoscaler round: the new history, one line per action, the decision (None where only the lower bounds
    were kept), the runners it leaves, and the node group as known after it: its replicas (None: no node group, or
    not known) and why it could not be read or scaled (None when it could)."""

    history: History
    actions: list[str]
    decision: Decision | None
    replicas: int  # the runner Deployment's replicas after the round
    node_group_replicas: int | None
    node_group_error: NodeGroupFault | None = None


async def scale_node_group(ctx: Context, pool: PoolSpec, current: Look, target: int | None,
                           why: str = "") -> tuple[list[str], int | None, NodeGroupFault | None]:
    """Set the node group's replicas to `target` (None: leave it; a group that could not be read is never scaled
    blind). Returns the action taken, and the group as known after: `target` once set; when setting it failed, no
    target but what the look read (None when the group is gone), and why."""
    ng, have = pool.node_group, current.node_group_replicas
    if ng is None or target is None or have is None or target == have:
        return [], have, current.node_group_error
    where = ng.namespace or pool.namespace
    try:
        plural = await ctx.kube.plural_of(ng.api_version, ng.kind)
        done = await ctx.kube.patch(ng.api_version, plural, ng.name, {"spec": {"replicas": target}}, where,
                                    subresource="scale")
    except ApiError as exc:
        failed = exc
    else:
        if done is not None:
            return [f"node group {ng.kind}/{ng.name}: {have} -> {target}{why}"], target, None
        failed = ApiError(404, "NotFound", f"{ng.kind} {where}/{ng.name} not found")  # it went since the look
    error = NodeGroupFault.of(f"node group {ng.kind}/{ng.name} cannot be scaled", failed)
    return [], None if failed.status == 404 else have, error


def floor_target(pool: PoolSpec, runners: int, current: Look) -> tuple[int | None, str]:
    """The node group's target from the spec alone (autoscale.node_floor; None: it holds that already, it is never
    lowered here, or it could not be read), and the words that say why."""
    floor = node_floor(Policy.from_pool(pool), runners)
    have = current.node_group_replicas
    target = floor if floor is not None and have is not None and have < floor else None
    return target, f" (its minimum for {runners} runner(s))"


async def autoscale(ctx: Context, pool: PoolSpec, admin: AdminClient | None, current: Look,
                    history: History, now: float) -> Round:
    """One autoscaler round: decide from the look, act, scale the node group; what happened and is known after."""
    exists = current.runner_deployment_exists
    actions: list[str] = []
    decision = None
    replicas = current.replicas

    async def to_min(why: str) -> None:
        nonlocal replicas
        scaled = await scale_runners(ctx, pool, pool.min_runners)
        actions.append(f"runners {current.replicas} -> {pool.min_runners} " + (f"({why})" if scaled else
                                                                                f"not set: {GONE}"))
        replicas = pool.min_runners if scaled else 0

    if not pool.autoscaling.enabled:
        if exists and current.replicas != pool.min_runners:  # a fixed pool runs exactly minRunners
            await to_min("autoscaling off")
        target, why = floor_target(pool, pool.min_runners, current)
    elif current.observation is None or admin is None or not exists:
        # Without the scheduler's view only the lower bounds are kept (removing needs a drain first).
        if exists and current.replicas < pool.min_runners:
            await to_min("minRunners")
        target, why = floor_target(pool, max(current.replicas, pool.min_runners), current)
    else:
        decision = decide(current.observation, Policy.from_pool(pool), history, now)
        actions, after = await act(ctx, pool, admin, decision, current)
        if after is None:  # the runners were not scaled: no history of it, and the node group is left as it is
            replicas, target, why = 0, None, ""
        else:
            history, target, why, replicas = decision.history, decision.node_group_replicas, "", after
    scaled, nodes, error = await scale_node_group(ctx, pool, current, target, why)
    return Round(history, actions + scaled, decision, replicas, nodes, error)


def node_group_verdict(ctx: Context, pool: PoolSpec, error: NodeGroupFault | None, reported: bool) -> str | None:
    """Why the status says a pool's node group cannot be read or scaled this round (None: it says nothing). A
    transient fault is held back (logged at INFO) until its NODE_GROUP_PATIENCE-th round in a row, unless the status
    already reports the group (`reported`: its Degraded reason is NodeGroupUnavailable, also as a restarted operator
    finds it), which then keeps saying so. Each reason that is reported is logged once, as a warning."""
    key = (pool.namespace, pool.name)
    strikes = ctx.node_group_strikes.pop(key, 0) + 1  # (cleared by any other outcome)
    if error is not None and error.transient:
        ctx.node_group_strikes[key] = strikes
        if strikes < NODE_GROUP_PATIENCE and not reported:
            log.info("pool %s/%s: %s (round %d in a row; reported from round %d)", pool.namespace, pool.name,
                     error.message, strikes, NODE_GROUP_PATIENCE)
            return None
    message = error.message if error is not None else None
    if message is not None and ctx.node_group_errors.get(key) != message:
        log.warning("pool %s/%s: %s", pool.namespace, pool.name, message)
    if message is None:
        ctx.node_group_errors.pop(key, None)
    else:
        ctx.node_group_errors[key] = message
    return message

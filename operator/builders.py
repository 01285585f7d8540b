"""Pure functions: a ServingPool's spec -> the Kubernetes objects that run it.

Nothing here talks to a cluster; `reconcile.py` applies what these return. Every object
carries the pool's labels and an owner reference to the pool.
"""

from __future__ import annotations

import base64
from typing import Any, Mapping

from lorafleet.operator import constants as c
from lorafleet.operator.config import OperatorConfig
from lorafleet.operator.spec import PoolSpec

Obj = dict[str, Any]

GPU_TOLERATION = {"key": c.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def owner_reference(owner: Mapping[str, Any]) -> Obj:
    """The controller reference to a ServingPool body (apiVersion, kind, metadata.name/uid)."""
    meta = owner["metadata"]
    return {
        "apiVersion": owner.get("apiVersion", c.API_VERSION),
        "kind": owner.get("kind", c.POOL_KIND),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(pool: PoolSpec, name: str, component: str, owner: Mapping[str, Any] | None) -> Obj:
    meta: Obj = {"name": name, "namespace": pool.namespace, "labels": c.labels(pool.name, component)}
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    return meta


def _pvc_claim(source: str) -> str | None:
    if source.startswith("pvc://"):
        return source[len("pvc://"):].split("/", 1)[0]
    return None


def _pvc_volume(claim: str) -> Obj:
    return {"name": f"pvc-{claim}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}


def _pvc_mount(claim: str) -> Obj:
    return {"name": f"pvc-{claim}", "mountPath": f"{c.PVC_ROOT}/{claim}", "readOnly": True}


def _env(pool: PoolSpec, extra: tuple[Mapping[str, Any], ...]) -> list[Obj]:
    base = [
        {"name": c.ENV_PVC_ROOT, "value": c.PVC_ROOT},
        {"name": c.ENV_CACHE, "value": c.CACHE_DIR},
    ]
    return base + [dict(e) for e in extra]


def _env_from(pool: PoolSpec) -> list[Obj] | None:
    if not pool.credentials_secret:
        return None
    return [{"secretRef": {"name": pool.credentials_secret}}]


def _pull_secrets(pool: PoolSpec) -> list[Obj] | None:
    return [{"name": n} for n in pool.image_pull_secrets] or None


def _probe(path: str, port: str, period: int, failures: int, delay: int = 0) -> Obj:
    probe: Obj = {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
                  "timeoutSeconds": 5, "failureThreshold": failures}
    if delay:
        probe["initialDelaySeconds"] = delay
    return probe


def _drop_none(obj: Any) -> Any:
    """Remove None values recursively (optional fields a spec left out)."""
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj


# --- identities and access -------------------------------------------------------------------


def service_accounts(pool: PoolSpec, owner: Mapping[str, Any] | None = None) -> list[Obj]:
    """The scheduler's account (reads the API) and the runners' (no API token at all)."""
    sched = {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": _meta(pool, c.scheduler_name(pool.name), c.COMPONENT_SCHEDULER, owner)}
    runner = {"apiVersion": "v1", "kind": "ServiceAccount",
              "metadata": _meta(pool, c.runner_name(pool.name), c.COMPONENT_RUNNER, owner),
              "automountServiceAccountToken": False}
    return [sched, runner]


def scheduler_role(pool: PoolSpec, owner: Mapping[str, Any] | None = None) -> Obj:
    """Least privilege for the scheduler's feeds: read pods, EndpointSlices and LoraAdapters."""
    def read() -> list[str]:
        return ["get", "list", "watch"]

    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(pool, c.scheduler_name(pool.name), c.COMPONENT_SCHEDULER, owner),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": read()},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": read()},
            {"apiGroups": [c.GROUP], "resources": [c.ADAPTERS], "verbs": read()},
        ],
    }


def scheduler_role_binding(pool: PoolSpec, owner: Mapping[str, Any] | None = None) -> Obj:
    name = c.scheduler_name(pool.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(pool, name, c.COMPONENT_SCHEDULER, owner),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.namespace}],
    }


def token_secret(pool: PoolSpec, name: str, component: str, token: str,
                 owner: Mapping[str, Any] | None = None) -> Obj:
    """A per-pool credential Secret (key `token`); its value is derived, see credentials.py."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(pool, name, component, owner),
        "type": "Opaque",
        "data": {c.ADMIN_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def credential_secrets(pool: PoolSpec, admin_token: str, runner_token: str,
                       owner: Mapping[str, Any] | None = None) -> list[Obj]:
    """The scheduler's admin token and the runner credential of a pool."""
    return [token_secret(pool, c.admin_secret_name(pool.name), c.COMPONENT_SCHEDULER, admin_token, owner),
            token_secret(pool, c.runner_token_secret_name(pool.name), c.COMPONENT_RUNNER, runner_token, owner)]


def _secret_env(name: str, secret: str, key: str) -> Obj:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _runner_token_env(pool: PoolSpec) -> Obj:
    return _secret_env(c.ENV_RUNNER_TOKEN, c.runner_token_secret_name(pool.name), c.RUNNER_TOKEN_KEY)


def _template_meta(pool: PoolSpec, component: str, credentials_id: str | None) -> Obj:
    meta: Obj = {"labels": c.labels(pool.name, component)}
    if credentials_id:
        meta["annotations"] = {c.ANNOTATION_CREDENTIALS: credentials_id}
    return meta


# --- scheduler ---------------------------------------------------------------------------------


# The scheduler pod's shortest grace period: it relays every stream of the pool, and while an old scheduler drains,
# the new one (maxSurge 1) already serves, so a long period costs no availability.
SCHEDULER_MIN_GRACE_SECONDS = 120


def scheduler_grace_seconds(pool: PoolSpec) -> int:
    """The scheduler pod's grace period: at least the runners' (whose streams it relays), at least 120 s."""
    return max(SCHEDULER_MIN_GRACE_SECONDS, pool.runner.grace_seconds)


def drain_seconds(grace_seconds: int) -> int:
    """How long a runner or the scheduler, on SIGTERM, lets requests in flight finish: its pod's grace period minus a
    margin, so that it ends what is left itself (an error to each client) before the kubelet's SIGKILL."""
    return max(5, grace_seconds - 10)


def scheduler_deployment(pool: PoolSpec, config: OperatorConfig, owner: Mapping[str, Any] | None = None,
                         credentials_id: str | None = None) -> Obj:
    """One scheduler replica: it holds every request's state and the cluster view in memory.

    `credentials_id` (the key's fingerprint) goes on the pod template, so new tokens roll the pod.
    """
    name = c.scheduler_name(pool.name)
    s = pool.scheduler
    grace = scheduler_grace_seconds(pool)
    args = ["scheduler", "--host", "0.0.0.0", "--port", str(c.SCHEDULER_PORT), "--model", pool.model_source,
            "--kube", "--namespace", pool.namespace, "--pool", pool.name, "--grace-seconds", str(drain_seconds(grace))]
    env = [
        _secret_env(c.ENV_ADMIN_TOKEN, c.admin_secret_name(pool.name), c.ADMIN_TOKEN_KEY),
        _runner_token_env(pool),
        {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
        *_env(pool, s.env),
    ]
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": c.CACHE_DIR}]
    if pool.api_keys_secret:  # keys of the OpenAI endpoints, read from a file the kubelet keeps current
        args += ["--api-keys", c.API_KEYS_FILE]
        if pool.prefix_cache.salt_per_api_key:  # tenants do not share cached prompt pages
            args.append("--cache-salt-per-key")
        volumes.append({"name": "api-keys", "secret": {"secretName": pool.api_keys_secret, "defaultMode": 0o440,
                                                       "items": [{"key": c.API_KEYS_KEY, "path": c.API_KEYS_KEY}]}})
        mounts.append({"name": "api-keys", "mountPath": c.API_KEYS_DIR, "readOnly": True})
    args += list(s.extra_args)
    claim = _pvc_claim(pool.model_source)
    if claim:  # the scheduler reads the base model's tokenizer
        volumes.append(_pvc_volume(claim))
        mounts.append(_pvc_mount(claim))
    container = {
        "name": "scheduler",
        "image": s.image or config.scheduler_image,
        "imagePullPolicy": s.image_pull_policy,
        "command": ["lorafleet"],
        "args": args,
        "env": env,
        "envFrom": _env_from(pool),
        "ports": [{"name": "http", "containerPort": c.SCHEDULER_PORT, "protocol": "TCP"}],
        # Ready means "can take requests": it queues them even with no runner, which is what
        # lets the autoscaler grow a pool from zero runners. /readyz (>= 1 runner) is not used.
        "readinessProbe": _probe("/healthz", "http", 5, 3),
        "livenessProbe": _probe("/healthz", "http", 10, 6, delay=10),
        "resources": dict(s.resources) or {"requests": {"cpu": "1", "memory": "2Gi"}},
        "securityContext": {**RESTRICTED, "readOnlyRootFilesystem": True},
        "volumeMounts": mounts,
    }
    pod_spec = {
        "serviceAccountName": name,
        "terminationGracePeriodSeconds": grace,
        "securityContext": {"runAsNonRoot": True, "fsGroup": 1000},
        "containers": [container],
        "volumes": volumes,
        "nodeSelector": dict(s.node_selector) or None,
        "tolerations": [dict(t) for t in s.tolerations] or None,
        "imagePullSecrets": _pull_secrets(pool),
    }
    sel = c.selector_labels(pool.name, c.COMPONENT_SCHEDULER)
    return _drop_none({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(pool, name, c.COMPONENT_SCHEDULER, owner),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "selector": {"matchLabels": sel},
            "template": {"metadata": _template_meta(pool, c.COMPONENT_SCHEDULER, credentials_id), "spec": pod_spec},
        },
    })


def scheduler_service(pool: PoolSpec, owner: Mapping[str, Any] | None = None) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(pool, c.scheduler_name(pool.name), c.COMPONENT_SCHEDULER, owner),
        "spec": {
            "type": "ClusterIP",
            "selector": c.selector_labels(pool.name, c.COMPONENT_SCHEDULER),
            "ports": [{"name": "http", "port": c.SCHEDULER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def ingress(pool: PoolSpec, owner: Mapping[str, Any] | None = None) -> Obj | None:
    """The pool's public endpoint (`/v1` only), or None when `spec.ingress.enabled` is false."""
    ing = pool.ingress
    if not ing.enabled:
        return None
    meta = _meta(pool, c.ingress_name(pool.name), c.COMPONENT_SCHEDULER, owner)
    if ing.annotations:
        meta["annotations"] = dict(ing.annotations)
    path = {
        "path": c.INGRESS_PATH,  # the OpenAI API only: never /, /metrics or /admin
        "pathType": "Prefix",
        "backend": {"service": {"name": c.scheduler_name(pool.name), "port": {"number": c.SCHEDULER_PORT}}},
    }
    rule: Obj = {"http": {"paths": [path]}}
    if ing.host:
        rule["host"] = ing.host
    spec: Obj = {"rules": [rule]}
    if ing.class_name:
        spec["ingressClassName"] = ing.class_name
    if ing.tls_secret:
        spec["tls"] = [{"hosts": [ing.host] if ing.host else [], "secretName": ing.tls_secret}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": meta, "spec": spec}


# --- runners -----------------------------------------------------------------------------------


def runner_args(pool: PoolSpec) -> list[str]:
    """`lorafleet runner` bound to the pod's own address only; `--tp N` for a multi-GPU runner; `--no-prefix-cache`
    when the pool turns the prefix cache off; `--quantization` / `--kv-cache-dtype` when the pool asks for FP8."""
    r = pool.runner
    args = ["runner", "--host", f"$({c.ENV_POD_IP})", "--port", str(c.RUNNER_PORT), "--model", pool.model_source,
            "--device", "cuda", "--max-batch-size", str(r.max_batch_size), "--kv-fraction", f"{r.kv_fraction:g}",
            "--max-lora-rank", str(r.max_lora_rank),
            "--grace-seconds", str(drain_seconds(r.grace_seconds))]
    if not pool.prefix_cache.enabled:
        args.append("--no-prefix-cache")
    if r.quantization != "auto":
        args += ["--quantization", r.quantization]
    if r.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", r.kv_cache_dtype]
    if r.gpus > 1:
        args += ["--tp", str(r.gpus)]
    return args + list(r.extra_args)


def runner_resources(pool: PoolSpec) -> Obj:
    """The spec's requests/limits with the GPUs added (GPUs are requested as limits == requests)."""
    res = pool.runner.resources
    requests = dict(res.get("requests") or {})
    limits = dict(res.get("limits") or {})
    limits[c.GPU_RESOURCE] = str(pool.runner.gpus)
    requests[c.GPU_RESOURCE] = str(pool.runner.gpus)
    return {"requests": requests, "limits": limits}


def runner_deployment(
    pool: PoolSpec, config: OperatorConfig, replicas: int, owner: Mapping[str, Any] | None = None,
    credentials_id: str | None = None,
) -> Obj:
    """The runner workload. `replicas` belongs to the autoscaler: callers pass the live value.

    A Deployment (not a StatefulSet) so that the autoscaler removes exactly a drained pod
    through its pod-deletion-cost. Rolling updates replace one runner at a time without a
    spare GPU (maxSurge 0); the scheduler re-places the requests of the runner that goes.
    """
    name = c.runner_name(pool.name)
    r = pool.runner
    env = [{"name": c.ENV_RUNNER_ID, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": c.ENV_POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           _runner_token_env(pool),
           *_env(pool, r.env)]
    volumes: list[Obj] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts: list[Obj] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": c.CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    claims = list(dict.fromkeys([x for x in [_pvc_claim(pool.model_source)] if x] + list(pool.adapter_volumes)))
    for claim in claims:
        volumes.append(_pvc_volume(claim))
        mounts.append(_pvc_mount(claim))
    container = {
        "name": "runner",
        "image": r.image or config.runner_image,
        "imagePullPolicy": r.image_pull_policy,
        "command": ["lorafleet"],
        "args": runner_args(pool),
        "env": env,
        "envFrom": _env_from(pool),
        "ports": [{"name": "http", "containerPort": c.RUNNER_PORT, "protocol": "TCP"}],
        # Loading a 7B model takes minutes: the startup probe allows 30 min before liveness counts.
        "startupProbe": _probe("/healthz", "http", 10, 180),
        "livenessProbe": _probe("/healthz", "http", 10, 6),
        "readinessProbe": _probe("/readyz", "http", 5, 3),
        "resources": runner_resources(pool),
        "securityContext": dict(RESTRICTED),
        "volumeMounts": mounts,
    }
    pod_spec = {
        "serviceAccountName": name,
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": r.grace_seconds,
        "securityContext": {"runAsNonRoot": True, "fsGroup": 1000},
        "containers": [container],
        "volumes": volumes,
        "nodeSelector": dict(r.node_selector) or None,
        "tolerations": [GPU_TOLERATION] + [dict(t) for t in r.tolerations if dict(t) != GPU_TOLERATION],
        "affinity": dict(r.affinity) if r.affinity else None,
        "priorityClassName": r.priority_class,
        "imagePullSecrets": _pull_secrets(pool),
    }
    return _drop_none({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(pool, name, c.COMPONENT_RUNNER, owner),
        "spec": {
            "replicas": replicas,
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "selector": {"matchLabels": c.selector_labels(pool.name, c.COMPONENT_RUNNER)},
            "template": {"metadata": _template_meta(pool, c.COMPONENT_RUNNER, credentials_id), "spec": pod_spec},
        },
    })


def runner_service(pool: PoolSpec, owner: Mapping[str, Any] | None = None) -> Obj:
    """Headless: one DNS record and EndpointSlice entry per ready runner (and a metrics target)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(pool, c.runner_name(pool.name), c.COMPONENT_RUNNER, owner),
        "spec": {
            "clusterIP": "None",
            "selector": c.selector_labels(pool.name, c.COMPONENT_RUNNER),
            "ports": [{"name": "http", "port": c.RUNNER_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def network_policy(pool: PoolSpec, owner: Mapping[str, Any] | None = None) -> Obj | None:
    """Runner pods accept connections only from the pool's scheduler pods (same namespace), plus the
    spec's `networkPolicy.additionalPeers` (e.g. a metrics scraper); None when turned off.

    The operator itself never calls runners (it goes through the scheduler's admin API).
    """
    if not pool.network_policy.enabled:
        return None
    peers: list[Obj] = [{"podSelector": {"matchLabels": c.selector_labels(pool.name, c.COMPONENT_SCHEDULER)}}]
    peers += [dict(p) for p in pool.network_policy.additional_peers]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(pool, c.network_policy_name(pool.name), c.COMPONENT_RUNNER, owner),
        "spec": {
            "podSelector": {"matchLabels": c.selector_labels(pool.name, c.COMPONENT_RUNNER)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": c.RUNNER_PORT}]}],
        },
    }


def children(
    pool: PoolSpec, config: OperatorConfig, runner_replicas: int, owner: Mapping[str, Any] | None = None,
    credentials_id: str | None = None,
) -> list[Obj]:
    """Every object a pool owns except its credential Secrets, in creation order."""
    objs = [
        *service_accounts(pool, owner),
        scheduler_role(pool, owner),
        scheduler_role_binding(pool, owner),
    ]
    policy = network_policy(pool, owner)
    if policy is not None:  # before the runners start
        objs.append(policy)
    objs += [
        scheduler_deployment(pool, config, owner, credentials_id),
        scheduler_service(pool, owner),
        runner_deployment(pool, config, runner_replicas, owner, credentials_id),
        runner_service(pool, owner),
    ]
    ing = ingress(pool, owner)
    if ing is not None:
        objs.append(ing)
    return objs


def endpoint_url(pool: PoolSpec) -> str:
    return f"http://{c.scheduler_name(pool.name)}.{pool.namespace}.svc:{c.SCHEDULER_PORT}"


def ingress_url(pool: PoolSpec) -> str | None:
    ing = pool.ingress
    if not ing.enabled or not ing.host:
        return None
    scheme = "https" if ing.tls_secret else "http"
    return f"{scheme}://{ing.host}{c.INGRESS_PATH}"

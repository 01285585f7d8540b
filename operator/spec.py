"""Typed views of the ServingPool and LoraAdapter specs, with the CRD defaults applied.

The API server applies the defaults of `crds/*.yaml`; parsing applies them again so that
the operator behaves the same on an object that skipped defaulting. Keep both in step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from lorafleet.common import sources
from lorafleet.common.peft_config import BaseShape
from lorafleet.operator import constants as c

MAX_GPUS_PER_RUNNER = 8  # one tensor-parallel group lives on one node
KV_FRACTION_RANGE = (0.05, 0.99)  # runner.kvFraction, as the CRD bounds it
# A pool's name prefixes its Services' names, which must be DNS-1035 labels (the CRD checks it too).
_POOL_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_POOL_NAME = 40  # as the CRD bounds it: suffixed Service and Deployment names stay within 63 characters
QUANTIZATIONS = ("auto", "fp8")  # runner.quantization: auto = as the checkpoint stores its weights
KV_CACHE_DTYPES = ("auto", "fp8")  # runner.kvCacheDtype: auto = the model's dtype


@dataclass(frozen=True)
class RunnerSpec:
    image: str | None = None
    image_pull_policy: str | None = None
    gpus: int = 1
    max_batch_size: int = 32
    kv_fraction: float = 0.9
    max_lora_rank: int = 64
    quantization: str = "auto"  # fp8: the runners' --quantization fp8
    kv_cache_dtype: str = "auto"  # fp8: the runners' --kv-cache-dtype fp8
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class: str | None = None
    grace_seconds: int = 120
    env: tuple[Mapping[str, Any], ...] = ()
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class SchedulerSpec:
    image: str | None = None
    image_pull_policy: str | None = None
    resources: Mapping[str, Any] = field(default_factory=dict)
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = True
    scale_up_delay_s: int = 10
    scale_up_cooldown_s: int = 60
    max_step: int = 2


@dataclass(frozen=True)
class IngressSpec:
    enabled: bool = False
    class_name: str | None = None
    host: str | None = None
    path: str = "/v1"  # always /v1: the Ingress never publishes /, /metrics or /admin
    tls_secret: str | None = None
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class NetworkPolicySpec:
    """The runners' NetworkPolicy: only the pool's scheduler pods (plus `additional_peers`) get in."""

    enabled: bool = True
    additional_peers: tuple[Mapping[str, Any], ...] = ()  # NetworkPolicyPeer objects, e.g. a Prometheus


@dataclass(frozen=True)
class PrefixCacheSpec:
    """The runners' prefix cache (on unless `enabled` is false) and per-API-key salting of it."""

    enabled: bool = True
    salt_per_api_key: bool = False  # the scheduler's --cache-salt-per-key (needs api keys)


@dataclass(frozen=True)
class NodeGroupSpec:
    api_version: str
    kind: str
    name: str
    gpus_per_node: int
    namespace: str | None = None
    min_replicas: int = 0
    max_replicas: int | None = None


@dataclass(frozen=True)
class PoolSpec:
    name: str
    namespace: str
    model_source: str
    runner: RunnerSpec = RunnerSpec()
    scheduler: SchedulerSpec = SchedulerSpec()
    image_pull_secrets: tuple[str, ...] = ()
    credentials_secret: str | None = None
    adapter_volumes: tuple[str, ...] = ()
    min_runners: int = 1
    max_runners: int = 4
    idle_seconds: int = 600
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    ingress: IngressSpec = IngressSpec()
    node_group: NodeGroupSpec | None = None
    api_keys_secret: str | None = None  # spec.apiKeys.secretName: keys of the OpenAI endpoints
    network_policy: NetworkPolicySpec = NetworkPolicySpec()
    prefix_cache: PrefixCacheSpec = PrefixCacheSpec()

    @property
    def gpus_per_runner(self) -> int:
        return self.runner.gpus


class SpecError(ValueError):
    """A spec the operator cannot act on (the CRD's validation would have refused it)."""


def _section(spec: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """spec[key] as a mapping ({} when absent). Another type is a SpecError here: met later as an AttributeError in
    a handler, it would be a traceback retried forever instead of a status that says what is wrong."""
    value = spec.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{key} must be an object, got {type(value).__name__} {_short(value)}")
    return value


def _tuple(value: Any, field: str) -> tuple:
    """A list field as a tuple (() when absent). A string or an object is refused: tuple() would turn it into its
    characters or keys (extraArgs "--x" into "-", "-", "x"), a silently wrong spec."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise SpecError(f"{field} must be a list, got {type(value).__name__} {_short(value)}")
    return tuple(value)


def _int(field: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """An integer field within the CRD's bounds (the API server checks them; the operator must not rely on it).
    A bool, a fraction or a non-number is refused rather than truncated or met as a TypeError."""
    n = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        n = int(value)
    if n is None:
        raise SpecError(f"{field} must be an integer, got {_short(value)}")
    if (low is not None and n < low) or (high is not None and n > high):
        bounds = (f"{low} to {high}" if low is not None and high is not None
                  else f"at least {low}" if low is not None else f"at most {high}")
        raise SpecError(f"{field} is {n}: it must be {bounds}")
    return n


def _short(value: Any) -> str:
    """A value for a message, cut short (a spec field may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _bool(field: str, value: Any) -> bool:
    """A boolean field: bool("false") is True, so a string (or anything else) is refused, not read as on."""
    if not isinstance(value, bool):
        raise SpecError(f"{field} must be true or false, got {_short(value)}")
    return value


def _fraction(value: Any) -> float:
    """runner.kvFraction as a float (its range is checked with the rest of the runner's fields)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise SpecError(f"runner.kvFraction must be a number, got {_short(value)}") from None


def _check_env(field: str, env: tuple[Mapping[str, Any], ...], reserved: tuple[str, ...]) -> None:
    """One entry per name, none of them one the operator sets itself."""
    if not all(isinstance(e, Mapping) for e in env):
        raise SpecError(f"{field} must be a list of objects with a name (Kubernetes EnvVar)")
    names = [str(e.get("name") or "") for e in env]
    taken = sorted({n for n in names if n in reserved})
    if taken:
        raise SpecError(f"{field} sets {', '.join(taken)}: the operator sets {', '.join(reserved)} itself")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SpecError(f"{field} sets {', '.join(twice)} more than once")


def parse_pool(name: str, namespace: str, spec: Mapping[str, Any]) -> PoolSpec:
    """Turn a ServingPool's `spec` into a PoolSpec; raise SpecError when it is unusable."""
    model = spec.get("model") or {}
    source = model.get("source") if isinstance(model, Mapping) else None
    if not source:
        raise SpecError("spec.model.source is required")
    if not _POOL_NAME.match(name) or len(name) > MAX_POOL_NAME:
        raise SpecError(f"the ServingPool name {_short(name)} must be a DNS-1035 label of at most {MAX_POOL_NAME} "
                        "characters (lowercase letters, digits and '-', starting with a letter): it names the pool's "
                        "Services")
    try:
        sources.parse_source(str(source))
    except sources.SourceError as exc:
        raise SpecError(f"spec.model.source: {exc}") from None
    r = _section(spec, "runner")
    s = _section(spec, "scheduler")
    a = _section(spec, "autoscaling")
    i = _section(spec, "ingress")
    runner = RunnerSpec(
        image=r.get("image"),
        image_pull_policy=r.get("imagePullPolicy"),
        gpus=_int("runner.gpusPerRunner", r.get("gpusPerRunner", 1)),  # (its range is checked below)
        max_batch_size=_int("runner.maxBatchSize", r.get("maxBatchSize", 32), 1, 1024),
        kv_fraction=_fraction(r.get("kvFraction", 0.9)),
        max_lora_rank=_int("runner.maxLoraRank", r.get("maxLoraRank", 64), 1, 128),
        quantization=str(r.get("quantization", "auto")),
        kv_cache_dtype=str(r.get("kvCacheDtype", "auto")),
        resources=dict(r.get("resources") or {}),
        node_selector=dict(r.get("nodeSelector") or {}),
        tolerations=_tuple(r.get("tolerations"), "runner.tolerations"),
        affinity=r.get("affinity") or None,
        priority_class=r.get("priorityClassName") or None,
        grace_seconds=_int("runner.terminationGracePeriodSeconds", r.get("terminationGracePeriodSeconds", 120),
                           10, 3600),
        env=_tuple(r.get("env"), "runner.env"),
        extra_args=tuple(str(x) for x in _tuple(r.get("extraArgs"), "runner.extraArgs")),
    )
    if not 1 <= runner.gpus <= MAX_GPUS_PER_RUNNER:
        raise SpecError(f"runner.gpusPerRunner is {runner.gpus}: it must be 1 to {MAX_GPUS_PER_RUNNER} "
                        "(the GPUs of one tensor-parallel runner on one node)")
    low, high = KV_FRACTION_RANGE
    if not low <= runner.kv_fraction <= high:
        raise SpecError(f"runner.kvFraction is {runner.kv_fraction:g}: it must be {low:g} to {high:g} (the share of the "
                        "GPU memory left after the weights that holds KV pages)")
    if runner.quantization not in QUANTIZATIONS:
        raise SpecError(f"runner.quantization is {runner.quantization!r}: it must be one of {', '.join(QUANTIZATIONS)} "
                        "(auto: the weights as the checkpoint stores them; fp8: FP8 weights with a scale per row)")
    if runner.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise SpecError(f"runner.kvCacheDtype is {runner.kv_cache_dtype!r}: it must be one of "
                        f"{', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype; fp8: e4m3 K/V pages)")
    _check_env("runner.env", runner.env, c.RUNNER_ENV)
    scheduler = SchedulerSpec(
        image=s.get("image"),
        image_pull_policy=s.get("imagePullPolicy"),
        resources=dict(s.get("resources") or {}),
        node_selector=dict(s.get("nodeSelector") or {}),
        tolerations=_tuple(s.get("tolerations"), "scheduler.tolerations"),
        env=_tuple(s.get("env"), "scheduler.env"),
        extra_args=tuple(str(x) for x in _tuple(s.get("extraArgs"), "scheduler.extraArgs")),
    )
    _check_env("scheduler.env", scheduler.env, c.SCHEDULER_ENV)
    autoscaling = AutoscalingSpec(
        enabled=_bool("autoscaling.enabled", a.get("enabled", True)),
        scale_up_delay_s=_int("autoscaling.scaleUpDelaySeconds", a.get("scaleUpDelaySeconds", 10), 0, 3600),
        scale_up_cooldown_s=_int("autoscaling.scaleUpCooldownSeconds", a.get("scaleUpCooldownSeconds", 60), 0, 3600),
        max_step=_int("autoscaling.maxScaleUpStep", a.get("maxScaleUpStep", 2), 1, 64),
    )
    ingress = IngressSpec(
        enabled=_bool("ingress.enabled", i.get("enabled", False)),
        class_name=i.get("className") or None,
        host=i.get("host") or None,
        path=i.get("path") or "/v1",
        tls_secret=i.get("tlsSecretName") or None,
        annotations=dict(i.get("annotations") or {}),
    )
    if ingress.path != "/v1":
        raise SpecError(f"ingress.path is {ingress.path!r}: the Ingress publishes only the OpenAI API under /v1 "
                        "(never /, /metrics or /admin), so the path must be /v1")
    keys = spec.get("apiKeys") or {}
    api_keys_secret = keys.get("secretName") if isinstance(keys, Mapping) else None
    np = _section(spec, "networkPolicy")
    network_policy = NetworkPolicySpec(enabled=_bool("networkPolicy.enabled", np.get("enabled", True)),
                                       additional_peers=_tuple(np.get("additionalPeers"),
                                                               "networkPolicy.additionalPeers"))
    pc = _section(spec, "prefixCache")
    prefix_cache = PrefixCacheSpec(enabled=_bool("prefixCache.enabled", pc.get("enabled", True)),
                                   salt_per_api_key=_bool("prefixCache.saltPerApiKey", pc.get("saltPerApiKey", False)))
    if prefix_cache.salt_per_api_key and not api_keys_secret:
        raise SpecError("prefixCache.saltPerApiKey needs apiKeys.secretName: without API keys there is no key to "
                        "salt the cache by")
    node_group = None
    ng = _section(spec, "nodeGroup")
    if ng:
        missing = [k for k in ("apiVersion", "kind", "name", "gpusPerNode") if not ng.get(k)]
        if missing:
            raise SpecError(f"spec.nodeGroup needs {', '.join(missing)}")
        node_group = NodeGroupSpec(
            api_version=ng["apiVersion"],
            kind=ng["kind"],
            name=ng["name"],
            gpus_per_node=_int("nodeGroup.gpusPerNode", ng["gpusPerNode"], high=64),
            namespace=ng.get("namespace") or None,
            min_replicas=_int("nodeGroup.minReplicas", ng.get("minReplicas", 0), 0),
            max_replicas=(_int("nodeGroup.maxReplicas", ng["maxReplicas"], 1)
                          if ng.get("maxReplicas") is not None else None),
        )
        if node_group.gpus_per_node < runner.gpus:
            raise SpecError("nodeGroup.gpusPerNode must be at least runner.gpusPerRunner")
        if node_group.max_replicas is not None and node_group.min_replicas > node_group.max_replicas:
            raise SpecError(f"nodeGroup.minReplicas ({node_group.min_replicas}) must not exceed nodeGroup.maxReplicas "
                            f"({node_group.max_replicas})")
    pool = PoolSpec(
        name=name,
        namespace=namespace,
        model_source=str(source),
        runner=runner,
        scheduler=scheduler,
        image_pull_secrets=tuple(str(x) for x in _tuple(spec.get("imagePullSecrets"), "imagePullSecrets")),
        credentials_secret=spec.get("credentialsSecret") or None,
        adapter_volumes=tuple(str(x) for x in _tuple(spec.get("adapterVolumes"), "adapterVolumes")),
        min_runners=_int("minRunners", spec.get("minRunners", 1), 0, 1024),
        max_runners=_int("maxRunners", spec.get("maxRunners", 4), 1, 1024),
        idle_seconds=_int("idleSecondsBeforeDrain", spec.get("idleSecondsBeforeDrain", 600), 1, 86400),
        autoscaling=autoscaling,
        ingress=ingress,
        node_group=node_group,
        api_keys_secret=str(api_keys_secret) if api_keys_secret else None,
        network_policy=network_policy,
        prefix_cache=prefix_cache,
    )
    if pool.min_runners > pool.max_runners:
        raise SpecError(f"minRunners ({pool.min_runners}) must not exceed maxRunners ({pool.max_runners})")
    return pool


def base_shape_from_status(status: Mapping[str, Any] | None) -> BaseShape | None:
    """The base model shape a pool's status carries (see `base_shape_from_config`), if any."""
    b = (status or {}).get("baseModel") or {}
    try:
        return BaseShape(
            num_layers=int(b["numLayers"]),
            hidden_size=int(b["hiddenSize"]),
            intermediate_size=int(b["intermediateSize"]),
            q_dim=int(b["qDim"]),
            kv_dim=int(b["kvDim"]),
            name=str(b.get("name") or ""),
            family=str(b.get("family") or "llama"),
        )
    except (KeyError, TypeError, ValueError):
        return None


def base_shape_from_config(config: Mapping[str, Any], name: str = "") -> BaseShape:
    """An HF config.json -> the dimensions LoRA weights must fit and the family that names their modules;
    a family the runners do not support is refused here, naming the supported ones."""
    from lorafleet.models import registry
    from lorafleet.models.contract import ModelConfigError

    try:
        cfg = registry.config_from_hf(dict(config), name=name or str(config.get("_name_or_path") or ""))
    except ModelConfigError as exc:
        raise SpecError(f"base model: {exc}") from None
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        raise SpecError(f"config.json lacks a decoder shape ({exc!r})") from None
    return cfg.base_shape()


def base_shape_status(shape: BaseShape, source: str) -> dict[str, Any]:
    return {
        "source": source,
        "name": shape.name,
        "numLayers": shape.num_layers,
        "hiddenSize": shape.hidden_size,
        "intermediateSize": shape.intermediate_size,
        "qDim": shape.q_dim,
        "kvDim": shape.kv_dim,
        "family": shape.family,
        "error": None,  # (a merge patch: clears an earlier refusal of this source)
    }

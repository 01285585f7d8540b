"""Names, labels, ports and API coordinates shared by the operator and the scheduler's feeds."""

from __future__ import annotations

GROUP = "lorafleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
POOLS = "servingpools"
ADAPTERS = "loraadapters"
POOL_KIND = "ServingPool"
ADAPTER_KIND = "LoraAdapter"

FIELD_MANAGER = "lorafleet-operator"
KOPF_PREFIX = f"kopf.{GROUP}"  # kopf's progress and diff-base annotations
FINALIZER = f"{GROUP}/cleanup"

# Ports of the two services (docs/api.md).
SCHEDULER_PORT = 8000
RUNNER_PORT = 8001

# Where runner pods mount the PVCs named in a pool (pvc://claim/path -> PVC_ROOT/claim/path).
PVC_ROOT = "/mnt/lorafleet/pvc"
CACHE_DIR = "/var/cache/lorafleet"

# Labels. Selector labels are the first two; the others describe the object.
LABEL_POOL = f"{GROUP}/pool"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_PART_OF = "app.kubernetes.io/part-of"
APP_NAME = "lorafleet"
MANAGED_BY = "lorafleet-operator"
COMPONENT_SCHEDULER = "scheduler"
COMPONENT_RUNNER = "runner"

# Annotations.
ANNOTATION_APPLIED = f"{GROUP}/applied-hash"
# On pod templates: a fingerprint of the operator's credentials key, so that a new key rolls the pods
# (their tokens come from Secrets through environment variables, read once at container start).
ANNOTATION_CREDENTIALS = f"{GROUP}/credentials"
ANNOTATION_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
DRAINED_DELETION_COST = "-1000000"

# The key of the token in the per-pool credential Secrets (admin token, runner token).
ADMIN_TOKEN_KEY = "token"
RUNNER_TOKEN_KEY = "token"
# Environment variables that carry the credentials into pods (CONTRACT: runner credential).
ENV_ADMIN_TOKEN = "LORAFLEET_ADMIN_TOKEN"
ENV_RUNNER_TOKEN = "LORAFLEET_RUNNER_TOKEN"
ENV_POD_IP = "POD_IP"
ENV_RUNNER_ID = "LORAFLEET_RUNNER_ID"
ENV_PVC_ROOT = "LORAFLEET_PVC_ROOT"
ENV_CACHE = "LORAFLEET_CACHE"
# What the operator sets in each container; a pool's `env` may not set these too (the CRD refuses them).
RUNNER_ENV = (ENV_RUNNER_ID, ENV_POD_IP, ENV_RUNNER_TOKEN, ENV_PVC_ROOT, ENV_CACHE)
SCHEDULER_ENV = (ENV_ADMIN_TOKEN, ENV_RUNNER_TOKEN, "HOME", ENV_PVC_ROOT, ENV_CACHE)

# API keys of a pool's OpenAI endpoints: the Secret named in spec.apiKeys, key `keys`, mounted here.
API_KEYS_KEY = "keys"
API_KEYS_DIR = "/etc/lorafleet/api-keys"
API_KEYS_FILE = f"{API_KEYS_DIR}/{API_KEYS_KEY}"

# The only path the optional Ingress publishes (never /, /metrics or /admin).
INGRESS_PATH = "/v1"

# Extended resource of one GPU, and the usual taint of GPU nodes.
GPU_RESOURCE = "nvidia.com/gpu"


def scheduler_name(pool: str) -> str:
    """Deployment, Service, ServiceAccount, Role and RoleBinding of a pool's scheduler."""
    return f"{pool}-scheduler"


def runner_name(pool: str) -> str:
    """Deployment, headless Service and ServiceAccount of a pool's runners."""
    return f"{pool}-runner"


def admin_secret_name(pool: str) -> str:
    return f"{pool}-admin"


def runner_token_secret_name(pool: str) -> str:
    """The Secret holding the credential the pool's scheduler presents to its runners."""
    return f"{pool}-runner-token"


def network_policy_name(pool: str) -> str:
    """The NetworkPolicy that admits only the pool's scheduler to its runners."""
    return f"{pool}-runner"


def ingress_name(pool: str) -> str:
    return pool


def selector_labels(pool: str, component: str) -> dict[str, str]:
    return {LABEL_POOL: pool, LABEL_COMPONENT: component}


def labels(pool: str, component: str) -> dict[str, str]:
    return {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: pool,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_PART_OF: APP_NAME,
        **selector_labels(pool, component),
    }


def label_selector(pool: str, component: str) -> str:
    """The `labelSelector` query string of a pool's pods of one component."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(pool, component).items())

"""`lorafleet operator`: run the kopf operator over `lorafleet.operator.main`."""

from __future__ import annotations

import argparse
import asyncio
import importlib

from lorafleet.common import cli_args
from lorafleet.operator.config import OperatorConfig

DEFAULTS = OperatorConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], metavar="NS",
                       help="serve only this namespace (repeatable; globs allowed); default: all namespaces")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="serve the whole cluster (the default)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="liveness endpoint URL to listen on ('' turns it off)")
    parser.add_argument("--scheduler-image", default=DEFAULTS.scheduler_image,
                        help="image of pools' schedulers when a pool names none (this operator's image)")
    parser.add_argument("--runner-image", default=DEFAULTS.runner_image,
                        help="image of pools' runners when a pool names none")
    parser.add_argument("--scheduler-url", default=DEFAULTS.scheduler_url,
                        help="URL of a pool's scheduler; {name} and {namespace} are the pool's")
    parser.add_argument("--sync-interval", type=cli_args.positive_float, default=DEFAULTS.sync_interval_s,
                        help="seconds between two looks at a pool (status and autoscaler; default: %(default)s)")
    parser.add_argument("--resync-interval", type=cli_args.positive_float, default=DEFAULTS.resync_interval_s,
                        help="seconds between two re-applies of a pool's objects (heals drift; default: %(default)s)")
    parser.add_argument("--adapter-retry", type=cli_args.positive_float, default=DEFAULTS.adapter_retry_s,
                        help="seconds between re-checks of Pending, retryably Failed and Ready adapters "
                             "(default: %(default)s)")
    parser.add_argument("--no-scanning", action="store_true",
                        help="do not watch CRDs and namespaces (when RBAC does not allow listing them)")
    parser.add_argument("--credentials-key-file", default=None, metavar="FILE",
                        help="file holding the key each pool's admin and runner tokens are derived from "
                             "(the chart mounts it from a Secret); default: a random key per process")


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    return OperatorConfig(
        scheduler_image=args.scheduler_image,
        runner_image=args.runner_image,
        scheduler_url=args.scheduler_url,
        sync_interval_s=args.sync_interval,
        resync_interval_s=args.resync_interval,
        adapter_retry_s=args.adapter_retry,
        scanning=not args.no_scanning,
        credentials_key_file=args.credentials_key_file,
    )


def run(args: argparse.Namespace) -> int:
    import kopf

    from lorafleet.operator.credentials import Credentials, KeyError_

    if args.credentials_key_file:  # a bad key file is a clear error now, not a crash later
        try:
            Credentials.from_file(args.credentials_key_file)
        except KeyError_ as exc:
            raise SystemExit(f"lorafleet operator: {exc}") from None
    try:  # an API to talk to: a pod's service account or a kubeconfig (else kopf retries a traceback every minute)
        from lorafleet.common.kubeclient import KubeClient

        asyncio.run(KubeClient.from_environment())
    except Exception as exc:  # noqa: BLE001 (the kubernetes package's ConfigException, a missing or broken file)
        why = " ".join(str(exc).split())
        raise SystemExit("lorafleet operator: no Kubernetes API to talk to: not in a pod with a service account, and "
                         f"no usable kubeconfig ($KUBECONFIG or ~/.kube/config): {why}") from None
    importlib.import_module("lorafleet.operator.main")  # registers the handlers
    namespaces = list(args.namespace or [])
    asyncio.run(kopf.operator(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=True,  # one replica (Recreate): no peering objects needed
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(config=config_from_args(args)),
    ))
    return 0

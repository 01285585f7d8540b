"""kopf handlers of the lorafleet operator: thin, the work is in pools.py and adapters.py.

ServingPool: create/update/resume apply its objects; a daemon per pool looks at it every
`sync_interval_s` (status, autoscaler, periodic re-apply); deletion removes its objects.
LoraAdapter: create/update check it; resume re-checks it against its pool; a daemon per adapter
retries Pending or retryably Failed ones and checks again those whose pool changed model or
maxLoraRank; deletion (finalizer) waits until the pool's scheduler no longer serves it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any, Mapping

import kopf

from lorafleet import env
from lorafleet.common.hosts import client_session
from lorafleet.common.kubeclient import ApiError, KubeClient
from lorafleet.operator import adapters, reconcile
from lorafleet.operator import constants as c
from lorafleet.operator import pools as pool_ops
from lorafleet.operator.config import OperatorConfig
from lorafleet.operator.credentials import Credentials


class RetriedRequests(logging.Filter):
    """kopf logs each failed attempt of an API request it then retries (a 429 while the API server's storage
    re-initializes, a 503) at ERROR; such an attempt is a warning: the request goes on. The last attempt's failure
    ("escalating") stays an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and "failed; will retry" in str(record.msg):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def soften_retried_requests() -> None:
    """The filter on every kopf logger (a logger's filters see only the records made on it, not its children's)."""
    names = [n for n in list(logging.root.manager.loggerDict) if n == "kopf" or n.startswith("kopf.")]
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RetriedRequests) for f in logger.filters):
            logger.addFilter(RetriedRequests())


def _ctx(memo: kopf.Memo) -> reconcile.Context:
    return memo["ctx"]


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config: OperatorConfig = memo.get("config") or OperatorConfig()
    soften_retried_requests()
    settings.persistence.finalizer = c.FINALIZER
    # kopf's own bookkeeping under kopf.lorafleet.dev/: kopf ignores its prefix when it looks for
    # changes, so user annotations such as lorafleet.dev/recheck still count as changes.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=c.KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=c.KOPF_PREFIX,
                                                                            key="last-handled-configuration")
    settings.posting.reporting_component = c.MANAGED_BY
    settings.scanning.disabled = not config.scanning
    settings.execution.max_workers = 8
    kube = await KubeClient.from_environment()
    creds = Credentials.from_file(config.credentials_key_file) if config.credentials_key_file \
        else Credentials.ephemeral()
    memo["ctx"] = reconcile.Context(config=config, kube=kube, http=client_session(env.hosts_file()),
                                    credentials=creds)


@kopf.on.login()
async def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf's credentials, from the same source as the operator's own client (see KubeClient)."""
    ctx = memo.get("ctx")
    kube = ctx.kube if ctx is not None else await KubeClient.from_environment()
    if ctx is not None:
        await kube.reload()
    token = kube.current_token()
    return kopf.ConnectionInfo(server=kube.server, token=token, scheme="Bearer" if token else None,
                               ca_path=kube.ca_file, certificate_path=kube.cert_file, private_key_path=kube.key_file,
                               insecure=not kube.verify)


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    ctx = memo.get("ctx")
    if ctx is not None:
        await ctx.close()


# --- ServingPool -------------------------------------------------------------------------------


@kopf.index(c.GROUP, c.VERSION, c.POOLS)
def pools(namespace: str, name: str, spec: Mapping, status: Mapping, meta: Mapping, **_: Any) -> dict:
    """(namespace, name) -> a copy of the pool's spec and status, for the adapter handlers."""
    return {(namespace, name): {"spec": copy.deepcopy(dict(spec)), "status": copy.deepcopy(dict(status)),
                                "deleting": bool(meta.get("deletionTimestamp"))}}


@kopf.on.create(c.GROUP, c.VERSION, c.POOLS)
async def pool_created(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    await pool_ops.apply(_ctx(memo), body, patch)


@kopf.on.update(c.GROUP, c.VERSION, c.POOLS)
async def pool_updated(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    await pool_ops.apply(_ctx(memo), body, patch)


@kopf.on.resume(c.GROUP, c.VERSION, c.POOLS)
async def pool_resumed(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    await pool_ops.apply(_ctx(memo), body, patch)


@kopf.on.delete(c.GROUP, c.VERSION, c.POOLS)
async def pool_deleted(name: str, namespace: str, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    await pool_ops.delete(_ctx(memo), name, namespace, logger)


def _failed(what: str, exc: Exception, logger: Any, stopping: bool) -> bool:
    """Log a daemon round's failure (called in its except block); False where the operator stopped during the round
    (its clients closed under it): the daemon then ends without a word. Otherwise the loop goes on, its next round
    starting from the API again."""
    if stopping:
        return False
    if isinstance(exc, ApiError):
        logger.warning("%s failed: %s", what, exc)
    else:
        logger.exception("%s failed", what)
    return True


@kopf.daemon(c.GROUP, c.VERSION, c.POOLS, cancellation_timeout=10.0)
async def pool_loop(stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Every sync interval: status from the scheduler's view, autoscaling, periodic re-apply.

    kopf cancels the loop when the pool goes or the operator stops; that is its normal way out,
    so the cancellation ends it quietly (escaping, kopf would log "Will escalate" each time).
    """
    ctx = _ctx(memo)
    try:
        while not stopped and not ctx.closed:
            try:
                await pool_ops.tick(ctx, body, logger)
            except Exception as exc:
                if not _failed("pool look", exc, logger, bool(stopped) or ctx.closed):
                    return
            await asyncio.sleep(ctx.config.sync_interval_s)
    except asyncio.CancelledError:
        return


# --- LoraAdapter -------------------------------------------------------------------------------


@kopf.on.create(c.GROUP, c.VERSION, c.ADAPTERS)
async def adapter_created(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, pools: kopf.Index, **_: Any) -> None:
    await adapters.changed(_ctx(memo), body, patch, pools, full=True)


@kopf.on.update(c.GROUP, c.VERSION, c.ADAPTERS)
async def adapter_updated(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, pools: kopf.Index, **_: Any) -> None:
    await adapters.changed(_ctx(memo), body, patch, pools, full=True)


@kopf.on.resume(c.GROUP, c.VERSION, c.ADAPTERS)
async def adapter_resumed(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, pools: kopf.Index, **_: Any) -> None:
    await adapters.changed(_ctx(memo), body, patch, pools, full=False)


@kopf.daemon(c.GROUP, c.VERSION, c.ADAPTERS, cancellation_timeout=5.0)
async def adapter_loop(stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, pools: kopf.Index,
                       logger: Any, **_: Any) -> None:
    """Retry Pending and retryably Failed adapters; re-check Ready ones against their pool.
    Ends quietly when kopf cancels it (the adapter went, or the operator stops)."""
    ctx = _ctx(memo)
    try:
        while not stopped and not ctx.closed:
            await asyncio.sleep(ctx.config.adapter_retry_s)
            try:
                await adapters.retry(ctx, body, pools)
            except Exception as exc:
                if not _failed("adapter re-check", exc, logger, bool(stopped) or ctx.closed):
                    return
    except asyncio.CancelledError:
        return


@kopf.on.delete(c.GROUP, c.VERSION, c.ADAPTERS)
async def adapter_deleted(body: kopf.Body, memo: kopf.Memo, pools: kopf.Index, runtime: Any, logger: Any,
                          **_: Any) -> None:
    await adapters.release(_ctx(memo), body, pools, runtime.total_seconds(), logger)

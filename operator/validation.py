"""Checking a LoraAdapter before it becomes Ready.

1. Pure checks: the pool exists and its spec is usable, the source URI has a known scheme,
   sha256 is well formed, a pvc:// claim is one the pool mounts.
2. http(s)/s3/hf sources: the operator reads adapter_config.json and the safetensors header
   itself (streaming the whole file through sha256 when one is given) and runs
   `inspect_adapter` with the pool's maximum rank and, when the pool status knows it, the
   base model's shape.
3. pvc:// and local sources (only runner pods can read them), and remote ones whose base
   shape is unknown: the pool scheduler's `POST /admin/adapters/validate` checks them on a
   healthy runner. No runner ready means Pending (retried), never Failed.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Mapping

from lorafleet.common import sources
from lorafleet.common.peft_config import AdapterError, BaseShape, inspect_adapter
from lorafleet.operator.admin import AdminClient, SchedulerUnavailable
from lorafleet.operator.spec import PoolSpec, SpecError, base_shape_from_status, parse_pool
from lorafleet.operator.status import set_condition

PENDING, READY, FAILED = "Pending", "Ready", "Failed"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Verdict:
    phase: str
    reason: str
    message: str
    retryable: bool = False
    rank: int | None = None
    target_modules: tuple[str, ...] = ()
    size_bytes: int | None = None
    base_model: str | None = None

    def status(self, previous: Mapping[str, Any] | None, *, generation: int | None, source: str | None,
               now: str, checked_against: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The adapter's new status (a merge patch: fields that no longer apply are None).
        `checked_against`: the pool settings the verdict was reached with (see `checked_against`)."""
        ready = self.phase == READY
        conds = set_condition((previous or {}).get("conditions"), "Ready", ready, self.reason, self.message,
                              now, generation)
        return {
            "phase": self.phase,
            "reason": self.reason,
            "message": self.message,
            "retryable": self.retryable,
            "rank": self.rank if ready else None,
            "targetModules": list(self.target_modules) if ready else None,
            "sizeBytes": self.size_bytes if ready else None,
            "baseModel": self.base_model if ready else None,
            "source": source,
            "checkedAgainst": dict(checked_against) if checked_against else None,
            "observedGeneration": generation,
            "validatedAt": now,
            "conditions": conds,
        }


def failed(reason: str, message: str, retryable: bool = False) -> Verdict:
    return Verdict(FAILED, reason, message, retryable)


def precheck(name: str, spec: Mapping[str, Any], pool_body: Mapping[str, Any] | None,
             namespace: str) -> Verdict | tuple[sources.Source, PoolSpec]:
    """The checks that need no I/O: a Verdict when they settle it, else (source, pool spec)."""
    pool_name = spec.get("pool")
    if not pool_name:
        return failed("InvalidSpec", "spec.pool is required")
    if not isinstance(pool_name, str) or not isinstance(spec.get("source", ""), str):
        # (the CRD types both as strings; str() of a list would look a pool or a local path up by its repr)
        return failed("InvalidSpec", "spec.pool and spec.source must be strings")
    if pool_body is None:
        return failed("PoolNotFound", f"ServingPool {pool_name!r} not found in namespace {namespace!r}", True)
    try:
        pool = parse_pool(pool_name, namespace, pool_body.get("spec") or {})
    except SpecError as exc:
        return failed("PoolInvalid", f"ServingPool {pool_name!r} has an invalid spec: {exc}", True)
    try:
        src = sources.parse_source(str(spec.get("source") or ""))
    except sources.SourceError as exc:
        return failed("InvalidSource", str(exc))
    sha = spec.get("sha256")
    if sha is not None and not _SHA256.match(str(sha)):
        return failed("InvalidSpec", "spec.sha256 must be 64 lowercase hex digits")
    if src.scheme == "pvc" and src.location not in pool.adapter_volumes:
        return failed(
            "ClaimNotMounted",
            f"PVC {src.location!r} is not mounted by ServingPool {pool_name!r} (add it to spec.adapterVolumes)",
            True,
        )
    return src, pool


def checked_against(spec: Mapping[str, Any], pool_body: Mapping[str, Any] | None,
                    namespace: str) -> dict[str, Any] | None:
    """The pool settings an adapter's verdict depends on: the pool, its model and its maxLoraRank
    (None while the pool is missing or its spec unusable: those verdicts are retried anyway)."""
    pool_name = spec.get("pool")
    if not pool_name or pool_body is None:
        return None
    try:
        pool = parse_pool(str(pool_name), namespace, pool_body.get("spec") or {})
    except SpecError:
        return None
    return {"pool": pool.name, "model": pool.model_source, "maxLoraRank": pool.runner.max_lora_rank}


def pool_changed(status: Mapping[str, Any], against: Mapping[str, Any] | None, model_only: bool = False) -> bool:
    """Whether the pool settings changed since the adapter's last verdict (which then no longer holds:
    a Ready adapter may not fit the new base model, a rank refused before may fit now). `model_only`: the pool or
    its model only (a Ready adapter's rank against a changed maxLoraRank is `recheck`'s, without a fetch).

    A verdict without `checkedAgainst` (reached by an operator from before the field) was reached against a pool
    unknown now, so it counts as changed: the adapter is checked once more, and its new verdict records the pool."""
    if not status.get("checkedAgainst"):
        return True
    before = dict(status["checkedAgainst"])
    now = dict(against or {})
    if model_only:
        before.pop("maxLoraRank", None)
        now.pop("maxLoraRank", None)
    return before != now


def recheck(spec: Mapping[str, Any], status: Mapping[str, Any], pool_body: Mapping[str, Any] | None,
            namespace: str) -> Verdict | None:
    """A Ready adapter that no longer fits its pool (pool gone, maxLoraRank lowered, claim no
    longer mounted): the new Verdict; None while it still holds. Pure and cheap."""
    checked = precheck("", spec, pool_body, namespace)
    if isinstance(checked, Verdict):
        return checked
    _, pool = checked
    rank = status.get("rank")
    if rank is not None and int(rank) > pool.runner.max_lora_rank:
        return failed("RankTooHigh", f"rank {rank} exceeds ServingPool {pool.name!r} maxLoraRank "
                      f"{pool.runner.max_lora_rank}")
    return None


async def _ask_scheduler(admin: AdminClient | None, name: str, spec: Mapping[str, Any], waiting_for: str) -> Verdict:
    if admin is None:
        return Verdict(PENDING, "WaitingForScheduler", f"waiting for the pool's scheduler to {waiting_for}", True)
    try:
        answer = await admin.validate(name, str(spec["source"]), spec.get("sha256"))
    except SchedulerUnavailable as exc:
        return Verdict(PENDING, "WaitingForRunner", f"waiting for a ready runner to {waiting_for} ({exc})", True)
    if not answer.get("ok"):
        if answer.get("retry"):  # e.g. the runner it picked went away meanwhile
            return Verdict(PENDING, "WaitingForRunner", f"waiting for a ready runner to {waiting_for} "
                           f"({answer.get('error') or 'retry later'})", True)
        return failed("InvalidAdapter", str(answer.get("error") or "refused by the runner"))
    targets = answer.get("target_modules") or ()
    return Verdict(READY, "Validated", "checked on a runner against the loaded base model",
                   rank=answer.get("rank"), target_modules=tuple(str(t) for t in targets),
                   size_bytes=answer.get("size_bytes"), base_model=answer.get("base_model"))


def _inspect_remote(name: str, uri: str, sha256: str | None, base: BaseShape | None, max_rank: int,
                    timeout: float) -> Verdict:
    """Blocking: probe the files into a temp folder and inspect them."""
    with tempfile.TemporaryDirectory(prefix="lorafleet-probe-") as tmp:
        try:
            folder = sources.probe_adapter(uri, tmp, sha256=sha256, timeout=timeout)
        except sources.ChecksumMismatch as exc:
            return failed("ChecksumMismatch", str(exc))
        except sources.SourceRefused as exc:
            return failed("SourceRefused", str(exc))
        except sources.SourceUnreachable as exc:
            return failed("SourceUnreachable", f"{exc} (will retry)", True)
        except sources.SourceNotFound as exc:
            return failed("SourceNotFound", f"{exc} (will retry)", True)
        except sources.SourceError as exc:
            return failed("SourceError", str(exc), True)
        try:
            spec = inspect_adapter(name, folder, base=base, max_rank=max_rank)
        except AdapterError as exc:
            reason = "RankTooHigh" if "maximum LoRA rank" in exc.reason else "InvalidAdapter"
            return failed(reason, str(exc))
    where = f"against base model {base.name}" if base is not None and base.name else "against the base model shape"
    return Verdict(READY, "Validated", f"files read and checked {where}",
                   rank=spec.max_rank, target_modules=spec.target_modules, size_bytes=spec.size_bytes,
                   base_model=spec.base_model)


async def validate_adapter(name: str, namespace: str, spec: Mapping[str, Any], pool_body: Mapping[str, Any] | None,
                           *, admin: AdminClient | None, fetch_timeout: float = 60.0,
                           executor: Executor | None = None) -> Verdict:
    """The full check of one adapter (I/O: source fetches in `executor`, the scheduler's admin API)."""
    checked = precheck(name, spec, pool_body, namespace)
    if isinstance(checked, Verdict):
        return checked
    src, pool = checked
    if not src.remote:
        return await _ask_scheduler(admin, name, spec, "read it from its volume")
    pool_status = (pool_body or {}).get("status") or {}
    # A shape learned from another model (the pool's model changed, the new one is not read yet) says nothing.
    same_model = (pool_status.get("baseModel") or {}).get("source") in (None, pool.model_source)
    base = base_shape_from_status(pool_status) if same_model else None
    verdict = await asyncio.get_running_loop().run_in_executor(
        executor, _inspect_remote, name, src.uri, spec.get("sha256"), base, pool.runner.max_lora_rank, fetch_timeout)
    if verdict.phase != READY or base is not None:
        return verdict
    if not same_model:  # the runners still hold the old model until the new one's shape is read: wait for it
        return Verdict(PENDING, "WaitingForBaseModel", f"waiting for the pool's new base model ({pool.model_source}) "
                       "to be read before checking against it", True)
    # Files are fine but the base shape is unknown here (e.g. the model is on a PVC): ask a runner.
    return await _ask_scheduler(admin, name, spec, "check it against the base model")

"""Which adapters sit in which pool slot: LRU over unpinned slots, a host tier behind it.

`acquire(ref)` answers READY (with a slot, pinned for the caller), LOADING (come back next
step) or raises AdapterError. Loads on CPU are synchronous; on CUDA the disk read runs in a
reader process (`reader.py`) and the copy into the slot on a side stream from host memory (pageable
by default, see `KernelChoices.pin_host_adapters`), so neither stalls the running batch nor the engine's thread.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from lorafleet.common.peft_config import AdapterError, BaseShape
from lorafleet.runner.lora.adapter import LoadedAdapter
from lorafleet.runner.lora.host_tier import HostTier
from lorafleet.runner.lora.pool import LoraPool
from lorafleet.runner.lora.adapter import AdapterRef

log = logging.getLogger(__name__)

READY, LOADING = "ready", "loading"


@dataclass
class SlotState:
    ref: AdapterRef
    pins: int = 0
    ready: bool = False
    event: object = None  # CUDA: Future of the worker's copy into the slot (-> torch.cuda.Event)
    identity: str = ""  # the loaded weights' identity (`identity_of`), set once they are read


def identity_of(ref: AdapterRef, adapter: LoadedAdapter) -> str:
    """What the prefix cache keys an adapter's pages by: its source, the sha256 it was checked against and
    its files' fingerprint, so a changed or reloaded adapter never matches pages of the old weights."""
    return f"lora\0{ref.source}\0{ref.sha256 or ''}\0{adapter.spec.fingerprint}"


class AdapterManager:
    def __init__(
        self,
        pool: LoraPool,
        base: BaseShape,
        host_capacity: int = 256,
        loader: Callable[[AdapterRef], LoadedAdapter] | None = None,
        copy_stream: "torch.cuda.Stream | None" = None,
        allow_synthetic: bool = False,
        readers: int = 4,
        pin_reads: bool = False,
    ):
        self.pool, self.base = pool, base  # base: the full model's shape (adapters are validated against it)
        # Called with ("load", slot, ref) when a slot starts filling and ("clear", slot) when one is
        # emptied: tensor-parallel ranks mirror the slots of rank 0's pool.
        self.on_slot: Callable[[tuple], None] | None = None
        self.copy_stream = copy_stream
        self.slots: dict[int, SlotState] = {}
        self.by_name: dict[str, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # unpinned ready slots, oldest first
        self.free_slots = list(range(pool.num_slots - 1, -1, -1))
        self.abandoned: set[int] = set()  # loading slots whose requests left (see `abandon`)
        # On CUDA, disk reads run in reader processes and the copies into slots on worker threads:
        # the engine thread only polls.
        cuda = copy_stream is not None
        self.host = HostTier(base, pool.max_rank, pool.dtype, host_capacity, pin=cuda, allow_synthetic=allow_synthetic,
                             readers=readers if cuda else 0, loader=loader, pin_reads=pin_reads)
        self.workers = ThreadPoolExecutor(max_workers=max(2, readers), thread_name_prefix="adapter-load") if cuda else None
        self.stats = {"loads": 0, "evictions": 0}

    # -- queries ------------------------------------------------------------------------
    def resident(self) -> list[str]:
        return sorted(s.ref.name for s in self.slots.values() if s.ready)

    def is_resident(self, ref: AdapterRef) -> bool:
        """Whether `ref` (this name from this source) sits ready in a device slot: acquire would not load it."""
        slot = self.by_name.get(ref.name)
        return slot is not None and self.slots[slot].ref == ref and self.slots[slot].ready

    def state(self) -> dict:
        return {
            "gpu_slots": self.pool.num_slots,
            "gpu_used": len(self.slots),
            "gpu_bytes": self.pool.nbytes,
            "host_cached": len(self.host),
            "host_bytes": self.host.nbytes,
            **self.stats,
            **self.host.stats,
        }

    def close(self) -> None:
        """Stop the loader threads and the reader processes (idempotent)."""
        self.host.close()  # first: a copy still waiting for a read fails at once instead of waiting
        if self.workers is not None:
            self.workers.shutdown(wait=True, cancel_futures=True)

    # -- acquire / release ------------------------------------------------------------------
    def acquire(self, ref: AdapterRef) -> tuple[str, int]:
        """READY with a pinned slot, or LOADING; raises AdapterError for a bad adapter."""
        slot = self.by_name.get(ref.name)
        if slot is not None and self.slots[slot].ref != ref:
            # Same name, new source: reload once nobody uses the old weights.
            if self.slots[slot].pins == 0 and self.slots[slot].ready:
                self._drop(slot)
                slot = None
            else:
                return LOADING, -1
        if slot is None:
            slot = self._start_load(ref)
            if slot is None:
                return LOADING, -1  # every slot pinned: wait for a request to finish
        st = self.slots[slot]
        if not st.ready:
            fut = st.event
            if not fut.done():
                return LOADING, -1
            try:
                event = fut.result()
            except AdapterError:
                self._drop(slot)  # the slot goes back; the request fails
                raise
            if not event.query():
                return LOADING, -1
            st.ready, st.event = True, None
        st.pins += 1
        self.lru.pop(slot, None)
        return READY, slot

    def release(self, slot: int) -> None:
        st = self.slots.get(slot)
        if st is None:
            return
        st.pins -= 1
        if st.pins == 0 and st.ready:
            self.lru[slot] = None

    # -- internals --------------------------------------------------------------------------
    def _host_copy(self, ref: AdapterRef) -> LoadedAdapter:
        """The adapter in host memory (read from disk on a miss). Runs on a worker thread on CUDA."""
        return self.host.get(ref)

    def identity(self, slot: int) -> str:
        """The identity of the adapter in a ready slot (`identity_of`)."""
        return self.slots[slot].identity

    def _copy_in(self, st: SlotState, slot: int, main_stream) -> "torch.cuda.Event":
        """Worker thread: host tier (or disk) -> host memory -> slot on the side stream; returns its event."""
        adapter = self._host_copy(st.ref)
        st.identity = identity_of(st.ref, adapter)
        # Steps already queued may still read this slot's previous weights: copy after them.
        with torch.cuda.device(self.pool.device):
            return self._copy_on_side_stream(adapter, slot, main_stream)

    def _copy_on_side_stream(self, adapter: LoadedAdapter, slot: int, main_stream) -> "torch.cuda.Event":
        return fill_slot(self.pool, slot, adapter, self.copy_stream, main_stream)

    def abandon(self, ref: AdapterRef) -> None:
        """A request waiting for `ref`'s load left (cancelled). Only `acquire` settles a load, so if
        nobody acquires it again the slot would stay neither pinned nor evictable: remember it, and
        settle it when a slot is needed (`_settle_abandoned`)."""
        slot = self.by_name.get(ref.name)
        if slot is not None and not self.slots[slot].ready:
            self.abandoned.add(slot)

    def _take_slot(self) -> int | None:
        if not self.free_slots and not self.lru and self.abandoned:
            self._settle_abandoned()
        if self.free_slots:
            return self.free_slots.pop()
        if self.lru:
            slot, _ = self.lru.popitem(last=False)
            log.info("evicting adapter %s from slot %d", self.slots[slot].ref.name, slot)
            self.stats["evictions"] += 1
            self._forget(slot)
            return slot
        return None

    def _settle_abandoned(self) -> None:
        """Abandoned loads that have finished and that nobody acquired since: a finished one joins the
        LRU, a failed one is freed; those still loading wait for the next call."""
        for slot in list(self.abandoned):
            st = self.slots.get(slot)
            if st is None or st.ready or st.pins:
                self.abandoned.discard(slot)  # gone, or acquired again meanwhile
                continue
            if st.event is None or not st.event.done():
                continue
            self.abandoned.discard(slot)
            try:
                event = st.event.result()
            except Exception:
                self._drop(slot)
                continue
            if event is not None and not event.query():
                self.abandoned.add(slot)
                continue
            st.ready, st.event = True, None
            self.lru[slot] = None

    def _start_load(self, ref: AdapterRef) -> int | None:
        """Reserve a slot and start filling it; None when every slot is pinned."""
        if self.copy_stream is None:  # CPU: synchronous, errors before any slot is taken
            adapter = self._host_copy(ref)
            slot = self._take_slot()
            if slot is None:
                return None
            self.pool.write(slot, adapter)
            st = SlotState(ref, ready=True, identity=identity_of(ref, adapter))
        else:
            slot = self._take_slot()
            if slot is None:
                return None
            st = SlotState(ref)
            main = torch.cuda.current_stream(self.pool.device)
            st.event = self.workers.submit(self._copy_in, st, slot, main)  # a Future of the copy's event
        self.stats["loads"] += 1
        self.slots[slot] = st
        self.by_name[ref.name] = slot
        if self.on_slot is not None:
            self.on_slot(("load", slot, ref))
        return slot

    def _forget(self, slot: int) -> None:
        self.abandoned.discard(slot)
        st = self.slots.pop(slot)
        if self.by_name.get(st.ref.name) == slot:
            del self.by_name[st.ref.name]
        self.pool.clear(slot)
        if self.on_slot is not None:
            self.on_slot(("clear", slot))

    def _drop(self, slot: int) -> None:
        self.lru.pop(slot, None)
        self._forget(slot)
        self.free_slots.append(slot)


def fill_slot(pool: LoraPool, slot: int, adapter: LoadedAdapter, copy_stream, main_stream) -> "torch.cuda.Event":
    """Copy an adapter into a pool slot on `copy_stream`, after the work already queued on
    `main_stream` (steps that may still read the slot's previous weights); returns the copy's event."""
    copy_stream.wait_stream(main_stream)
    with torch.cuda.stream(copy_stream):
        pool.write(slot, adapter, stream=copy_stream)
        event = torch.cuda.Event()
        event.record(copy_stream)
    return event

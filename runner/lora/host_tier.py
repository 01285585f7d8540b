"""The host tier: adapters in host memory behind the device pool (pinned on CUDA; for reads from
disk, see KernelChoices.pin_host_adapters).

`get(ref)` answers from memory or reads the adapter from disk: in reader processes when the tier
has `readers` (CUDA engines, see reader.py), else in the calling thread. Thread-safe: the engine's
loader threads call it concurrently. Tensor-parallel ranks keep one each (their slices are cut
from the full adapter, see adapter.py `shard_for`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable

import torch

from lorafleet.common.peft_config import AdapterError, BaseShape, scrub_paths
from lorafleet.runner.lora.adapter import LoadedAdapter, load_adapter
from lorafleet.runner.lora.adapter import AdapterRef


class HostTier:
    def __init__(self, base: BaseShape, max_rank: int, dtype: torch.dtype, capacity: int, pin: bool,
                 allow_synthetic: bool = False, readers: int = 0,
                 loader: Callable[[AdapterRef], LoadedAdapter] | None = None, pin_reads: bool = False):
        self.base, self.max_rank, self.dtype, self.pin = base, max_rank, dtype, pin
        self.capacity, self.allow_synthetic = capacity, allow_synthetic
        self.loader = loader
        self.reader = None
        if readers and loader is None:
            from lorafleet.runner.lora.reader import AdapterReader

            # KernelChoices.pin_host_adapters: pageable by default, which avoids a page-locking driver call per read
            self.reader = AdapterReader(base, max_rank, dtype, workers=readers, pin=pin and pin_reads).start()
        self.cache: OrderedDict[tuple[str, str], LoadedAdapter] = OrderedDict()
        self.lock = threading.Lock()
        self.stats = {"host_hits": 0, "disk_reads": 0, "failures": 0, "load_seconds": 0.0}

    def __len__(self) -> int:
        return len(self.cache)

    @property
    def nbytes(self) -> int:
        with self.lock:
            return sum(a.nbytes for a in self.cache.values())

    def get(self, ref: AdapterRef) -> LoadedAdapter:
        """The adapter in host memory (read on a miss); raises AdapterError."""
        key = ref  # (name, source, sha256, version): a changed adapter is a miss
        with self.lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
                self.stats["host_hits"] += 1
                return hit
        t0 = time.perf_counter()
        try:
            adapter = self._read(ref)
        except AdapterError:
            self._count_failure()
            raise
        except Exception as exc:  # fetch errors, I/O errors
            self._count_failure()
            raise AdapterError(ref.name, scrub_paths(str(exc))) from None
        with self.lock:
            self.stats["disk_reads"] += 1
            self.stats["load_seconds"] += time.perf_counter() - t0
            if self.reader is not None:  # of which in the reader processes (the rest: waiting, transfer)
                self.stats["worker_seconds"] = round(self.reader.stats["worker_seconds"], 3)
            self.cache[key] = adapter
            while len(self.cache) > self.capacity:
                self.cache.popitem(last=False)
        return adapter

    def _count_failure(self) -> None:
        with self.lock:
            self.stats["failures"] += 1

    def _read(self, ref: AdapterRef) -> LoadedAdapter:
        if self.loader is not None:
            return self.loader(ref)
        if self.reader is not None and not str(ref.source).startswith("synthetic://"):
            return self.reader.read(ref.name, ref.source)
        return load_adapter(ref.name, ref.source, self.base, self.max_rank, self.dtype, pin=self.pin,
                            allow_synthetic=self.allow_synthetic)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()

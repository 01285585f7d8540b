"""Ranks 1..G-1 of a tensor-parallel engine, and rank 0's handle on them.

Rank 0 (the engine's own process) schedules; every step it sends the step batch's wire form down
one pipe per rank and then runs the step itself. The other ranks replay it on their slices
(`runner.launch`, CUDA graphs included) and meet rank 0 in the all-reduces; they also sample (the
same logits give the same ids), so pending input ids never cross processes. Adapter slots follow
rank 0's pool: ("load", slot, ref) and ("clear", slot) messages, each rank loading its own slice on
its own side stream.

Messages are plain tuples pickled over multiprocessing pipes between the runner's own processes
(never from the network). A rank that fails sends ("error", reason) and exits; rank 0 raises
`TPFailure` with that reason (or the exit code of a rank that vanished) at its next step or while
it waits for the device, so the runner goes unhealthy instead of hanging.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger(__name__)


class TPFailure(RuntimeError):
    """A tensor-parallel rank failed; the engine cannot continue."""


def rank_device(config, rank: int) -> torch.device:
    """cuda -> cuda:rank; cuda:k -> cuda:(k + rank); cpu stays cpu."""
    from lorafleet.runner.executor.executor import resolve_device

    dev = resolve_device(config.device)
    if dev.type != "cuda":
        return dev
    index = (dev.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"tensor parallelism over {config.tp} GPUs needs cuda:{index}, but this machine has "
                           f"{torch.cuda.device_count()} GPU(s)")
    return torch.device("cuda", index)


class SlotMirror:
    """A non-zero rank's copy of rank 0's adapter slots (its slice of each adapter)."""

    def __init__(self, pool, full_base, config, device: torch.device):
        self.pool, self.full, self.config = pool, full_base, config
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.loader = ThreadPoolExecutor(max_workers=config.adapter_reader_count(), thread_name_prefix="tp-adapter") if self.cuda else None
        self.pending: dict[int, object] = {}  # slot -> Future of the copy's CUDA event
        from lorafleet.runner.lora.host_tier import HostTier

        self.host = HostTier(full_base, pool.max_rank, pool.dtype, config.host_lora_cache, pin=self.cuda,
                             allow_synthetic=config.allow_synthetic, readers=config.adapter_reader_count() if self.cuda else 0,
                             pin_reads=config.kernels.pin_host_adapters)

    def _adapter(self, ref):
        return self.host.get(ref)

    def _fill(self, ref, slot: int, main):
        adapter = self._adapter(ref)
        if not self.cuda:
            self.pool.write(slot, adapter)
            return None
        from lorafleet.runner.lora.manager import fill_slot

        with torch.cuda.device(self.pool.device):
            return fill_slot(self.pool, slot, adapter, self.stream, main)

    def apply(self, event: tuple) -> None:
        kind, slot = event[0], event[1]
        self.ready([slot])  # finish a fill still running for this slot first
        if kind == "clear":
            self.pool.clear(slot)
        elif self.cuda:
            self.pending[slot] = self.loader.submit(self._fill, event[2], slot, torch.cuda.current_stream())
        else:
            self._fill(event[2], slot, None)

    def ready(self, slots) -> None:
        """Before a step that reads `slots`: their fills are done or ordered before it."""
        for s in slots:
            fut = self.pending.pop(s, None)
            if fut is not None:
                ev = fut.result()
                torch.cuda.current_stream().wait_event(ev)


def worker_main(rank: int, size: int, port: int, model: str, config, conn) -> None:
    """Entry point of ranks 1..G-1 (a spawned process)."""
    from lorafleet.runner.executor.executor import build_executor
    from lorafleet.runner.parallel.group import TPGroup
    from lorafleet.runner.parallel.shard import Shard
    from lorafleet.runner.engine.step_batch import StepBatch

    logging.basicConfig(level=os.environ.get("LORAFLEET_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s tp-rank{rank} %(levelname)s %(name)s: %(message)s")
    group = None
    try:
        device = rank_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(1)  # CPU ranks share the machine's cores with rank 0
        group = TPGroup(rank, size, port, device)
        ex = build_executor(model, config, Shard(rank, size), group, device)
        slots = SlotMirror(ex.lora_pool, ex.model.full_cfg.base_shape(), config, device) if ex.lora_pool else None
        conn.send(("ready", rank))
        window: list = []  # launched steps not known done: at most two, like rank 0
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return  # rank 0 went away
            if msg[0] == "step":
                batches = [StepBatch.from_wire(w, pin=device.type == "cuda") for w in msg[1]]  # a step's parts
                if slots is not None:
                    slots.ready([s for b in batches for s in b.seg_slots if s >= 0])
                prev = window[-1] if window else None
                window.append(ex.runner.launch_parts(batches, prev, readback=False))
                if len(window) > 2:
                    window.pop(0).wait()
            elif msg[0] == "slot":
                if slots is not None:
                    slots.apply(msg[1])
            elif msg[0] == "stop":
                for w in window:
                    w.wait()
                return
    except BaseException as exc:  # report, then die: rank 0 turns it into TPFailure
        log.exception("tensor-parallel rank %d failed", rank)
        try:
            conn.send(("error", f"tensor-parallel rank {rank}: {type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise SystemExit(1) from None
    finally:
        if group is not None:
            group.close()


class TPWorkers:
    """Rank 0's handle on ranks 1..G-1: start, send, check, stop."""

    def __init__(self, size: int, model: str, config, port: int):
        ctx = mp.get_context("spawn")
        self.size = size
        self.procs, self.conns = [], []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(rank, size, port, model, config, child),
                            name=f"lorafleet-tp{rank}", daemon=False)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self.closed = False
        atexit.register(self.close)

    def wait_ready(self, timeout_s: float = 1800.0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(range(len(self.conns)))
        while pending:
            for i in list(pending):
                if self.conns[i].poll(0.05):
                    msg = self._recv(i)
                    if msg[0] == "ready":
                        pending.discard(i)
                elif not self.procs[i].is_alive():
                    raise TPFailure(f"tensor-parallel rank {i + 1} exited with code {self.procs[i].exitcode} "
                                    "while starting")
            if time.monotonic() > deadline:
                raise TPFailure(f"tensor-parallel ranks {sorted(r + 1 for r in pending)} did not start in time")

    def _recv(self, i: int):
        try:
            msg = self.conns[i].recv()
        except (EOFError, OSError):
            raise TPFailure(f"tensor-parallel rank {i + 1} exited (code {self.procs[i].exitcode})") from None
        if msg[0] == "error":
            raise TPFailure(msg[1])
        return msg

    def send(self, msg: tuple) -> None:
        for i, c in enumerate(self.conns):
            try:
                c.send(msg)
            except (BrokenPipeError, OSError):
                self.check()
                raise TPFailure(f"tensor-parallel rank {i + 1} exited (code {self.procs[i].exitcode})") from None

    def check(self) -> None:
        """Raise TPFailure if a rank reported an error or died."""
        for i, (p, c) in enumerate(zip(self.procs, self.conns)):
            if c.poll():
                self._recv(i)
            if not p.is_alive():
                raise TPFailure(f"tensor-parallel rank {i + 1} exited with code {p.exitcode}")

    def close(self, timeout_s: float = 10.0) -> None:
        if self.closed:
            return
        self.closed = True
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()

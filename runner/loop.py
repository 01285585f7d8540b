"""Runs an Engine on its own thread and fans its outputs out to asyncio consumers.

The event loop never runs model code: `submit` hands a request to the engine thread and
returns an asyncio.Queue that receives that request's `StepOutput`s.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from lorafleet.runner.engine import Engine, StepOutput
from lorafleet.runner.sequence import Sequence

log = logging.getLogger(__name__)

SNAPSHOT_EVERY_S = 0.1  # how stale GET /state and the metrics may be while the engine is busy


class EngineLoop:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.snapshot: dict = engine.state()
        self._snap_at = 0.0
        self.step_errors = 0
        self.last_step_seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.on_outputs = []  # callbacks(list[StepOutput]) run on the event loop (metrics)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self.thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    def submit(self, seq: Sequence) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._queues[seq.id] = q
        self.engine.submit(seq)
        self._wake.set()
        return q

    def cancel(self, seq_id: str) -> None:
        if seq_id in self._queues:
            self.engine.cancel(seq_id)
            self._wake.set()

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.seq_id)
            if q is None:
                continue
            q.put_nowait(out)
            if out.finished:
                del self._queues[out.seq_id]
        for fn in self.on_outputs:
            fn(outputs)

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            if not eng.has_work():
                self.snapshot = eng.state()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:
                outputs = eng.step()
            except Exception as exc:  # a bug or device error must not hang clients
                log.exception("engine step failed")
                self.step_errors += 1
                outputs = eng.abort_all(f"engine error: {type(exc).__name__}: {exc}")
            self.last_step_seconds = time.perf_counter() - t0
            # not on every decode step; but before a finished request is reported, so that a client
            # that asks right after its request ended sees the pages it freed
            if any(o.finished for o in outputs) or time.perf_counter() - self._snap_at > SNAPSHOT_EVERY_S:
                self.snapshot = eng.state()
                self._snap_at = time.perf_counter()
            if outputs:
                self.loop.call_soon_threadsafe(self._deliver, outputs)

"""Adapter reads in worker processes, so that the engine's Python thread never pays for them.

Reading an adapter from disk (validation, a safetensors read, transposing, scaling, the finiteness
check, packing: thousands of small tensor operations for a 7B-shape adapter) used to run on a
thread of the engine process. Every tensor operation releases and retakes the GIL, and with the
engine loop busy each retake waits for the interpreter's switch interval: a 0.2 s read took
seconds, and the adapter load rate, not the GPU, set the throughput of a many-adapter workload
(`bench serve`, 600 adapters: 501 tok/s online).

Here a read runs in one of `workers` processes, started as `python -m lorafleet.runner.lora.reader
--fd N` (not `multiprocessing`: nothing re-imports the caller's main module, nothing is pickled).
They speak the runner's channel (channel.py: length-prefixed JSON over a socketpair):

    -> ["read", {"name", "source", "base": {BaseShape fields}, "max_rank", "dtype"}]
    <- ["ok", {"spec": {...}, "file": path, "layout": [[kind, proj, offset, shape, dtype]], "host_ranks",
               "seconds"}]
    <- ["adapter_error", reason]        the adapter's fault (AdapterError)
    <- ["error", text]                  anything else (I/O, a bug)
    -> ["shutdown"]

The worker runs `load_adapter` (the in-process code) and writes the packed tensors to one file
in shared memory (/dev/shm); the engine side reads that file straight into one host buffer (pinned
only with `env.pin_host_adapters`) and
cuts the packed views out of it: a few dozen tensor operations per adapter, not thousands.

A worker that dies (killed, out of memory, crashed by a malformed file) fails only its read: it is
replaced and the read retried once; a second death is an AdapterError. Workers die with the
engine process (PR_SET_PDEATHSIG) and exit when their channel closes.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

import torch

from lorafleet.common.peft_config import AdapterError, AdapterSpec, BaseShape, ModuleLora
from lorafleet.common.procs import die_with_parent
from lorafleet.common.channel import BlockingChannel, ChannelClosed
from lorafleet.runner.lora.adapter import LoadedAdapter, Packed, load_adapter

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
HANDOFF_DIRS = tuple(dict.fromkeys((SHM_DIR, tempfile.gettempdir())))  # the second when /dev/shm is full
PREFIX = "lorafleet-adapter-"
START_TIMEOUT_S = 120.0


# -- the worker process ------------------------------------------------------------------------------
def read_to_shm(name: str, source: str, base: BaseShape, max_rank: int, dtype: str) -> dict:
    """Load, validate and pack; the packed bytes go to a shared-memory file. The reply's payload."""
    t0 = time.perf_counter()
    ad = load_adapter(name, source, base, max_rank, getattr(torch, dtype))
    pk = ad.packed
    parts = [("a", p, t) for p, t in pk.a.items()] + [("b", p, t) for p, t in pk.bt.items()]
    parts.append(("ranks", -1, pk.ranks))
    for i, folder in enumerate(HANDOFF_DIRS):
        path = os.path.join(folder, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        layout, off = [], 0
        try:
            with open(path, "wb") as f:
                for kind, p, t in parts:
                    raw = t.contiguous().view(torch.uint8).reshape(-1).numpy()
                    f.write(memoryview(raw))
                    layout.append([kind, p, off, list(t.shape), str(t.dtype).removeprefix("torch.")])
                    off += raw.nbytes
            break
        except OSError as exc:
            _unlink(path)
            if exc.errno != errno.ENOSPC or i == len(HANDOFF_DIRS) - 1:
                raise  # a small /dev/shm (containers get 64 MiB by default): try the temporary folder
        except BaseException:
            _unlink(path)
            raise
    spec = asdict(ad.spec)
    spec["path"] = str(spec["path"])
    return {"spec": spec, "file": path, "layout": layout, "host_ranks": pk.host_ranks,
            "seconds": round(time.perf_counter() - t0, 6)}


def serve(ch: BlockingChannel) -> int:
    ch.send(["ready", os.getpid()])
    while True:
        try:
            msgs = ch.recv_all(None)
        except ChannelClosed:
            return 0
        for msg in msgs:
            if msg[0] == "shutdown":
                return 0
            if msg[0] != "read":
                ch.send(["error", f"unknown request {msg[0]!r}"])
                continue
            r = msg[1]
            try:
                reply = ["ok", read_to_shm(r["name"], r["source"], BaseShape(**r["base"]), int(r["max_rank"]), r["dtype"])]
            except AdapterError as exc:
                reply = ["adapter_error", exc.reason]
            except Exception as exc:
                reply = ["error", f"{type(exc).__name__}: {exc}"]
            try:
                ch.send(reply)
            except OSError:  # the engine side is gone: nobody will read (and remove) the file
                if reply[0] == "ok":
                    _unlink(reply[1]["file"])
                raise


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lorafleet.runner.lora.reader")
    p.add_argument("--fd", type=int, required=True, help="this process's end of the socketpair")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    die_with_parent()
    if os.getppid() == 1:
        return 1
    torch.set_num_threads(args.threads)
    try:
        return serve(BlockingChannel(socket.socket(fileno=args.fd)))
    except (BrokenPipeError, ConnectionResetError):
        return 0


# -- the engine side -----------------------------------------------------------------------------------
def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_stale() -> None:
    """Hand-off files of readers whose process is gone (killed between writing and replying)."""
    for folder in HANDOFF_DIRS:
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for n in names:
            if not n.startswith(PREFIX):
                continue
            try:
                os.kill(int(n[len(PREFIX):].split("-", 1)[0]), 0)
            except ProcessLookupError:
                _unlink(os.path.join(folder, n))
            except (ValueError, OSError):
                pass


def spec_from_wire(d: dict) -> AdapterSpec:
    return AdapterSpec(**{**d, "path": Path(d["path"]), "modules": tuple(
        ModuleLora(**{**m, "b_rows": tuple(m["b_rows"]) if m.get("b_rows") else None}) for m in d["modules"])})


class WorkerDied(Exception):
    pass


class _Worker:
    def __init__(self, threads: int):
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lorafleet.runner.lora.reader", "--fd", str(theirs.fileno()),
                 "--threads", str(threads)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)  # it sets PR_SET_PDEATHSIG itself
        finally:
            theirs.close()
        self.ch = BlockingChannel(mine)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        msgs = self._recv(timeout)
        if not msgs or msgs[0][0] != "ready":
            self.kill()
            raise RuntimeError(f"adapter reader process did not start (exit status {self.proc.poll()})")

    def _recv(self, timeout: float | None) -> list[list]:
        try:
            return self.ch.recv_all(timeout)
        except (ChannelClosed, OSError, ValueError) as exc:
            raise WorkerDied(str(exc)) from None

    def call(self, msg: list) -> list:
        try:
            self.ch.send(msg)
        except OSError as exc:
            raise WorkerDied(str(exc)) from None
        return self._recv(None)[0]

    def kill(self) -> None:
        try:
            self.ch.sock.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class AdapterReader:
    """Reads adapters from disk in `workers` processes; `read` blocks its caller (a loader thread)
    and returns a LoadedAdapter whose packed tensors live in one (pinned, when `pin`) buffer."""

    def __init__(self, base: BaseShape, max_rank: int, dtype: torch.dtype, workers: int = 4, pin: bool = True,
                 threads_per_worker: int = 1):
        if workers < 1:
            raise ValueError("an adapter reader needs at least one worker process")
        self.base, self.max_rank, self.dtype, self.pin = base, max_rank, dtype, pin
        self.threads, self.num_workers = threads_per_worker, workers
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.restarts = 0
        self.stats = {"worker_seconds": 0.0}

    def start(self) -> "AdapterReader":
        """Start the worker processes (each imports torch: seconds) and wait until they are ready."""
        _remove_stale()
        try:
            fresh = [self._spawn() for _ in range(self.num_workers)]
            for w in fresh:
                w.wait_ready(START_TIMEOUT_S)
                self._idle.put(w)
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the adapter reader is closed")
            w = _Worker(self.threads)
            self._all.append(w)
            return w

    def _replace(self, dead: _Worker) -> _Worker:
        dead.kill()
        with self._lock:
            if dead in self._all:
                self._all.remove(dead)
            self.restarts += 1
        log.warning("adapter reader process %d died; starting a new one", dead.pid)
        _remove_stale()  # a file it wrote but never handed over
        w = self._spawn()
        w.wait_ready(START_TIMEOUT_S)
        return w

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return [w.pid for w in self._all]

    def read(self, name: str, source: str) -> LoadedAdapter:
        """Load one adapter; raises AdapterError (the adapter's fault, or two reader deaths)."""
        if self._closed:
            raise RuntimeError("the adapter reader is closed")
        req = ["read", {"name": name, "source": str(source), "base": asdict(self.base), "max_rank": self.max_rank,
                        "dtype": str(self.dtype).removeprefix("torch.")}]
        while True:
            try:
                w = self._idle.get(timeout=0.5)
                break
            except queue.Empty:
                if self._closed:
                    raise RuntimeError("the adapter reader is closed") from None
        try:
            for attempt in (1, 2):
                try:
                    kind, payload = w.call(req)
                    break
                except WorkerDied:
                    w = self._replace(w)
                    if attempt == 2:
                        raise AdapterError(name, "reading the adapter killed its reader process twice") from None
        finally:
            self._idle.put(w)
        if kind == "adapter_error":
            raise AdapterError(name, payload)
        if kind != "ok":
            raise RuntimeError(f"adapter reader: {payload}")
        try:
            packed = self._take(payload["file"], payload["layout"], payload["host_ranks"])
        finally:
            _unlink(payload["file"])
        with self._lock:
            self.stats["worker_seconds"] += payload["seconds"]
        return LoadedAdapter(spec_from_wire(payload["spec"]), packed=packed)

    def _take(self, path: str, layout, host_ranks) -> Packed:
        """The shared-memory file read straight into one (pinned) buffer, cut into the packed tensors."""
        size = os.path.getsize(path)
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        with open(path, "rb", buffering=0) as f:
            view, got = memoryview(buf.numpy()), 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    raise RuntimeError("adapter reader: the shared-memory file is short")
                got += n
        a, bt, ranks = {}, {}, None
        for kind, p, off, shape, dtype in layout:
            dt = getattr(torch, dtype)
            n = dt.itemsize
            for d in shape:
                n *= d
            t = buf[off : off + n].view(dt).view(shape)
            if kind == "a":
                a[p] = t
            elif kind == "b":
                bt[p] = t
            else:
                ranks = t
        return Packed(a, bt, ranks, host_ranks)

    def close(self) -> None:
        """Stop every worker (idempotent); reads still waiting fail."""
        with self._lock:
            self._closed = True
            workers, self._all = self._all, []
        for w in workers:  # ask all first, then wait for all: a close takes one timeout, not one per worker
            try:
                w.ch.send(["shutdown"])
            except OSError:
                pass
        deadline = time.monotonic() + 3.0
        for w in workers:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            w.kill()
        _remove_stale()


if __name__ == "__main__":
    sys.exit(main())

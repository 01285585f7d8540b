"""The front's handle on its engine core process: start it, talk to it, notice when it dies.

    client = EngineClient(model, engine_config_dict)
    await client.start()                     # spawns the core, waits for ["ready", info]
    client.submit(wire_request, owner)       # owner.deliver(entries) gets this request's outputs
    client.cancel(request_id)
    client.snapshot                          # the core's last state (batch, KV, adapters)
    client.alive, client.error               # error: why the core is gone (exit status, fatal message)
    await client.stop(timeout)               # ["shutdown"], wait, SIGKILL if it hangs; always reaped

Outputs arrive once per engine step for the whole batch: `[request id, [new ids], finish_reason,
error]` entries, grouped by owner (one owner per scheduler stream) and handed over in one
`owner.deliver(entries)` call per owner per step. When the core dies — a fatal step error, a
failed load, SIGKILL, any exit — every in-flight request gets a final entry with
finish_reason "aborted" and the reason, so its scheduler re-places it elsewhere, and the front
reports the runner unhealthy with that reason. A core that sends nothing, not even its heartbeat
(every second, from a thread of its own), for LORAFLEET_ENGINE_STALL_S seconds — a stopped or
frozen process — is killed, and then handled the same way.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time
from typing import Callable, Protocol

from lorafleet import env
from lorafleet.common.procs import die_with_parent
from lorafleet.common.channel import AsyncChannel, ChannelClosed

log = logging.getLogger(__name__)

FATAL_EXIT_S = 10.0  # a core that sent its fatal reason before ready and has not exited this long after: killed


class Owner(Protocol):
    def deliver(self, entries: list[list]) -> None: ...


def _core_preexec() -> None:  # in the child, before exec: die with the front
    die_with_parent(signal.SIGKILL)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "engine core is gone"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"engine core was killed by {name}"
    return f"engine core exited with status {code}"


class EngineClient:
    def __init__(self, model: str, config: dict, log_level: str = "INFO"):
        self.model, self.config, self.log_level = model, config, log_level
        self.proc: asyncio.subprocess.Process | None = None
        self.chan: AsyncChannel | None = None
        self.info: dict = {}
        self.snapshot: dict = {}
        self.error: str | None = None
        self.owners: dict[str, Owner] = {}  # in-flight request id -> who gets its outputs
        self.on_step: list[Callable[[list[list]], None]] = []  # metrics: every step's entries
        self._reader: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._exited = asyncio.Event()
        self._fatal = asyncio.Event()  # the core sent its fatal reason
        self._stopping = False
        self.stall_s = env.engine_stall_seconds()  # 0: never judged stalled
        self.last_heard = time.monotonic()  # the core's last message of any kind

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> bool:
        """Spawn the core and wait until it has loaded the model: True, or False if the core exited first (then
        `error` says why, and the caller reports it)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "lorafleet.runner.service.engine_core", "--fd", str(theirs.fileno()),
                "--log-level", self.log_level, pass_fds=(theirs.fileno(),), preexec_fn=_core_preexec,
                stdin=asyncio.subprocess.DEVNULL)
        finally:
            theirs.close()
        asyncio.create_task(self._watch())  # from now on _exited is set whenever the core exits
        try:
            self.chan = await AsyncChannel.open(mine)
            self.chan.send(["init", {"model": self.model, "config": self.config}])
        except BaseException:
            self.proc.kill()  # it would wait for its init forever
            raise
        self._reader = asyncio.create_task(self._read_loop())
        waits = [asyncio.create_task(e.wait()) for e in (self._ready, self._exited, self._fatal)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if not self._ready.is_set():  # it exited, or said why it will: give it FATAL_EXIT_S to go, then make it
            try:
                await asyncio.wait_for(self._exited.wait(), FATAL_EXIT_S)
            except asyncio.TimeoutError:
                log.warning("engine core (pid %s) still running %.0fs after its fatal error; killing it", self.pid,
                            FATAL_EXIT_S)
                self.proc.kill()
                await self._exited.wait()
        if self._ready.is_set() and self.stall_s > 0:
            asyncio.create_task(self._stall_watch())
        return self._ready.is_set()

    async def _stall_watch(self) -> None:
        """Kill the core once it has sent nothing for `stall_s` seconds (its heartbeat thread beats every second, also
        during a long step); `_watch` then ends its requests and reports the runner unhealthy. A round in which this
        loop itself was held up (a blocked event loop delays the reader too) judges nothing."""
        period = min(1.0, self.stall_s / 4)
        last = time.monotonic()
        while not self._exited.is_set() and not self._stopping:
            await asyncio.sleep(period)
            now = time.monotonic()
            late, last = now - last > period + 1.0, now
            quiet = now - self.last_heard
            if late or quiet <= self.stall_s or not self.alive or self._stopping:
                continue
            self.error = (f"engine core sent nothing for {quiet:.0f}s, not even its heartbeat (stopped or frozen; "
                          f"LORAFLEET_ENGINE_STALL_S={self.stall_s:g}): killed")
            log.error("%s", self.error)
            self.proc.kill()
            return

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask the core to exit; kill it if it does not within `timeout`. Always reaps it."""
        self._stopping = True
        if self.proc is None:
            return
        if self.proc.returncode is None:
            try:
                self.chan.send(["shutdown"])
            except (ConnectionError, RuntimeError, AttributeError):
                pass
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("engine core did not exit in %.0fs; killing it", timeout)
                self.proc.kill()
                await self.proc.wait()
        await self._exited.wait()
        if self.chan:
            self.chan.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.alive

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and self.error is None

    # -- requests ------------------------------------------------------------------------------
    def submit(self, request: dict, owner: Owner) -> None:
        """Send one request (`channel.py` shape) to the core; its outputs go to `owner`."""
        self.owners[request["id"]] = owner
        self.chan.send(["submit", request])

    def cancel(self, request_id: str) -> None:
        if request_id in self.owners and self.alive:
            self.chan.send(["cancel", request_id])

    def in_flight(self, owner: Owner | None = None) -> list[str]:
        return [rid for rid, o in self.owners.items() if owner is None or o is owner]

    # -- the core's messages ---------------------------------------------------------------------
    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await self.chan.recv()
                self.last_heard = time.monotonic()
                kind = msg[0]
                if kind == "beat":
                    continue
                if kind == "step":
                    if msg[2] is not None:
                        self.snapshot = msg[2]
                    if msg[1]:
                        self._route(msg[1])
                elif kind == "state":
                    self.snapshot = msg[1]
                elif kind == "ready":
                    self.info = msg[1]
                    self.snapshot = msg[1].get("state") or {}
                    self._ready.set()
                    log.info("engine core (pid %s) ready", self.pid)
                elif kind == "fatal":
                    self.error = str(msg[1])
                    self._fatal.set()
                    if self._ready.is_set():  # before ready, start()'s caller reports it
                        log.error("engine core: %s", self.error)
        except ChannelClosed:
            pass
        except Exception as exc:  # a malformed message: treat the core as broken
            log.exception("bad message from the engine core")
            self.error = self.error or f"bad message from the engine core: {exc}"
            if self.proc and self.proc.returncode is None:
                self.proc.kill()

    def _route(self, entries: list[list]) -> None:
        groups: dict[int, tuple[Owner, list]] = {}
        owners = self.owners
        for e in entries:
            rid = e[0]
            owner = owners.get(rid)
            if owner is None:
                continue
            if e[2] is not None:
                del owners[rid]
            g = groups.get(id(owner))
            if g is None:
                groups[id(owner)] = (owner, [e])
            else:
                g[1].append(e)
        for fn in self.on_step:
            fn(entries)
        for owner, es in groups.values():
            owner.deliver(es)

    async def _watch(self) -> None:
        code = await self.proc.wait()
        if self._reader is not None:
            try:  # let the reader take in what the core sent before it exited (its fatal reason)
                await asyncio.wait_for(asyncio.shield(self._reader), 1.0)
            except (asyncio.TimeoutError, Exception):
                self._reader.cancel()
        if not (self._stopping and code == 0):
            reason = describe_exit(code)
            self.error = f"{self.error} ({reason})" if self.error else reason
            if self._ready.is_set():
                log.error("%s; the runner is unhealthy", self.error)
        else:
            self.error = self.error or "engine core stopped"
        self.abort_all(self.error)
        self._exited.set()

    def abort_all(self, reason: str) -> None:
        """End every in-flight request with finish_reason "aborted" (its scheduler re-places it)."""
        if self.owners:
            self._route([[rid, [], "aborted", reason] for rid in list(self.owners)])

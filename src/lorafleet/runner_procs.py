"""The runner child processes of `lorafleet serve`, and the supervisor that restarts dead ones.

Each runner is a child in its own session (so Ctrl-C reaches only `serve`, which stops them in
order) that also gets SIGTERM if `serve` dies. A runner that exits while serving is restarted
on the same port (the scheduler keeps its endpoint, sees it unhealthy meanwhile and re-places
its requests) after a backoff that doubles from `BACKOFF_S` up to `MAX_BACKOFF_S`, and starts
over once a runner has stayed up for `STABLE_S`. A runner whose process is up but whose
`/healthz` reports an error (its engine core died: the front stays up to say why) for
`SICK_CHECKS` checks in a row is stopped, and so restarted the same way. Every exit and restart
is logged.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from lorafleet.common.procs import die_with_parent

log = logging.getLogger("lorafleet.serve")

BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0
SICK_CHECKS = 2


def _die_with_parent() -> None:  # runs in the child before exec
    die_with_parent(signal.SIGTERM)


@dataclass
class RunnerProcess:
    """One runner child: its id, URL and command, and the process running it now."""

    rid: str
    url: str
    cmd: list[str]
    env: dict | None = None
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    backoff: float = BACKOFF_S
    next_start: float | None = None  # when a dead runner is due to be started again
    sick: int = 0  # consecutive health checks that reported an error
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True, preexec_fn=_die_with_parent)
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health_error(self) -> str | None:
        """The error its /healthz reports (500), or None (healthy, or not answering yet)."""
        import json
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=2):
                return None
        except urllib.error.HTTPError as exc:
            if exc.code != 500:
                return None
            try:
                return str(json.loads(exc.read()).get("error") or "unhealthy")
            except ValueError:
                return "unhealthy"
        except OSError:
            return None


class Supervisor:
    """Restarts runners that exit while serving; `stop()` ends supervision before shutdown."""

    def __init__(self, runners: list[RunnerProcess], interval: float = 0.5):
        self.runners = runners
        self.interval = interval
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runner-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def check(self, now: float | None = None) -> None:
        """One pass: notice exits, schedule restarts with backoff, start those that are due."""
        now = time.monotonic() if now is None else now
        for r in self.runners:
            with r.lock:
                if self._stopping.is_set():
                    return
                if r.alive():
                    if now - r.started > STABLE_S:
                        r.backoff = BACKOFF_S
                    why = r.health_error()
                    r.sick = r.sick + 1 if why else 0
                    if r.sick >= SICK_CHECKS:
                        log.warning("runner %s is up but unhealthy (%s); stopping it to restart it", r.rid, why)
                        r.sick = 0
                        r.proc.terminate()
                    continue
                if r.next_start is None:
                    code = r.proc.returncode if r.proc is not None else None
                    r.next_start = now + r.backoff
                    log.warning("runner %s exited (code %s); restarting it in %.0fs", r.rid, code, r.backoff)
                    r.backoff = min(r.backoff * 2, MAX_BACKOFF_S)
                elif now >= r.next_start:
                    r.next_start = None
                    r.restarts += 1
                    log.info("restarting runner %s (restart %d) at %s", r.rid, r.restarts, r.url)
                    r.start()

    def _run(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                self.check()
            except OSError as exc:  # e.g. out of processes: try again at the next pass
                log.error("could not restart a runner: %s", exc)


def stop_children(runners: list[RunnerProcess], grace: float) -> None:
    """SIGTERM every live runner, wait up to `grace` seconds, then SIGKILL the rest."""
    for r in runners:
        if r.alive():
            r.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for r in runners:
        if r.proc is None:
            continue
        try:
            r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("runner %s did not stop in %.0fs; killing it", r.rid, grace)
            r.proc.kill()
            r.proc.wait()

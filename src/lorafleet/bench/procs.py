"""Child processes of the benchmarks: start, wait until ready, read their CPU time, stop (always reaped)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(args: list[str], log: Path | None = None, env: dict | None = None) -> subprocess.Popen:
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    """Poll `url`/readyz until 200; fail early (with the tail of its output when piped) if the
    process exits, and after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pipe = proc.stderr or proc.stdout
            out = pipe.read() if pipe is not None else ""
            raise RuntimeError(f"{what} exited with status {proc.returncode}" + (f": {out[-3000:]}" if out else ""))
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s")


def wait_file(path: Path, proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.stat().st_size:
            return json.loads(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with status {proc.returncode}")
        time.sleep(0.1)
    raise RuntimeError(f"{path} not written after {timeout:.0f}s")


def stop(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM (orderly shutdown), then SIGKILL after `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

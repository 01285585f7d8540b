"""Run a real `lorafleet serve` on loopback for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from cluster_helpers import free_port, wait_http_ready

TOKEN = "serve-admin"
RUNNER_TOKEN = "serve-runner-credential"


class Served:
    def __init__(self, model: Path, adapters: Path, *args: str, runners: int = 1):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "LORAFLEET_ADMIN_TOKEN": TOKEN, "LORAFLEET_RUNNER_TOKEN": RUNNER_TOKEN}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lorafleet", "serve", "--model", str(model), "--adapters", str(adapters),
             "--port", str(self.port), "--runners", str(runners), "--device", "cpu", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_ready(self, timeout=240.0) -> None:
        wait_http_ready(self.url, self.proc, "serve", timeout)

    def admin_state(self) -> dict:
        req = urllib.request.Request(f"{self.url}/admin/state", headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    @staticmethod
    def runner_state(url: str) -> dict:
        """A runner's own GET /state (it needs the runner credential)."""
        req = urllib.request.Request(f"{url}/state", headers={"Authorization": f"Bearer {RUNNER_TOKEN}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def children(self, pid: int | None = None) -> list[int]:
        """Child pids of `serve` (or of `pid`)."""
        parent = self.proc.pid if pid is None else pid
        kids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                kids.append(int(stat.parent.name))
        return kids

    def stop(self, timeout=60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

"""Start real runner processes on loopback and an in-process scheduler over them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from lorafleet.bench.procs import wait_ready
from lorafleet.scheduler.discovery import RunnerDirectory, RunnerEndpoint
from lorafleet.scheduler.registry import AdapterRegistry
from lorafleet.scheduler.server import SchedulerService, create_app
from lorafleet.scheduler.tokenizer import Tokenizer

TOKEN = "admin-token"
RUNNER_TOKEN = "runner-credential"  # every test runner needs it; the scheduler sends it


def wait_http_ready(url: str, proc: subprocess.Popen, what: str, timeout: float) -> None:
    """Poll `url`/readyz until 200; fail early with the process's output if it exits."""
    wait_ready(url, proc, timeout, what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runner:
    def __init__(self, model: Path, rid: str, *args: str, env: dict | None = None):
        self.id, self.port = rid, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LORAFLEET_RUNNER_TOKEN": RUNNER_TOKEN, **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lorafleet", "--log-level", "WARNING", "runner", "--model", str(model),
             "--port", str(self.port), "--id", rid, "--device", "cpu", "--threads", "1", *args],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def state(self) -> dict:
        req = urllib.request.Request(f"{self.url}/state", headers={"Authorization": f"Bearer {RUNNER_TOKEN}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())

    def wait_ready(self, timeout=120.0) -> None:
        wait_http_ready(self.url, self.proc, f"runner {self.id}", timeout)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_runners(model: Path, n: int, *args: str, env: dict | None = None) -> list[Runner]:
    runners = [Runner(model, f"runner-{i}", *args, env=env) for i in range(n)]
    for r in runners:
        r.wait_ready()
    return runners


class Scheduler:
    """An in-process scheduler (real aiohttp server on loopback) over real runner processes."""

    def __init__(self, model: Path, runners: list[Runner], registry: AdapterRegistry | None = None,
                 wait_healthy: bool = True, **kw):
        self.wait_healthy = wait_healthy
        self.service = SchedulerService(
            Tokenizer(model), "tiny", registry or AdapterRegistry(),
            RunnerDirectory([RunnerEndpoint(r.id, r.url) for r in runners]),
            max_model_len=kw.pop("max_model_len", 512), admin_token=TOKEN, poll_interval=0.1,
            runner_token=kw.pop("runner_token", RUNNER_TOKEN), **kw)
        self.client = TestClient(TestServer(create_app(self.service)))
        self.auth = {"Authorization": f"Bearer {TOKEN}"}

    async def __aenter__(self):
        await self.client.start_server()
        for _ in range(200 if self.wait_healthy else 0):
            if all(r.healthy and r.connected for r in self.service.cluster.runners.values()):
                break
            await asyncio.sleep(0.05)
        return self

    async def __aexit__(self, *exc):
        await self.client.close()

    async def state(self) -> dict:
        return await (await self.client.get("/admin/state", headers=self.auth)).json()

    async def batches(self) -> dict[str, int]:
        return {r["id"]: r["batch_size"] for r in (await self.state())["runners"]}

    async def stream_tokens(self, prompt_ids: list[int], max_tokens: int, record: list | None = None, **extra) -> str:
        """Streaming completion; returns the concatenated text."""
        body = {"model": "tiny", "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, **extra}
        # (`async with`: a cancelled caller closes the connection, as a client that goes away does; an abandoned
        # response would keep it open until garbage collection)
        async with self.client.post("/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            text = []
            async for line in resp.content:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                assert "error" not in ev, ev
                piece = ev["choices"][0]["text"]
                text.append(piece)
                if record is not None:
                    record.append(piece)
        return "".join(text)

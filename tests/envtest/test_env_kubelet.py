"""The test cluster itself: a Deployment's pod runs as a local process on its own loopback address
with its env, volumes and ServiceAccount token; readiness gates the Service; deletion stops it."""

from __future__ import annotations

import base64
import json
import sys
import urllib.request

import pytest
from envkit import wait_for
from podspec import PodSpecError, command_line, container_env, expand, narrow_binds, remap_paths

pytestmark = pytest.mark.timeout(180)

NS = "kubelet-check"

# A tiny server: /healthz answers once the file /ready exists in its emptyDir, /env shows what it got,
# /token shows whether its ServiceAccount token works against the API server.
SERVER = r'''
import json, os, ssl, sys, urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
host, port, scratch = sys.argv[1], int(sys.argv[2]), sys.argv[3]
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def reply(self, code, doc):
        body = json.dumps(doc).encode()
        self.send_response(code); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.path == "/healthz":
            return self.reply(200 if os.path.exists(os.path.join(scratch, "ready")) else 503, {})
        if self.path == "/ready":
            open(os.path.join(scratch, "ready"), "w").close(); return self.reply(200, {})
        if self.path == "/env":
            return self.reply(200, {"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd()})
        if self.path == "/whoami":
            sa = os.environ["LORAFLEET_SERVICEACCOUNT_DIR"]
            token = open(os.path.join(sa, "token")).read()
            ctx = ssl.create_default_context(cafile=os.path.join(sa, "ca.crt"))
            url = "https://%s:%s/apis/authentication.k8s.io/v1/selfsubjectreviews" % (
                os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"])
            req = urllib.request.Request(url, method="POST", data=b'{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}',
                                         headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
            return self.reply(200, json.loads(urllib.request.urlopen(req, context=ctx).read()))
        self.reply(404, {})
ThreadingHTTPServer((host, port), H).serve_forever()
'''


def deployment(replicas: int = 1) -> dict:
    labels = {"app": "echo"}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "echo", "namespace": NS},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"terminationGracePeriodSeconds": 5, "containers": [{
                "name": "echo", "image": "ignored:1",
                "command": ["python3", "-c", SERVER],
                "args": ["0.0.0.0", "9000", "/scratch"],
                "ports": [{"name": "http", "containerPort": 9000}],
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "GREETING", "valueFrom": {"secretKeyRef": {"name": "echo", "key": "greeting"}}},
                        {"name": "URL", "value": "http://$(POD_IP):9000/x"},
                        {"name": "CACHE", "value": "/scratch/cache"}],
                "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 5},
                "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
            }], "volumes": [{"name": "scratch", "emptyDir": {}}]},
        }},
    }


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_podspec_rules():
    env = {"A": "1", "B": "x"}
    assert expand("$(A)-$(B)-$(C)-$$(A)", env) == "1-x-$(C)-$(A)"
    assert narrow_binds("0.0.0.0", "127.9.9.2") == "127.9.9.2"
    assert narrow_binds("--liveness=http://0.0.0.0:8080/healthz", "127.9.9.2") == "--liveness=http://127.9.9.2:8080/healthz"
    assert narrow_binds("10.0.0.0", "127.9.9.2") == "10.0.0.0"
    mounts = {"/tmp": "/w/tmp", "/etc/keys": "/w/keys"}
    assert remap_paths("/etc/keys/k", mounts) == "/w/keys/k"
    assert remap_paths("--key-file=/etc/keys/k", mounts) == "--key-file=/w/keys/k"
    assert remap_paths("/etc/keysX", mounts) == "/etc/keysX" and remap_paths("/tmp", mounts) == "/w/tmp"
    pod = {"metadata": {"name": "p", "namespace": "n"}}
    ctr = {"command": ["x"], "args": ["--host", "$(POD_IP)", "--dir", "/tmp/a"],
           "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                   {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                   {"name": "O", "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope", "optional": True}}}]}
    got = container_env(pod, ctr, "127.9.9.2", lambda kind, name, key: {"k": "v"}.get(key) if key else None)
    assert got == {"POD_IP": "127.9.9.2", "T": "v"}
    assert command_line(ctr, got, "127.9.9.2", mounts) == ["x", "--host", "127.9.9.2", "--dir", "/w/tmp/a"]
    with pytest.raises(PodSpecError, match="no key 'k'"):
        container_env(pod, ctr, "127.9.9.2", lambda kind, name, key: None)


def test_a_pod_runs_as_a_process_and_stops_with_its_deletion(cluster):
    cluster.manage(NS)
    cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "echo", "namespace": NS},
                   "data": {"greeting": base64.b64encode(b"hello").decode()}},
                  {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "echo", "namespace": NS},
                   "spec": {"selector": {"app": "echo"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}},
                  deployment())

    def running():
        pods = cluster.pods(NS, "app=echo")
        return pods if pods and (pods[0].get("status") or {}).get("phase") == "Running" else None

    (pod,) = wait_for(running, 60, "the echo pod Running", on_timeout=lambda: cluster.logs("echo"))
    ip = pod["status"]["podIP"]
    assert ip.startswith("127.") and ip != "127.0.0.1" and pod["spec"]["nodeName"] == cluster.kubelet.node
    # Not Ready until its probe passes; the Service has no endpoint meanwhile.
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "False"

    def answers():
        try:
            return get_json(f"http://{ip}:9000/env")
        except OSError:  # Running means started, not yet listening
            return None

    seen = wait_for(answers, 30, "the process to answer")
    env = seen["env"]
    assert env["POD_IP"] == ip and env["POD_NAME"] == pod["metadata"]["name"] and env["GREETING"] == "hello"
    assert env["URL"] == f"http://{ip}:9000/x"
    scratch = seen["argv"][3]
    assert scratch.endswith("/volumes/scratch") and env["CACHE"] == scratch + "/cache"
    # The default ServiceAccount's token (bound to the pod) works against the API server.
    who = get_json(f"http://{ip}:9000/whoami")
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{NS}:default"

    get_json(f"http://{ip}:9000/ready")  # now the readiness probe passes
    wait_for(lambda: any(c["type"] == "Ready" and c["status"] == "True"
                         for c in (cluster.get("v1", "pods", pod["metadata"]["name"], NS) or {})
                         .get("status", {}).get("conditions", [])), 15, "Ready")
    url = cluster.service_url(NS, "echo", 80)

    def through_service():
        try:
            return get_json(url + "/env")["env"]["POD_NAME"] == pod["metadata"]["name"]
        except OSError:
            return False

    wait_for(through_service, 30, "the Service to reach the pod", on_timeout=lambda: str(cluster.proxy.errors))
    proc = cluster.kubelet.running(NS)[pod["metadata"]["name"]].proc
    assert proc is not None and proc.poll() is None

    cluster.delete("apps/v1", "deployments", "echo", NS)
    wait_for(lambda: not cluster.pods(NS, "app=echo"), 60, "the pod to be gone")
    assert proc.poll() is not None  # the process ended with its pod
    assert sys.executable  # (the interpreter the pod ran with is this one's venv)

"""The whole system on a real control plane, as a user drives it: `helm install` (the operator runs
as its pod), `kubectl apply` of a ServingPool for the SmolLM2 demo (CPU) and three LoraAdapters
served on loopback, the official openai client through the scheduler's Service, autoscaling with
a node group, and the faults: operator restarted mid-scale, a runner and the scheduler deleted
mid-stream, an adapter deleted while in use, the pool deleted.

The steps build on each other and run in file order on one module-scoped pool. Greedy decoding
everywhere: every answer must equal `lorafleet generate`'s for the same request, including the
ones that moved between runners.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import openai
import pytest
from conftest import OPERATOR_NS, RELEASE
from envkit import wait_for
from poolkit import (
    GROUP,
    MD_API,
    NODE_GROUP_CRD,
    FileServer,
    Load,
    Pool,
    Reference,
    Sampler,
    Transcript,
    manifest_yaml,
    wait_ready_runners,
)

pytestmark = pytest.mark.timeout(300)

NS, POOL = "ml", "demo"
ADAPTERS = ("pirate", "shouty", "terse")
CAPITAL, COOK, STORY = ("What is the capital of France?", "Give me a tip for learning to cook.",
                        "Tell me a long story about a ship at sea.")
# Reference id -> (adapter or None for the base model, question, max_tokens).
CASES = {
    **{f"basic-{a or 'base'}": (a, CAPITAL, 16) for a in (None, *ADAPTERS)},
    **{f"load-{a}": (a, COOK, 24) for a in ADAPTERS},
    **{f"long-{a}": (a, STORY, 64) for a in ADAPTERS},
}


def scheduler_supports(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "lorafleet", "scheduler", "--help"], capture_output=True, text=True,
                         timeout=60)
    return flag in out.stdout


@pytest.fixture(scope="module")
def scenario(cluster, release, demo_dir, tmp_path_factory):
    """The demo pool, its adapters and a node group, applied with kubectl; torn down at the end."""
    work = tmp_path_factory.mktemp("scenario")
    reference = Reference(demo_dir / "model", demo_dir / "adapters", CASES, work)
    files = FileServer(demo_dir / "adapters")
    transcript = Transcript(cluster)
    cluster.manage(NS)
    api_keys = scheduler_supports("--api-keys")
    s = Scenario(cluster, Pool(cluster, NS, POOL, api_key="sk-test-all" if api_keys else None), reference, files,
                 transcript, api_keys)
    s.node_group = Sampler({"nodes": lambda: (cluster.get(MD_API, "machinedeployments", "gpu-nodes", NS) or {})
                            .get("spec", {}).get("replicas"),
                            "runners": s.pool.runner_replicas})
    yield s
    s.node_group.stop()
    files.stop()
    reference.stop()


class Scenario:
    def __init__(self, cluster, pool: Pool, reference: Reference, files: FileServer, transcript: Transcript,
                 api_keys: bool):
        self.cluster, self.pool, self.reference, self.files, self.t = cluster, pool, reference, files, transcript
        self.api_keys = api_keys
        self.base_model = ""
        self.node_group: Sampler

    def model(self, rid: str) -> str:
        adapter = CASES[rid][0]
        return adapter or self.base_model

    def expected(self, rid: str) -> str:
        return self.reference.texts[rid]

    def events(self, reason: str) -> list[str]:
        return [e.get("message", "") for e in self.cluster.events(NS, POOL) if e.get("reason") == reason]

    def diagnostics(self) -> str:
        return "\n".join([self.cluster.logs(POOL), self.cluster.logs(RELEASE), str(self.cluster.kubelet.errors),
                          str(self.pool.status())])


def pool_manifest(s: Scenario, demo_dir) -> dict:
    allow = [{"name": "LORAFLEET_ALLOW_PRIVATE_SOURCES", "value": "1"},
             {"name": "LORAFLEET_SOURCE_ROOTS", "value": str(demo_dir)}]
    spec = {
        "model": {"source": str(demo_dir / "model")},
        "runner": {"maxBatchSize": 4, "maxLoraRank": 16, "terminationGracePeriodSeconds": 10, "env": allow,
                   # CPU runners, a small KV cache, one torch thread each (the pods share this machine's
                   # cores; a runner's default is every core it may use); extra arguments come last and win.
                   "extraArgs": ["--device", "cpu", "--kv-cache-gb", "0.15", "--threads", "1"]},
        "scheduler": {"env": allow},
        "minRunners": 1, "maxRunners": 3,
        "idleSecondsBeforeDrain": 600,  # lowered when the scale-down step starts
        "autoscaling": {"scaleUpDelaySeconds": 1, "scaleUpCooldownSeconds": 2, "maxScaleUpStep": 2},
        "nodeGroup": {"apiVersion": MD_API, "kind": "MachineDeployment", "name": "gpu-nodes", "gpusPerNode": 1,
                      "minReplicas": 1, "maxReplicas": 3},
    }
    if s.api_keys:
        spec["apiKeys"] = {"secretName": "demo-api-keys"}
    return {"apiVersion": GROUP, "kind": "ServingPool", "metadata": {"name": POOL, "namespace": NS}, "spec": spec}


def adapter_manifest(s: Scenario, name: str) -> dict:
    return {"apiVersion": GROUP, "kind": "LoraAdapter", "metadata": {"name": name, "namespace": NS},
            "spec": {"pool": POOL, "source": f"{s.files.url}/{name}"}}


def pod_ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or ())


# --- 1. install, apply, Ready ----------------------------------------------------------------------


def test_pool_and_adapters_become_ready(scenario, demo_dir):
    s, cluster = scenario, scenario.cluster
    cluster.apply(NODE_GROUP_CRD)
    wait_for(lambda: cluster.plane.get("/apis/cluster.x-k8s.io/v1beta1"), 30, "the node-group API")
    docs = [{"apiVersion": MD_API, "kind": "MachineDeployment", "metadata": {"name": "gpu-nodes", "namespace": NS},
             "spec": {"replicas": 0}}]
    if s.api_keys:
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "demo-api-keys", "namespace": NS},
                     "stringData": {"keys": "sk-test-all\nsk-test-pirate pirate\n"}})
    cluster.apply(*docs)
    s.t.note("helm install lorafleet charts/lorafleet -n lorafleet-system (short intervals for the test)")
    s.t.kubectl("-n", OPERATOR_NS, "get", "deploy,pods")
    s.t.note("kubectl apply -f pool.yaml -f adapters.yaml")
    manifest = manifest_yaml(pool_manifest(s, demo_dir), *(adapter_manifest(s, a) for a in ADAPTERS))
    out = cluster.kubectl("apply", "-f", "-", input=manifest)
    assert "servingpool.lorafleet.dev/demo created" in out and "loraadapter.lorafleet.dev/pirate created" in out
    s.t.kubectl("get", "servingpools,loraadapters", "-n", NS)

    # The node group goes to its minimum from the spec alone (the scheduler is not up yet).
    wait_for(lambda: s.node_group.trace["nodes"] and s.node_group.trace["nodes"][-1] == 1, 30, "node group at 1")
    wait_for(lambda: s.pool.condition("Ready") == "True", 120, "the pool Ready", on_timeout=s.diagnostics)

    def adapters_ready():
        items = cluster.list(GROUP, "loraadapters", NS)
        return len(items) == 3 and all((i.get("status") or {}).get("phase") == "Ready" for i in items) and items

    items = wait_for(adapters_ready, 90, "three adapters Ready", on_timeout=s.diagnostics)
    ranks = {i["metadata"]["name"]: i["status"]["rank"] for i in items}
    assert ranks == {"pirate": 16, "shouty": 8, "terse": 4}
    s.t.note("pool and adapters Ready")
    s.t.kubectl("get", "servingpools", "-n", NS)
    s.t.kubectl("get", "loraadapters", "-n", NS, "-o", "wide")
    s.t.kubectl("get", "deploy,svc,networkpolicy,secrets,pods", "-n", NS, "-l", f"lorafleet.dev/pool={POOL}")
    s.t.kubectl("describe", "servingpool", POOL, "-n", NS)

    # What the operator made: the runner credential reaches both ends; runners bind to their pod IP.
    (runner,) = s.pool.runner_pods()
    assert runner["spec"]["containers"][0]["args"][1:3] == ["--host", "$(POD_IP)"]
    proc = cluster.kubelet.running(NS)[runner["metadata"]["name"]]
    assert proc.proc.args[proc.proc.args.index("--host") + 1] == runner["status"]["podIP"]
    for secret in ("demo-admin", "demo-runner-token"):
        assert cluster.get("v1", "secrets", secret, NS)["metadata"]["ownerReferences"][0]["name"] == POOL
    policy = cluster.get("networking.k8s.io/v1", "networkpolicies", "demo-runner", NS)
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] \
        == "scheduler"
    from controlplane import REPO

    if "LORAFLEET_RUNNER_TOKEN" in (REPO / "src" / "lorafleet" / "env.py").read_text():
        # The runner-side check exists in this tree (CONTRACT: env.py names the variable): a runner
        # refuses a request without the pool's credential.
        import urllib.error
        import urllib.request

        url = f"http://{runner['status']['podIP']}:8001/v1/generate"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(url, data=b"{}", method="POST"), timeout=10)
        assert err.value.code == 401


# --- 2. requests through the Service ------------------------------------------------------------------


def test_openai_client_through_the_service_equals_generate(scenario):
    s = scenario
    models = {m.id: getattr(m, "parent", None) for m in s.pool.client().models.list().data}
    assert set(ADAPTERS) <= set(models)
    (s.base_model,) = [m for m in models if m not in ADAPTERS]
    for rid in ("basic-base", "basic-pirate", "basic-shouty", "basic-terse"):
        text, finish = s.pool.chat(s.model(rid), CAPITAL, 16)
        assert text == s.expected(rid), rid
        assert finish in ("stop", "length")
    streamed, _ = s.pool.stream("pirate", CAPITAL, 16)
    assert streamed == s.expected("basic-pirate")
    with pytest.raises(openai.NotFoundError):
        s.pool.client(max_retries=0).chat.completions.create(model="no-such-adapter", max_tokens=4,
                                                             messages=[{"role": "user", "content": "hi"}])
    if s.api_keys:  # the pool's API keys are in force: none -> 401; a key limited to pirate -> refused for shouty
        with pytest.raises(openai.AuthenticationError):
            s.pool.client(api_key="wrong", max_retries=0).models.list()
        limited = s.pool.client(api_key="sk-test-pirate", max_retries=0)
        assert limited.chat.completions.create(model="pirate", max_tokens=16, temperature=0, messages=[
            {"role": "user", "content": CAPITAL}]).choices[0].message.content == s.expected("basic-pirate")
        with pytest.raises((openai.PermissionDeniedError, openai.NotFoundError)):
            limited.chat.completions.create(model="shouty", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    s.t.note("requests through the scheduler Service (here a loopback address standing for the Service)")
    shown = f"{POOL}-scheduler.{NS}.svc:8000"
    s.t.http(s.pool.url + "/v1/models", api_key=s.pool.api_key, show=shown)
    answer = s.t.http(s.pool.url + "/v1/chat/completions", {
        "model": "pirate", "messages": [{"role": "user", "content": CAPITAL}], "max_tokens": 16, "temperature": 0},
        api_key=s.pool.api_key, show=shown)
    assert answer["choices"][0]["message"]["content"] == s.expected("basic-pirate")
    s.t.kubectl("get", "servingpool", POOL, "-n", NS, "-o", "wide")


# --- 3. load rises: more runners, the node group follows; the operator restarts mid-scale -------------


def test_load_adds_runners_node_group_follows_operator_restarted_mid_scale(scenario):
    s, cluster = scenario, scenario.cluster
    cases = [(f"load-{a}", a, COOK, 24) for a in ADAPTERS]
    load = Load(s.pool, cases, s.reference.texts, workers=12)
    try:
        wait_for(lambda: (s.pool.runner_replicas() or 0) >= 3, 60, "the operator to add runners",
                 on_timeout=s.diagnostics)
        # Mid-scale: the new runners are starting; the operator's pod is deleted (its Deployment makes another).
        (old,) = [p for p in cluster.pods(OPERATOR_NS, f"app.kubernetes.io/instance={RELEASE}")
                  if not p["metadata"].get("deletionTimestamp")]
        s.t.note("load: 12 clients; the operator scaled the runners; its pod is deleted mid-scale")
        s.t.kubectl("get", "servingpools", "-n", NS)
        cluster.delete("v1", "pods", old["metadata"]["name"], OPERATOR_NS)

        wait_for(lambda: [p for p in cluster.pods(OPERATOR_NS, f"app.kubernetes.io/instance={RELEASE}")
                          if p["metadata"]["uid"] != old["metadata"]["uid"] and pod_ready(p)], 60,
                 "a new operator pod", on_timeout=s.diagnostics)
        ready = wait_ready_runners(s.pool, 3, 120)
        # The scheduler puts work on every runner while the load lasts.
        wait_for(lambda: sum(1 for r in s.pool.ready_runners() if r["batch_size"] > 0) == 3, 60,
                 "all three runners busy", on_timeout=s.diagnostics)
        assert len(ready) == 3
    finally:
        load.stop()
    n = load.check()
    assert n >= 12
    wait_for(lambda: s.node_group.trace["nodes"][-1] == 3, 30, "the node group at 3 nodes")
    s.t.note(f"{n} requests answered, each equal to generate's; 3 runners, node group at 3")
    s.t.kubectl("get", "servingpools", "-n", NS)
    s.t.kubectl("get", "machinedeployments", "-n", NS)

    # The old operator left quietly; the new one carried on from the pool's status.
    old_log = cluster.kubelet.find(old["metadata"]["name"]).log_tail(200_000)
    bad = [i for i, line in enumerate(old_log.splitlines()) if "Will escalate" in line or "Traceback" in line]
    assert not bad, "the old operator did not leave quietly:\n" + "\n".join(old_log.splitlines()[bad[0]: bad[0] + 40])
    assert any(re.fullmatch(r"runners [12] -> 3 .*|runners [12] -> 3", m) for m in s.events("Autoscaled")), \
        s.events("Autoscaled")
    assert [m for m in s.events("Autoscaled") if "node group" in m]
    nodes = [n for n in s.node_group.trace["nodes"] if n is not None]
    assert min(nodes[nodes.index(1):]) >= 1 and max(nodes) == 3


# --- 4. a runner pod deleted mid-stream -----------------------------------------------------------


def test_runner_pod_deleted_mid_stream_requests_finish_elsewhere(scenario):
    s, cluster = scenario, scenario.cluster
    wait_ready_runners(s.pool, 3, 60)
    victim: dict = {}

    def delete_the_busy_runner():
        busy = wait_for(lambda: [r for r in s.pool.ready_runners() if r["batch_size"] >= 2], 30, "a busy runner")
        victim["id"] = busy[0]["id"]
        cluster.kubectl("delete", "pod", victim["id"], "-n", NS, "--grace-period=1", "--wait=false")

    # Two long streams land on the same runner (busiest-that-fits); it goes away after their first tokens.
    import threading

    other: dict = {}
    t = threading.Thread(target=lambda: other.update(r=s.pool.stream("shouty", STORY, 64)))
    t.start()
    time.sleep(0.3)
    text, later = s.pool.stream("pirate", STORY, 64, after_first=delete_the_busy_runner)
    t.join(180)
    assert later > 0, "the stream had ended before its runner was deleted"
    assert text == s.expected("long-pirate")
    assert other["r"][0] == s.expected("long-shouty")
    wait_for(lambda: victim["id"] not in {p["metadata"]["name"] for p in s.pool.runner_pods(alive=False)}, 60,
             "the deleted runner pod gone")
    assert cluster.kubelet.find(victim["id"]).proc.poll() is not None
    s.t.note(f"runner {victim['id']} deleted mid-stream; both streams finished elsewhere, tokens identical")
    s.t.kubectl("get", "pods", "-n", NS, "-l", "app.kubernetes.io/component=runner")


# --- 5. load stops: idle runners drained, exactly those pods removed, node group follows ----------


def test_idle_runners_drained_and_exactly_those_pods_removed(scenario):
    s, cluster = scenario, scenario.cluster
    wait_ready_runners(s.pool, 3, 120)
    before = {p["metadata"]["name"] for p in s.pool.runner_pods()}
    watch = Sampler({"pods": lambda: {p["metadata"]["name"] for p in s.pool.runner_pods(alive=False)}})
    # A trickle keeps one runner busy (the scheduler packs it there) while the others idle out.
    trickle = Load(s.pool, [("basic-pirate", "pirate", CAPITAL, 16)], s.reference.texts, workers=1)
    try:
        cluster.patch(GROUP, "servingpools", POOL, {"spec": {"idleSecondsBeforeDrain": 2}}, NS)
        wait_for(lambda: s.pool.runner_replicas() == 1 and len(s.pool.runner_pods(alive=False)) == 1, 150,
                 "scale-down to one runner", on_timeout=s.diagnostics)
    finally:
        trickle.stop()
        watch.stop()
    assert trickle.check() >= 1
    (left,) = s.pool.runner_pods()
    assert left["metadata"]["name"] in before  # no new pod was made on the way down
    gone = before - {left["metadata"]["name"]}
    drained = [m for m in s.events("Autoscaled") if m.startswith("draining idle runner")]
    drained_ids = {m.split()[-1] for m in drained}
    removals = [m for m in s.events("Autoscaled") if "(removing" in m]
    removed_ids = {m.rsplit("(removing ", 1)[1].rstrip(")") for m in removals}
    assert gone <= drained_ids and gone == removed_ids, (gone, drained, removals)
    ever = set().union(*watch.trace["pods"]) if watch.trace["pods"] else set()
    assert ever - before == set(), f"pods created during the scale-down: {ever - before}"
    wait_for(lambda: s.node_group.trace["nodes"][-1] == 1, 60, "the node group back to 1")
    nodes = [n for n in s.node_group.trace["nodes"] if n is not None]
    assert min(nodes[nodes.index(1):]) == 1  # never below its minimum
    s.t.note("load stopped: idle runners drained one at a time, exactly those pods removed")
    s.t.kubectl("get", "events", "-n", NS, "--field-selector", f"involvedObject.name={POOL}",
                "--sort-by=.lastTimestamp")
    s.t.kubectl("get", "servingpools", "-n", NS)


# --- 6. the scheduler pod deleted mid-stream --------------------------------------------------------


def test_scheduler_pod_deleted_mid_stream(scenario):
    s, cluster = scenario, scenario.cluster
    (old,) = s.pool.scheduler_pods()

    def delete_scheduler():
        cluster.kubectl("delete", "pod", old["metadata"]["name"], "-n", NS, "--wait=false")

    text, later = s.pool.stream("shouty", STORY, 64, after_first=delete_scheduler)
    assert later > 0, "the stream had ended before the scheduler was deleted"
    assert text == s.expected("long-shouty")  # the old scheduler finished it before leaving

    def new_scheduler_serves():
        pods = [p for p in s.pool.scheduler_pods() if p["metadata"]["uid"] != old["metadata"]["uid"] and pod_ready(p)]
        return pods and len(s.pool.ready_runners()) >= 1 and pods

    wait_for(new_scheduler_serves, 90, "a new scheduler with its runner", on_timeout=s.diagnostics)
    assert s.pool.chat("terse", CAPITAL, 16)[0] == s.expected("basic-terse")
    old_proc = cluster.kubelet.find(old["metadata"]["name"])
    assert old_proc.proc.poll() is not None and "Traceback" not in old_proc.log_tail(100_000)
    s.t.note("scheduler pod deleted mid-stream: the stream finished, a new scheduler serves")


# --- 7. an adapter deleted while in use ----------------------------------------------------------------


def test_adapter_deleted_while_in_use(scenario):
    s, cluster = scenario, scenario.cluster

    def delete_adapter():
        cluster.kubectl("delete", "loraadapter", "terse", "-n", NS, "--wait=false")

    text, later = s.pool.stream("terse", STORY, 64, after_first=delete_adapter)
    assert later > 0 and text == s.expected("long-terse")  # the request in flight finished
    with pytest.raises(openai.NotFoundError):
        s.pool.client(max_retries=0).chat.completions.create(model="terse", max_tokens=4,
                                                             messages=[{"role": "user", "content": "hi"}])
    wait_for(lambda: cluster.get(GROUP, "loraadapters", "terse", NS) is None, 60, "the adapter object gone")
    assert "terse" not in {m.id for m in s.pool.client().models.list().data}
    assert s.pool.chat("pirate", CAPITAL, 16)[0] == s.expected("basic-pirate")  # the others still serve
    s.t.note("kubectl delete loraadapter terse (while a request used it)")
    s.t.kubectl("get", "loraadapters", "-n", NS)


# --- 8. the pool deleted: everything cleaned ---------------------------------------------------------


def test_pool_deleted_everything_cleaned(scenario):
    s, cluster = scenario, scenario.cluster
    pods = s.pool.runner_pods() + s.pool.scheduler_pods()
    procs = [cluster.kubelet.find(p["metadata"]["name"]) for p in pods]
    cluster.kubectl("delete", "servingpool", POOL, "-n", NS, "--wait=false")
    children = [("apps/v1", "deployments", "demo-runner"), ("apps/v1", "deployments", "demo-scheduler"),
                ("v1", "services", "demo-runner"), ("v1", "services", "demo-scheduler"),
                ("v1", "serviceaccounts", "demo-runner"), ("v1", "serviceaccounts", "demo-scheduler"),
                ("rbac.authorization.k8s.io/v1", "roles", "demo-scheduler"),
                ("rbac.authorization.k8s.io/v1", "rolebindings", "demo-scheduler"),
                ("networking.k8s.io/v1", "networkpolicies", "demo-runner"),
                # The operator cannot read Secrets: the garbage collector removes these.
                ("v1", "secrets", "demo-admin"), ("v1", "secrets", "demo-runner-token")]

    def left():
        objs = [f"{p}/{n}" for v, p, n in children if cluster.get(v, p, n, NS) is not None]
        objs += [p["metadata"]["name"] for p in cluster.pods(NS, f"lorafleet.dev/pool={POOL}")]
        if cluster.get(GROUP, "servingpools", POOL, NS) is not None:
            objs.append("the pool")
        return objs

    wait_for(lambda: not left(), 90, "every object of the pool gone", on_timeout=lambda: str(left()))
    assert all(p is not None and p.proc.poll() is not None for p in procs)
    # The adapters stay, failed, naming why.
    wait_for(lambda: all((a.get("status") or {}).get("reason") == "PoolNotFound"
                         for a in cluster.list(GROUP, "loraadapters", NS)), 30, "adapters without a pool")
    s.t.note("kubectl delete servingpool demo")
    s.t.kubectl("get", "all,secrets,networkpolicies", "-n", NS)
    s.t.kubectl("get", "loraadapters", "-n", NS)

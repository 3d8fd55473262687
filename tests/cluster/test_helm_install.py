"""A cluster admin's first day, the way they take it: `helm install` of the chart into a real cluster
(tests/local_cluster.py: a kubelet running the operator, tuner, hook and test pods from the images
scripts/image.sh builds; cluster DNS; a default StorageClass; the Prometheus Operator with a Prometheus that selects
monitors by kube-prometheus-stack's release label). Nothing runs on the host that a cluster would run as a pod, and
the commands are the ones docs/helm.md gives.

In order: an install whose image cannot be pulled fails fast and leaves no hook rights behind; the real install
(--wait), its pods restricted and running, no 403 for its ServiceAccounts; `helm test`; an InferenceDeployment
scraped through the ServiceMonitor the operator made and retuned by the tuner pod; `helm upgrade` to a new
operator image (never two operators at once, engine pods not rolled); `helm rollback`; `helm uninstall` (what stays:
the CRDs, the study's claim, the engines); a reinstall that adopts the kept study.

Measured (printed, and written to $CHUNKPILOT_HELM_TIMINGS for bench/helm_install.py): seconds from `helm install`
to the operator and tuner Ready, to the first token of the first InferenceDeployment, and to the first tuned knobs
the engine applied.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import textwrap
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from chunkpilot.api.types import GROUP, PLURAL, VERSION
from chunkpilot.contract import metric_names as m

from ..conftest import service_account_user
from ..local_cluster import MONITORING
from ..operator.operator_proc import Cluster
from .test_real_pods import Load, chat, engine_metrics, first_token, poll, tunable_deployment

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "chunkpilot"
NS = "chunkpilot"  # the release's namespace
APP_NS = "team-a"  # where the InferenceDeployment lives
RELEASE = "cp"
NAME = "smol"
SERVED = "smollm2"
REPO = "docker.io/chunkpilot"  # the chart's image.repository: <repo>/operator:<tag>, <repo>/tuner:<tag>
TIMINGS: dict[str, float] = {}


class Admin:
    """The admin's tools pointed at the cluster: helm (the chart's own commands) and an API client."""

    def __init__(self, cluster, work: Path, helm: str) -> None:
        self.cluster, self.work, self.helm_bin = cluster, work, helm
        self.k = Cluster(cluster.api())
        self.env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "HELM_CACHE_HOME": str(work / "helm-cache"),
                    "HELM_CONFIG_HOME": str(work / "helm-config"), "HELM_DATA_HOME": str(work / "helm-data")}

    def helm(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        res = subprocess.run([self.helm_bin, *args], capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and res.returncode != 0:
            pytest.fail(f"helm {' '.join(args)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
                        f"\n{self.diagnose()}")
        return res

    def pods(self, namespace: str, selector: str) -> list:
        return [p for p in self.k.core.list_namespaced_pod(namespace, label_selector=selector).items
                if p.metadata.deletion_timestamp is None]

    def component(self, name: str, release: str = RELEASE) -> list:
        return self.pods(NS, f"app.kubernetes.io/instance={release},app.kubernetes.io/component={name}")

    def ready(self, pod) -> bool:
        return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])

    def engine_pod(self):
        live = self.pods(APP_NS, f"app.kubernetes.io/instance={NAME}")
        return live[0] if len(live) == 1 else None

    def prometheus(self, query: str) -> list[dict]:
        """A query to the Prometheus Operator's Prometheus, at its pod (the host is on the pod network)."""
        (pod,) = self.pods(MONITORING, "app.kubernetes.io/name=prometheus")
        url = f"http://{pod.status.pod_ip}:9090/api/v1/query?query={urllib.parse.quote(query)}"
        return json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]

    def diagnose(self) -> str:
        parts = [f"InferenceDeployment status: {self.k.status(APP_NS, NAME)}"]
        for ns in (NS, APP_NS, MONITORING):
            try:
                pods = self.k.core.list_namespaced_pod(ns).items
            except Exception:  # noqa: BLE001 - the namespace may be gone
                continue
            for p in pods:
                parts.append(f"pod {ns}/{p.metadata.name}: {p.status.phase} "
                             f"{[(c.name, c.ready, c.restart_count, c.state) for c in p.status.container_statuses or []]}")
                parts.append(f"events: {self.k.events(ns, p.metadata.name)}")
                parts.append(self.cluster.pod_log(ns, p.metadata.name, 2500))
        try:  # what Prometheus makes of each target (a refused scrape says so here)
            (prom,) = self.pods(MONITORING, "app.kubernetes.io/name=prometheus")
            targets = json.loads(urllib.request.urlopen(f"http://{prom.status.pod_ip}:9090/api/v1/targets",
                                                        timeout=5).read())["data"]["activeTargets"]
            parts.append(f"Prometheus targets: {[(t['scrapeUrl'], t['health'], t['lastError']) for t in targets]}")
        except Exception as e:  # noqa: BLE001 - diagnostics only
            parts.append(f"Prometheus targets unreadable: {e!r}")
        for name in ("kubelet", "prometheus-operator", "coredns", "kube-router"):
            parts.append(f"--- {name}\n{self.cluster.log(name, 1500)}")
        return "\n".join(parts)[-30000:]


@pytest.fixture(scope="module")
def admin(chart_cluster, tmp_path_factory):
    from .conftest import helm_binary

    work = tmp_path_factory.mktemp("helm")
    a = Admin(chart_cluster, work, helm_binary())
    a.k.namespace(APP_NS)
    model_dir = str(Path(os.environ.get("CHUNKPILOT_CACHE", Path.home() / ".cache" / "chunkpilot"))
                    / "models" / "SmolLM2-135M-Instruct")
    a.model_dir = model_dir
    # The images under the names the chart builds from image.repository and image.tag, as `docker push` of one
    # tag would make them (scripts/image.sh names each by its own content hash).
    for part in ("operator", "tuner"):
        for tag in ("e2e-1", "e2e-2"):
            chart_cluster.ctr("images", "tag", "--force", chart_cluster.image_names[part], f"{REPO}/{part}:{tag}")
    a.values = work / "values.yaml"
    a.values.write_text(yaml.safe_dump({
        "image": {"repository": REPO, "tag": "e2e-1"},
        "operator": {"engineImage": chart_cluster.image_names["engine"],
                     "policy": {"allowedHostPaths": [model_dir]},
                     "engineDefaultRequests": {"cpu": "500m", "memory": "2Gi"}},
        "tuner": {"minRequests": 3},
        "monitoring": {"serviceMonitor": {"enabled": True, "interval": "5s"}, "prometheusRule": {"enabled": True}},
    }))
    try:
        yield a
    finally:
        if getattr(a, "watch", None) is not None:
            a.watch.stopping.set()
            a.watch.join(timeout=10)
        if os.environ.get("CHUNKPILOT_HELM_TIMINGS"):
            Path(os.environ["CHUNKPILOT_HELM_TIMINGS"]).write_text(json.dumps(TIMINGS, indent=2))


def release_objects(a: Admin, release: str) -> list[str]:
    """Every object of the kinds the chart makes that carries the release's instance label, cluster-wide."""
    import kubernetes

    sel = f"app.kubernetes.io/instance={release}"
    rbac = kubernetes.client.RbacAuthorizationV1Api(a.k.api)
    apps = kubernetes.client.AppsV1Api(a.k.api)
    batch = kubernetes.client.BatchV1Api(a.k.api)
    found = []
    for kind, items in (("ClusterRole", rbac.list_cluster_role(label_selector=sel).items),
                        ("ClusterRoleBinding", rbac.list_cluster_role_binding(label_selector=sel).items),
                        ("Role", rbac.list_role_for_all_namespaces(label_selector=sel).items),
                        ("RoleBinding", rbac.list_role_binding_for_all_namespaces(label_selector=sel).items),
                        ("ServiceAccount", a.k.core.list_service_account_for_all_namespaces(label_selector=sel).items),
                        ("Deployment", apps.list_deployment_for_all_namespaces(label_selector=sel).items),
                        ("Job", batch.list_job_for_all_namespaces(label_selector=sel).items),
                        ("Service", a.k.core.list_service_for_all_namespaces(label_selector=sel).items),
                        ("ConfigMap", a.k.core.list_config_map_for_all_namespaces(label_selector=sel).items),
                        ("PersistentVolumeClaim",
                         a.k.core.list_persistent_volume_claim_for_all_namespaces(label_selector=sel).items)):
        found += [f"{kind}/{o.metadata.name}" for o in items]
    return sorted(found)


def test_helm_install_runs_operator_and_tuner_restricted_and_ready(admin):
    t0 = time.monotonic()
    admin.helm("install", RELEASE, str(CHART), "-n", NS, "--create-namespace", "-f", str(admin.values),
               "--wait", "--timeout", "5m")
    TIMINGS["install_to_ready_s"] = time.monotonic() - t0
    admin.install_started = t0
    print(f"\nhelm install --wait: operator and tuner Ready in {TIMINGS['install_to_ready_s']:.1f} s")
    status = json.loads(admin.helm("status", RELEASE, "-n", NS, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    for component in ("operator", "tuner"):
        (pod,) = admin.component(component)
        assert admin.ready(pod), pod.status
        (cs,) = pod.status.container_statuses
        assert cs.restart_count == 0
        uids, mounts = admin.cluster.container_mounts(cs.container_id)
        assert uids == {"10001"} and "ro" in mounts["/"], (component, uids, mounts["/"])
    (pvc,) = admin.k.core.list_namespaced_persistent_volume_claim(NS).items
    assert pvc.status.phase == "Bound" and pvc.spec.storage_class_name == "local"
    admin.study_volume = pvc.spec.volume_name
    # the notes' sample is the repository's, and the API server takes it as it is (the model itself comes from
    # the Hub, which nothing reaches here: server-side dry-run)
    notes = admin.helm("get", "notes", RELEASE, "-n", NS).stdout
    manifest = notes.split("<<'YAML'\n", 1)[1].split("  YAML\n", 1)[0]
    sample_doc = yaml.safe_load((ROOT / "crds" / "samples" / "smollm2-hf.yaml").read_text())
    assert yaml.safe_load(textwrap.dedent(manifest)) == sample_doc
    admin.k.custom.create_namespaced_custom_object(GROUP, VERSION, APP_NS, PLURAL, sample_doc, dry_run="All")


def test_helm_test_checks_the_api_the_policy_the_operator_and_prometheus(admin):
    """The test pod exits 0 only when every check it was given passed (a failed one keeps the pod, so that
    `helm test --logs` shows which); it was given all of them."""
    hooks = [d for d in yaml.safe_load_all(admin.helm("get", "hooks", RELEASE, "-n", NS).stdout) if d]
    (pod,) = [d for d in hooks if d["kind"] == "Pod" and d["metadata"]["annotations"]["helm.sh/hook"] == "test"]
    command = " ".join(pod["spec"]["containers"][0]["command"])
    assert "--admission-policy" in command and "--no-admission-policy" not in command
    assert f"--prometheus-url=http://prometheus-operated.{MONITORING}.svc:9090" in command
    assert "--operator-url=" in command
    res = admin.helm("test", RELEASE, "-n", NS, "--timeout", "3m")
    assert "Phase:          Succeeded" in res.stdout, res.stdout
    # and the same command fails, saying why, where the cluster is not as the chart says: a Prometheus nobody serves
    import sys

    res = subprocess.run([str(Path(sys.executable).parent / "chunkpilot"), "check-install", "-n", "default",
                          "--prometheus-url", "http://127.0.0.1:9", "--admission-policy"],
                         capture_output=True, text=True, env=admin.env, timeout=120)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "ok   crd:" in res.stdout and "ok   schema:" in res.stdout, res.stdout
    assert "ok   admission-policy:" in res.stdout and "is not allowed" in res.stdout
    assert "FAIL prometheus: http://127.0.0.1:9/api/v1/status/buildinfo" in res.stdout, res.stdout


def test_an_inference_deployment_is_scraped_through_its_service_monitor_and_served(admin):
    # a window holds at least two of the operator's ServiceMonitor scrapes (every 15 s)
    body = tunable_deployment(NAME, APP_NS, admin.model_dir, window=30, warmup=5, service_monitor=True)
    t0 = time.monotonic()
    admin.k.create(body)
    poll(lambda: (p := admin.engine_pod()) and admin.ready(p), 300, "the engine pod Ready", admin.diagnose)
    url = f"http://{admin.k.core.read_namespaced_service(NAME, APP_NS).spec.cluster_ip}:8000/v1"
    admin.url = url

    poll(lambda: first_token(url), 60, "a streamed token through the Service", admin.diagnose, interval=1)
    TIMINGS["apply_to_first_token_s"] = time.monotonic() - t0
    TIMINGS["install_to_first_token_s"] = time.monotonic() - admin.install_started
    sm = admin.k.custom.get_namespaced_custom_object("monitoring.coreos.com", "v1", APP_NS, "servicemonitors", NAME)
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # the Prometheus Operator writes the new scrape config into a Secret at once; Prometheus sees it when the kubelet
    # next syncs the pod's volumes (syncFrequency 1 m, jittered, kept at its default here), then reloads and scrapes:
    # two minutes is that path's usual worst case, and a busy node has taken longer
    poll(lambda: [r["value"][1] for r in admin.prometheus(f'up{{namespace="{APP_NS}",service="{NAME}"}}')] == ["1"],
         240, "the engine scraped through its ServiceMonitor", admin.diagnose, interval=2)
    # the tuner's own series keep the namespace of the deployment they describe (honorLabels), not the tuner's
    series = poll(lambda: admin.prometheus(f'{{__name__=~"chunkpilot:tuner_.*",deployment="{NAME}"}}'), 120,
                  "the tuner's metrics scraped", admin.diagnose, interval=2)
    assert {s["metric"].get("namespace") for s in series} == {APP_NS}, series[:2]
    assert not any("exported_namespace" in s["metric"] for s in series)
    print(f"\napply -> first token {TIMINGS['apply_to_first_token_s']:.1f} s; helm install -> first token "
          f"{TIMINGS['install_to_first_token_s']:.1f} s")


def test_the_tuner_pod_retunes_the_engine_without_a_restart(admin):
    pod = admin.engine_pod()
    uid, ip = pod.metadata.uid, pod.status.pod_ip
    first = int(engine_metrics(ip)[m.SCHEDULER_GENERATION])
    with Load(admin.url) as load:
        gen = poll(lambda: (g := int(engine_metrics(ip)[m.SCHEDULER_GENERATION])) > first and g, 480,
                   "the engine applying the tuner pod's knobs", admin.diagnose, interval=1)
        TIMINGS["install_to_tuned_knobs_s"] = time.monotonic() - admin.install_started
        # and the trial measured to its end, so that the study on the volume has something to resume
        poll(lambda: (admin.k.status(APP_NS, NAME).get("tuning") or {}).get("trial", 0) >= 1, 240,
             "the tuner completing a trial", admin.diagnose, interval=2)
    errors = load.errors
    st = admin.k.status(APP_NS, NAME)
    assert st["scheduler"]["source"] == "tuner" and st["scheduler"]["generation"] >= gen
    pod = admin.engine_pod()
    assert pod.metadata.uid == uid and pod.status.container_statuses[0].restart_count == 0
    assert not errors, errors[:3]
    print(f"\nhelm install -> first tuned knobs applied {TIMINGS['install_to_tuned_knobs_s']:.1f} s "
          f"(generation {first} -> {gen})")
    # No request of the chart's ServiceAccounts was refused: the chart's RBAC covers what the pods do.
    for component in ("operator", "tuner"):
        user = f"system:serviceaccount:{NS}:{RELEASE}-chunkpilot-{component}"
        events = admin.cluster.audit(user=user)
        assert events, f"no request by {user} in the audit log"
        refused = [(e["verb"], e.get("objectRef"), e["responseStatus"].get("code")) for e in events
                   if e.get("responseStatus", {}).get("code") == 403]
        assert not refused, refused[:5]


class PodWatch(threading.Thread):
    """Samples the operator's pods every 0.2 s during an upgrade: how many were running at once."""

    def __init__(self, a: Admin) -> None:
        super().__init__(daemon=True)
        self.a, self.most, self.stopping = a, 0, threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stopping.wait(0.2):
            try:
                running = [p for p in self.a.component("operator")
                           if any(c.state.running for c in p.status.container_statuses or [])]
            except Exception:  # noqa: BLE001 - a transient API error: sample again
                continue
            with self.lock:
                self.most = max(self.most, len(running))


def test_helm_upgrade_to_a_new_operator_image_never_runs_two_operators(admin):
    engine_rs = {r.metadata.name for r in admin.k.apps.list_namespaced_replica_set(APP_NS).items}
    engine_uid = admin.engine_pod().metadata.uid
    watch = PodWatch(admin)
    watch.start()
    try:
        admin.helm("upgrade", RELEASE, str(CHART), "-n", NS, "-f", str(admin.values), "--set", "image.tag=e2e-2",
                   "--wait", "--timeout", "5m")
    finally:
        watch.stopping.set()
        watch.join(timeout=5)
    (pod,) = admin.component("operator")
    assert pod.spec.containers[0].image == f"{REPO}/operator:e2e-2" and admin.ready(pod)
    with watch.lock:
        assert watch.most == 1, f"{watch.most} operator pods ran at once"
    # the engines were not rolled: same ReplicaSet, same pod
    assert {r.metadata.name for r in admin.k.apps.list_namespaced_replica_set(APP_NS).items} == engine_rs
    assert admin.engine_pod().metadata.uid == engine_uid


def test_helm_rollback_returns_to_the_first_images(admin):
    admin.helm("rollback", RELEASE, "1", "-n", NS, "--wait", "--timeout", "5m")
    (pod,) = admin.component("operator")
    assert pod.spec.containers[0].image == f"{REPO}/operator:e2e-1"
    status = json.loads(admin.helm("status", RELEASE, "-n", NS, "-o", "json").stdout)
    assert status["version"] == 3 and status["info"]["status"] == "deployed"


PAUSED, RESUMED = "Pausing operations in favour of", "Resuming operations after the pause"


def peering_state(log: str) -> str:
    """What kopf last said about this replica's pause. With a peering name kopf's peering is mandatory, so a replica
    starts paused and says nothing until it finds itself the highest live priority ("Resuming ...") or, having resumed
    alone first, meets a higher one ("Pausing ...")."""
    last = max((log.rfind(PAUSED), "paused"), (log.rfind(RESUMED), "acting"))
    return last[1] if last[0] >= 0 else "paused"


def test_two_operator_replicas_one_acts_the_highest_priority(admin):
    """More than one replica: each pod records itself in the chart's peering object under its own name (POD_ID) with a
    priority of its own (with equal priorities kopf pauses them all); exactly the highest one acts, the other stands
    by, with the rights peering needs (no 403)."""
    mark = admin.cluster.audit_mark()
    admin.helm("upgrade", RELEASE, str(CHART), "-n", NS, "-f", str(admin.values), "--set", "operator.replicas=2",
               "--wait", "--timeout", "5m")
    pods = admin.component("operator")
    assert len(pods) == 2 and all(admin.ready(p) for p in pods)
    name = f"{RELEASE}-chunkpilot-operator"

    def priorities() -> dict[str, int]:
        obj = admin.k.custom.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", name)
        return {k: v["priority"] for k, v in (obj.get("status") or {}).items() if isinstance(v, dict)}
    found = poll(lambda: len(priorities()) == 2 and priorities(), 60, "both replicas in the peering object",
                 admin.diagnose)
    assert sorted(found) == sorted(p.metadata.name for p in pods), found
    assert len(set(found.values())) == 2 and min(found.values()) > 0, found
    leader = max(found, key=found.get)

    def states() -> dict[str, str]:
        return {p: peering_state(admin.cluster.pod_log(NS, p, 10**7)) for p in found}
    want = {p: "acting" if p == leader else "paused" for p in found}
    poll(lambda: states() == want, 90, f"only {leader}, the highest priority of {found}, acting",
         lambda: f"{states()}\n{admin.diagnose()}", interval=2)
    # the work kopf does not run itself (queued passes, resyncs, retries) asks the same object: open on the leader
    # only (peering_gate.py; a gate starts closed and logs when it opens)
    opened = f"peering: this replica (priority {found[leader]}) acts"
    poll(lambda: opened in admin.cluster.pod_log(NS, leader, 10**7), 30, "the leader's work queue opening",
         admin.diagnose, interval=2)
    (standby,) = [p for p in found if p != leader]
    assert "this replica" not in admin.cluster.pod_log(NS, standby, 10**7)
    user = f"system:serviceaccount:{NS}:{name}"
    refused = [e.get("objectRef") for e in admin.cluster.audit(user=user, since=mark)
               if e.get("responseStatus", {}).get("code") == 403]
    assert not refused, refused[:5]


def operator_health(admin: Admin) -> dict[str, dict]:
    """Each operator pod's liveness answer (kopf's /healthz with our work queue's probe), as the kubelet gets it."""
    out = {}
    for pod in admin.component("operator"):
        with urllib.request.urlopen(f"http://{pod.status.pod_ip}:8080/healthz", timeout=5) as r:
            out[pod.metadata.name] = json.loads(r.read())
    return out


def test_two_operator_replicas_outlive_an_api_outage_and_push_the_next_change(admin):
    """The API server stopped for 30 s (connections refused: what a restarting control-plane node looks like to
    its clients) under the chart's two operator replicas. Before, the peering gate's read let urllib3's
    connection errors out and ended the worker thread that asked, one per 5 s of outage, then the clock thread:
    the operator looked healthy and never passed again (30 s would have ended about six of the sixteen; the
    test once waited 90 s, for all of them, past the node-monitor grace period: the node controller then marked
    the node not ready, and the recovery took as long again). Then a spec change is observed and pushed to the engine within 30 s, and every
    queue thread of both replicas is alive."""
    pods = admin.component("operator")
    assert len(pods) == 2, "runs after the two-replica test"
    before = admin.k.status(APP_NS, NAME)["knobs"]["generation"]
    cluster = admin.cluster
    cluster.kill_apiserver()
    try:
        time.sleep(30)  # the outage itself: nothing is asserted during it
    finally:  # the cluster is the module's: it comes back whatever happened here
        cluster.start_apiserver()
    back = datetime.datetime.now(datetime.UTC)

    def recovered() -> bool:
        """Kubernetes' own recovery first: the kubelet's heartbeat since the restart (until then the API holds the
        pods' conditions from before the outage, and the node controller may still mark them not ready), the
        engine pod and both operator pods ready."""
        import kubernetes

        (node,) = admin.k.core.list_node().items
        lease = kubernetes.client.CoordinationV1Api(admin.k.api).read_namespaced_lease(node.metadata.name,
                                                                                       "kube-node-lease")
        ready = next(c for c in node.status.conditions if c.type == "Ready")
        operators = admin.component("operator")
        return (ready.status == "True" and lease.spec.renew_time > back and admin.engine_pod() is not None
                and admin.ready(admin.engine_pod()) and len(operators) == 2 and all(admin.ready(p) for p in operators))
    poll(recovered, 180, "the node, the engine and both operator pods ready after the outage", admin.diagnose)
    t0 = time.monotonic()
    admin.k.patch(NAME, {"spec": {"tuning": {"mode": "off"}, "scheduler": {"tokenBudget": 200, "maxChunk": 40}}},
                  APP_NS)

    def pushed() -> bool:
        k = admin.k.status(APP_NS, NAME).get("knobs") or {}
        return (k.get("tokenBudget") == 200 and k.get("generation", 0) > before and k.get("appliedReplicas") == 1
                and [(p["tokenBudget"], p["generation"]) for p in k.get("pods", [])] == [(200, k["generation"])])
    poll(pushed, 30, "the change made after the outage pushed to the engine pod", admin.diagnose, interval=0.5)
    TIMINGS["after_api_outage_change_to_pushed_s"] = time.monotonic() - t0
    health = operator_health(admin)
    assert all(h["reconciler"]["threads"] == h["reconciler"]["of"] and h["reconciler"]["restarts"] == 0
               for h in health.values()), health
    admin.k.patch(NAME, {"spec": {"tuning": {"mode": "auto"}}}, APP_NS)  # as the later tests expect it


def new_namespace(admin: Admin, name: str) -> str:
    """A namespace whose default ServiceAccount exists (the controller manager makes it; pods are refused before)."""
    admin.k.namespace(name)
    # 90 s: the controller manager's service-account controller is one of many on a node the other test worker
    # loads; once, 30 s passed before it got to a new namespace
    poll(lambda: admin.k.core.list_namespaced_service_account(name).items, 90, f"the default account of {name}",
         admin.diagnose)
    return name


def reaches(admin: Admin, *probes: tuple[str, str, int]) -> list[bool]:
    """For each (namespace, ip, port): whether a new pod in that namespace opens a TCP connection to ip:port within
    8 s of trying, all probes at once: a client as a policy sees one (the host's own connections to pods are always
    admitted by the enforcer). A probe tries again for a while because the enforcer adds a new pod's address to
    the policies' sets only once the pod has one, which can be after its first connection; a refusal is answered at
    once (REJECT)."""
    import uuid

    pods = []
    for namespace, ip, port in probes:
        name = f"probe-{uuid.uuid4().hex[:8]}"
        code = (f"import socket, sys, time\nend = time.monotonic() + 8\nwhile True:\n"
                f"    try:\n        socket.create_connection(({ip!r}, {port}), timeout=2).close()\n"
                f"        sys.exit(0)\n    except OSError:\n        if time.monotonic() > end:\n"
                f"            sys.exit(1)\n        time.sleep(0.5)\n")
        admin.k.core.create_namespaced_pod(namespace, {
            "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False, "containers": [{
                "name": "probe", "image": admin.cluster.image_names["tuner"], "command": ["python3", "-c", code],
                "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}}}]}})
        pods.append((namespace, name))

    def phases() -> list[str]:
        return [admin.k.core.read_namespaced_pod(name, ns).status.phase for ns, name in pods]
    try:
        done = poll(lambda: all(p in ("Succeeded", "Failed") for p in phases()) and phases(), 90,
                    f"the probe pods {pods} finishing", admin.diagnose)
        return [p == "Succeeded" for p in done]
    finally:
        for ns, name in pods:
            admin.k.core.delete_namespaced_pod(name, ns, grace_period_seconds=0)


def test_the_charts_network_policies_enforced_keep_every_path_the_chart_means(admin):
    """`networkPolicy.enabled=true` on a node that enforces it: the operator's knob push reaches the engine's admin
    port (before, its egress left out 8001 and every push timed out into the minute-long ConfigMap path), a pod in
    another namespace reaches neither engine port, a pod beside the engine reaches the API port and not the admin
    one, Prometheus still scrapes the engine, and the tuner still reads Prometheus."""
    mark = admin.cluster.audit_mark()
    admin.helm("upgrade", RELEASE, str(CHART), "-n", NS, "-f", str(admin.values), "--set", "networkPolicy.enabled=true",
               "--set", f"networkPolicy.apiServerPorts={{{admin.cluster.port}}}", "--wait", "--timeout", "5m")
    net = __import__("kubernetes").client.NetworkingV1Api(admin.k.api)
    assert {p.metadata.name for p in net.list_namespaced_network_policy(NS).items} == {
        f"{RELEASE}-chunkpilot-operator", f"{RELEASE}-chunkpilot-tuner"}
    t_enabled = time.time()
    pod = poll(lambda: admin.engine_pod() and admin.ready(admin.engine_pod()) and admin.engine_pod(), 120,
               "the engine pod ready", admin.diagnose)
    ip = pod.status.pod_ip
    # the tuner reads Prometheus through its policy: a status written after the upgrade, not saying it cannot
    tuner = service_account_user("tuner")
    poll(lambda: any((e.get("objectRef") or {}).get("subresource") == "status" and e.get("verb") == "patch"
                     and (e.get("responseStatus") or {}).get("code", 200) < 300
                     for e in admin.cluster.audit(tuner, mark)), 180, "the tuner writing status", admin.diagnose)
    assert admin.k.cond(APP_NS, NAME, "Tuning").get("reason") != "MeasurementsUnavailable", admin.k.status(APP_NS, NAME)
    # Prometheus (a pod in `monitoring`) still scrapes the engine through the engine's policy
    poll(lambda: [r for r in admin.prometheus(f'timestamp(up{{namespace="{APP_NS}"}} == 1)')
                  if float(r["value"][1]) > t_enabled], 90, "a scrape of the engine after the upgrade",
         admin.diagnose, interval=2)
    # the operator's push reaches 8001: only a push's answer acknowledges knobs
    before = admin.k.status(APP_NS, NAME)["knobs"]["generation"]
    t0 = time.monotonic()
    admin.k.patch(NAME, {"spec": {"tuning": {"mode": "off"}, "scheduler": {"tokenBudget": 224, "maxChunk": 56}}},
                  APP_NS)

    def acknowledged() -> bool:
        k = admin.k.status(APP_NS, NAME).get("knobs") or {}
        return k.get("generation", 0) > before and [(p["tokenBudget"], p["generation"]) for p in k.get("pods", [])] \
            == [(224, k["generation"])]
    poll(acknowledged, 30, "the push acknowledged through the policies", admin.diagnose, interval=0.25)
    TIMINGS["network_policy_change_to_acknowledged_s"] = time.monotonic() - t0
    admin.k.patch(NAME, {"spec": {"tuning": {"mode": "auto"}}}, APP_NS)
    # who else reaches the engine: another namespace nothing; its own namespace the API port, not the admin port
    outsider = new_namespace(admin, "outsider")
    # The same pod's API port answers its own namespace and not another: the node's enforcer (kube-router's
    # firewall) is real, or the outsider would reach it too (a flat pod network routes every namespace alike)
    got = reaches(admin, (outsider, ip, 8001), (outsider, ip, 8000), (APP_NS, ip, 8000), (APP_NS, ip, 8001))
    assert got[2], f"a pod beside the engine cannot reach its API port: {got}\n{admin.diagnose()}"
    assert got == [False, False, True, False], (f"{got}: the node does not enforce NetworkPolicy (see kube-router's "
                                                f"log)\n{admin.cluster.log('kube-router', 3000)}")
    assert admin.k.delete_namespace(outsider)
    # (the next test uninstalls the release, policies and all)


def test_helm_uninstall_keeps_the_crds_the_study_and_the_running_engines(admin):
    import kubernetes

    admin.helm("uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "3m")
    left = release_objects(admin, RELEASE)
    assert left == [f"PersistentVolumeClaim/{RELEASE}-chunkpilot-tuner-study"], left
    ext = kubernetes.client.ApiextensionsV1Api(admin.k.api)
    assert ext.read_custom_resource_definition(f"{PLURAL}.{GROUP}")
    # Engines keep serving with the knobs they have; nothing reconciles or tunes them until a reinstall.
    assert admin.k.custom.get_namespaced_custom_object(GROUP, VERSION, APP_NS, PLURAL, NAME)
    assert any(c.choices and c.choices[0].delta.content for c in chat(admin.url, 4))


def test_a_reinstall_adopts_the_kept_study_and_resumes_it(admin):
    admin.helm("install", RELEASE, str(CHART), "-n", NS, "-f", str(admin.values), "--wait", "--timeout", "5m")
    (pvc,) = admin.k.core.list_namespaced_persistent_volume_claim(NS).items
    assert pvc.spec.volume_name == admin.study_volume  # the same volume, so the same study.db
    (pod,) = admin.component("tuner")
    # the trial the first install's tuner completed is in the study the new tuner pod opens
    poll(lambda: "resumed with" in admin.cluster.pod_log(NS, pod.metadata.name), 120,
         "the tuner resuming its study", admin.diagnose, interval=2)
    admin.helm("uninstall", RELEASE, "-n", NS, "--wait", "--timeout", "3m")

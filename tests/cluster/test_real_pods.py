"""The first day of a cluster admin, on a real node: the operator's Deployment runs the engine image under a real
kubelet (tests/local_cluster.py), and the tuner retunes it through the kubelet's ConfigMap volume sync.

One InferenceDeployment goes through its life in order: applied (scheduled, started on /ready, answering through
its Service), tuned (the tuner, as the chart's ServiceAccount, reads the pod through a real Prometheus that finds it
by Kubernetes service discovery; the knobs reach the running container without a restart), and deleted (in-flight
streams drain within the grace period). The operator and the tuner run as the chart's ServiceAccounts.

Measured here (printed, and written to $CHUNKPILOT_CLUSTER_TIMINGS for bench/local_cluster.py): seconds from apply
to the first token, and from a knob change in the ConfigMap to the engine applying it.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from chunkpilot.api.types import GROUP, PLURAL, VERSION
from chunkpilot.contract import metric_names as m
from chunkpilot.lab.child_process import stop_process
from chunkpilot.lab.prometheus_server import PrometheusServer

from ..conftest import install_chart_accounts, service_account_user
from ..operator.operator_proc import Cluster, operator, sample, tuner

pytestmark = pytest.mark.cluster
NS = "first-day"
NAME = "smol"
SERVED = "smollm2"
TIMINGS: dict[str, float] = {}


def poll(fn, timeout: float, what: str, diagnose=lambda: "", interval: float = 0.5):
    """fn() until it returns something truthy; fails with `what` and diagnostics after `timeout` seconds.
    API errors while polling count as not yet (the object may not exist yet)."""
    import kubernetes

    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            got = fn()
            if got:
                return got
        except (kubernetes.client.ApiException, OSError) as e:
            last = e
        time.sleep(interval)
    pytest.fail(f"{what} not within {timeout:.0f}s (last error: {last})\n{diagnose()}")


def engine_metrics(pod_ip: str) -> dict[str, float]:
    """The engine's own /metrics, read from the pod's address (as Prometheus does): name{labels} -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{pod_ip}:8000/metrics", timeout=5).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = s.value
    return out


class GenerationWatch(threading.Thread):
    """Notes when each knobs generation first shows in status.scheduler (the tuner's write), in the ConfigMap (the
    operator's durable copy), in status.knobs as every pod's acknowledgement (the operator's push answered) and in
    the engine's /metrics (applied), polling all four every 0.05 s. Readers go through `first_seen`, under the
    lock."""

    def __init__(self, stack: Stack, pod_ip: str) -> None:
        super().__init__(daemon=True)
        self.stack, self.pod_ip = stack, pod_ip
        self.seen: dict[str, dict[int, float]] = {"status": {}, "configmap": {}, "ack": {}, "engine": {}}
        self.lock = threading.Lock()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.05):
            for where, read in (("status", lambda: self.stack.k.status(NS, NAME)["scheduler"]["generation"]),
                                ("configmap", lambda: self.stack.k.knobs(NS, NAME)["generation"]),
                                ("ack", lambda: min(p["generation"] for p in self.stack.k.status(NS, NAME)["knobs"]["pods"])),
                                ("engine", lambda: engine_metrics(self.pod_ip)[m.SCHEDULER_GENERATION])):
                before = time.monotonic()
                try:
                    gen = int(read())
                except Exception:  # noqa: BLE001 - not there yet, or the pod going away: try again
                    continue
                with self.lock:  # seen somewhere between sending the read and its answer: take the middle
                    self.seen[where].setdefault(gen, (before + time.monotonic()) / 2)

    def first_seen(self, where: str, gen: int) -> float | None:
        with self.lock:
            return self.seen[where].get(gen)

    def generations(self, where: str) -> list[int]:
        with self.lock:
            return sorted(self.seen[where])


class Stack:
    """The cluster, the chart's controllers, Prometheus and the user's view of one InferenceDeployment."""

    def __init__(self, cluster, k: Cluster, workdir: Path) -> None:
        self.cluster, self.k, self.workdir = cluster, k, workdir
        self.procs: list = []

    def pod(self):
        pods = self.k.core.list_namespaced_pod(NS, label_selector=f"app.kubernetes.io/instance={NAME}").items
        live = [p for p in pods if p.metadata.deletion_timestamp is None]
        return live[0] if len(live) == 1 else None

    def service_url(self) -> str:
        return f"http://{self.k.core.read_namespaced_service(NAME, NS).spec.cluster_ip}:8000/v1"

    def scraped(self) -> bool:
        """Prometheus found the pod by service discovery and its last scrape succeeded."""
        import urllib.parse

        q = urllib.parse.quote(f'up{{namespace="{NS}",service="{NAME}"}}')
        res = json.loads(urllib.request.urlopen(f"{self.prom.url}/api/v1/query?query={q}", timeout=5).read())
        return [r["value"][1] for r in res["data"]["result"]] == ["1"]

    def diagnose(self) -> str:
        pod = self.pod()
        parts = [f"pod: {pod.status if pod else None}", f"events: {self.k.events(NS, pod.metadata.name) if pod else ''}",
                 f"resource events: {self.k.events(NS, NAME)}", f"status: {self.k.status(NS, NAME)}"]
        if pod:
            parts.append(self.cluster.pod_log(NS, pod.metadata.name))
        for p in self.procs:
            parts.append(f"--- {p.log_path.name}\n{p.log(3000)}")
        parts.append(f"--- kubelet\n{self.cluster.log('kubelet', 3000)}")
        return "\n".join(parts)


def truncated_copy(model_dir: str, dest: str) -> str:
    """The model folder copied with its (first) weights file cut off a third of the way: it fails to load."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(model_dir, dest)
    weights = sorted(Path(dest).glob("*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    return dest


@pytest.fixture(scope="module")
def stack(local_cluster, k8s_prometheus, tmp_path_factory):
    import kubernetes

    work = tmp_path_factory.mktemp("first-day")
    accounts = install_chart_accounts(local_cluster, work)
    k = Cluster(local_cluster.api())
    k.namespace(NS)
    prom = PrometheusServer(work / "prom", [], scrape_interval="2s", binary=k8s_prometheus,
                            scrape_configs=[prometheus_discovery(local_cluster, k, work)]).start()
    model_dir = str(Path(os.environ.get("CHUNKPILOT_CACHE", Path.home() / ".cache" / "chunkpilot"))
                    / "models" / "SmolLM2-135M-Instruct")
    s = Stack(local_cluster, k, work)
    s.prom = prom
    s.model_dir = model_dir
    # beside it (the engine's user can reach it there), a copy whose weights file is cut off: a model that fails to
    # load, for test_a_model_that_fails_to_load_is_named_in_the_status
    s.broken_model_dir = truncated_copy(model_dir, model_dir + "-truncated")
    # and one the engine's user may not read (root's, mode 0700: the config is there, the engine cannot see it)
    s.unreadable_model_dir = model_dir + "-unreadable"
    shutil.rmtree(s.unreadable_model_dir, ignore_errors=True)
    os.makedirs(s.unreadable_model_dir)
    shutil.copy(Path(model_dir) / "config.json", s.unreadable_model_dir)
    os.chmod(s.unreadable_model_dir, 0o700)
    op = operator(accounts["operator"], work, "--engine-image", local_cluster.engine_image,
                  "--allowed-host-path", model_dir, "--allowed-host-path", s.broken_model_dir,
                  "--allowed-host-path", s.unreadable_model_dir)
    tn = tuner(accounts["tuner"], work, "--min-requests", "3", "--apply-timeout", "30", prometheus_url=prom.url)
    s.procs = [op, tn]
    try:
        for p in s.procs:
            p.start()
        time.sleep(2)
        for p in s.procs:
            assert p.alive(), p.log()
        yield s
    finally:
        if getattr(s, "watch", None) is not None:
            s.watch.stopping.set()
            s.watch.join(timeout=10)
        for p in s.procs:
            p.stop()
        prom.stop()
        shutil.rmtree(s.broken_model_dir, ignore_errors=True)
        shutil.rmtree(s.unreadable_model_dir, ignore_errors=True)
        try:
            k.delete_namespace(NS, timeout=90)
        except kubernetes.client.ApiException:
            pass
        if os.environ.get("CHUNKPILOT_CLUSTER_TIMINGS"):
            Path(os.environ["CHUNKPILOT_CLUSTER_TIMINGS"]).write_text(json.dumps(TIMINGS, indent=2))


def prometheus_discovery(cluster, k: Cluster, work: Path) -> dict:
    """A scrape job that finds the engines the way a plain Prometheus in the cluster would: Kubernetes service
    discovery of EndpointSlices (as its own ServiceAccount, with read-only RBAC), keeping the engine Services'
    `metrics` port, labelled with namespace, service and pod (the labels the tuner's default selector uses, the
    same a ServiceMonitor gives)."""
    import kubernetes

    k.namespace("monitoring")
    k.core.create_namespaced_service_account("monitoring", {"metadata": {"name": "prometheus"}})
    rbac = kubernetes.client.RbacAuthorizationV1Api(k.api)
    rbac.create_cluster_role({"metadata": {"name": "prometheus"}, "rules": [
        {"apiGroups": [""], "resources": ["services", "endpoints", "pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]})
    rbac.create_cluster_role_binding({"metadata": {"name": "prometheus"},
                                      "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                                  "name": "prometheus"},
                                      "subjects": [{"kind": "ServiceAccount", "name": "prometheus",
                                                    "namespace": "monitoring"}]})
    token = k.core.create_namespaced_service_account_token(
        "prometheus", "monitoring", {"spec": {"expirationSeconds": 24 * 3600}}).status.token
    (work / "prometheus.token").write_text(token)
    return {
        "job_name": "chunkpilot-engines",
        "kubernetes_sd_configs": [{"role": "endpointslice", "api_server": cluster.url,
                                   "authorization": {"credentials_file": str(work / "prometheus.token")},
                                   "tls_config": {"ca_file": str(cluster.ca_file)},
                                   "namespaces": {"names": [NS]}}],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_service_label_app_kubernetes_io_name",
                               "__meta_kubernetes_endpointslice_port_name"],
             "regex": "chunkpilot-engine;metrics", "action": "keep"},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}],
    }


def chat(url: str, max_tokens: int, **extra):
    """A streamed chat completion with the official client; returns the stream."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Tell me a story."}],
                                          max_tokens=max_tokens, temperature=0, stream=True, extra_body=extra)


class Load:
    """Streamed chat completions through the Service, `streams` at a time, for as long as the `with` block runs;
    API errors and streams that end without a finish_reason are collected in `errors` (the caller fails on them),
    under the GIL's list.append; `served` counts the others (read after the block: the threads have ended)."""

    def __init__(self, url: str, streams: int = 3) -> None:
        self.url, self.errors, self.stop, self.finished = url, [], threading.Event(), []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]

    def _run(self) -> None:
        import openai

        while not self.stop.is_set():
            try:
                finish = None
                for c in chat(self.url, 16):
                    if c.choices and c.choices[0].finish_reason:
                        finish = c.choices[0].finish_reason
                if finish is None:  # a stream that just stopped is a failure the client cannot tell from success
                    self.errors.append("the stream ended without a finish_reason (a bare EOF)")
                else:
                    self.finished.append(finish)
            except openai.APIError as e:
                self.errors.append(str(e))
                time.sleep(0.5)

    @property
    def served(self) -> int:
        return len(self.finished)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)


def tunable_deployment(name: str, namespace: str, model_dir: str, *, window: int, warmup: int,
                       service_monitor: bool) -> dict:
    """SmolLM2 from the node's cache on one CPU pod, auto-tuned with short windows."""
    return sample(name, namespace, replicas=1, engine__resources={"gpus": 0}, engine__maxNumSeqs=8,
                  model__source=f"hostpath://{model_dir}", model__servedName=SERVED,
                  scheduler__tokenBudget=64, scheduler__maxChunk=32,
                  slo={"ttft": {"percentile": 0.99, "thresholdSeconds": 10.0},
                       "itl": {"percentile": 0.99, "thresholdSeconds": 2.0}},
                  # the start-up knobs 64/32 lie outside the bounds, so the tuner's first trial is a change, whatever
                  # it predicts best (inside them, the first pick may be the running knobs, and no change to see)
                  tuning={"mode": "auto", "windowSeconds": window, "warmupSeconds": warmup, "maxTrials": 4,
                          "bounds": {"tokenBudget": {"min": 96, "max": 256}, "maxChunk": {"min": 48, "max": 256}}},
                  monitoring={"serviceMonitor": service_monitor})


def first_token(url: str) -> bool:
    """A streamed token came back through the Service (False: refused, as when the pod is Ready before kube-proxy
    programmed its endpoint)."""
    import openai

    try:
        return any(c.choices and c.choices[0].delta.content for c in chat(url, 8))
    except openai.APIConnectionError:
        return False


def test_apply_runs_a_pod_that_answers_through_its_service(stack):
    """Apply -> scheduled -> image unpacked, model mounted from the node -> startup probe passes on /ready -> the
    Service routes a streamed chat completion to it. As the non-root user, on a read-only root filesystem."""
    body = tunable_deployment(NAME, NS, stack.model_dir, window=10, warmup=2, service_monitor=False)
    t0 = time.monotonic()
    stack.k.create(body)
    pod = poll(lambda: (p := stack.pod()) and p.spec.node_name and p, 60, "the pod scheduled", stack.diagnose)
    TIMINGS["apply_to_scheduled_s"] = time.monotonic() - t0
    ready = poll(lambda: any(c.type == "Ready" and c.status == "True" for c in stack.pod().status.conditions or []),
                 300, "the pod Ready (startup probe on /ready)", stack.diagnose)
    assert ready
    TIMINGS["apply_to_ready_s"] = time.monotonic() - t0
    url = stack.service_url()

    poll(lambda: first_token(url), 60, "a streamed token through the Service", stack.diagnose, interval=1)
    TIMINGS["apply_to_first_token_s"] = time.monotonic() - t0
    print(f"\napply -> scheduled {TIMINGS['apply_to_scheduled_s']:.1f} s, -> Ready "
          f"{TIMINGS['apply_to_ready_s']:.1f} s, -> first token through the Service "
          f"{TIMINGS['apply_to_first_token_s']:.1f} s")
    text = "".join(c.choices[0].delta.content or "" for c in chat(url, 12) if c.choices)
    assert text.strip()
    # what `kubectl get infd` shows the admin: Ready from the operator, mirrored from the real Deployment status
    poll(lambda: stack.k.cond(NS, NAME, "Ready").get("status") == "True", 60, "the InferenceDeployment Ready",
         stack.diagnose)
    assert stack.k.status(NS, NAME).get("readyReplicas") == 1

    # What the kubelet made of the pod's security context, read off the running process itself.
    pod = stack.pod()
    assert pod.status.container_statuses[0].restart_count == 0
    uids, mounts = stack.cluster.container_mounts(pod.status.container_statuses[0].container_id)
    assert uids == {"10001"}, uids
    assert "ro" in mounts["/"], mounts["/"]  # readOnlyRootFilesystem
    assert "ro" in mounts["/etc/chunkpilot"]
    stack.pod_uid = pod.metadata.uid
    stack.watch = GenerationWatch(stack, pod.status.pod_ip)
    stack.watch.start()
    stack.first_generation = int(engine_metrics(pod.status.pod_ip)[m.SCHEDULER_GENERATION])


def test_the_tuner_retunes_the_running_pod_in_seconds_with_an_acknowledgement(stack):
    """Load through the Service; the tuner measures it through Prometheus and writes new knobs to status; the
    operator pushes them to the pod's admin port and records the pod's answer in status.knobs, which the tuner
    waits on; the ConfigMap follows as the durable copy. The same container throughout (no restart), and the
    engine's metrics carry the new generation."""
    pod = stack.pod()
    assert pod is not None and pod.metadata.uid == stack.pod_uid
    poll(stack.scraped, 60, "Prometheus finding and scraping the pod", stack.diagnose)
    first, watch = stack.first_generation, stack.watch
    with Load(stack.service_url()) as load:
        gen = poll(lambda: next((g for g in watch.generations("engine") if g > first), None), 480,
                   "the engine applying the tuner's knobs", stack.diagnose)
        poll(lambda: watch.first_seen("ack", gen), 30, "the operator recording the pod's acknowledgement",
             stack.diagnose)
    errors = load.errors
    written, synced, acked, applied = (watch.first_seen(w, gen) for w in ("status", "configmap", "ack", "engine"))
    assert None not in (written, synced, acked, applied), watch.seen
    TIMINGS["status_to_configmap_s"] = synced - written
    TIMINGS["write_to_engine_s"] = applied - written
    TIMINGS["write_to_ack_s"] = acked - written
    st = stack.k.status(NS, NAME)["scheduler"]
    knobs = stack.k.knobs(NS, NAME)
    print(f"\nknobs generation {first} -> {gen} ({knobs['token_budget']}/{knobs['max_chunk']}): tuner write -> "
          f"engine applied {TIMINGS['write_to_engine_s']:.1f} s (the operator's push), -> acknowledged in status "
          f"{TIMINGS['write_to_ack_s']:.1f} s, -> ConfigMap {TIMINGS['status_to_configmap_s']:.1f} s; "
          f"{len(errors)} request errors")
    assert st["source"] == "tuner" and st["generation"] >= gen
    # the engine applied what the ConfigMap says under that generation, not just some file
    metrics = engine_metrics(stack.pod().status.pod_ip)
    if metrics[m.SCHEDULER_GENERATION] == knobs["generation"]:
        assert (metrics[m.SCHEDULER_TOKEN_BUDGET], metrics[m.SCHEDULER_MAX_CHUNK]) == \
            (knobs["token_budget"], knobs["max_chunk"])
    assert metrics[m.SCHEDULER_GENERATION] >= gen
    pod = stack.pod()
    assert pod.metadata.uid == stack.pod_uid and pod.status.container_statuses[0].restart_count == 0
    assert not errors, errors[:3]


def test_a_restarted_engine_container_runs_the_current_knobs(stack):
    """The engine process killed (an OOM, a crash): the kubelet restarts the container in the same pod, from a
    ConfigMap volume that may hold an older copy than the knobs pushed since. The operator sees the new container
    (its start time voids the old acknowledgement) and pushes again: the pod runs the knobs status.knobs says."""
    pod = stack.pod()
    status = pod.status.container_statuses[0]
    stack.cluster.ctr("tasks", "kill", "-s", "SIGKILL", status.container_id.removeprefix("containerd://"))

    def restarted():
        p = stack.pod()
        c = p.status.container_statuses[0]
        return c.restart_count >= 1 and c.ready and p
    t0 = time.monotonic()
    pod = poll(restarted, 180, "the engine container restarted and ready", stack.diagnose)
    started = pod.status.container_statuses[0].state.running.started_at

    def runs_the_current_knobs():
        k = stack.k.status(NS, NAME)["knobs"]
        mine = [p for p in k.get("pods") or [] if p["pod"] == pod.metadata.name]
        metrics = engine_metrics(pod.status.pod_ip)
        return (mine and mine[0].get("started") and
                (metrics[m.SCHEDULER_TOKEN_BUDGET], metrics[m.SCHEDULER_MAX_CHUNK], metrics[m.SCHEDULER_GENERATION])
                == (k["tokenBudget"], k["maxChunk"], k["generation"]) and mine[0]["generation"] == k["generation"])
    poll(runs_the_current_knobs, 30, "the restarted container running the knobs in status.knobs", stack.diagnose)
    TIMINGS["container_kill_to_current_knobs_s"] = time.monotonic() - t0
    k = stack.k.status(NS, NAME)["knobs"]
    (entry,) = [p for p in k["pods"] if p["pod"] == pod.metadata.name]
    # acknowledged by the new container, not carried over from the old one
    assert datetime.datetime.fromisoformat(entry["started"].replace("Z", "+00:00")) == started
    assert started > status.state.running.started_at
    stack.pod_uid = pod.metadata.uid  # the same pod: only its container restarted


CONFIGMAP_EDITS = {
    "invalid_json": "{not json",  # a broken file
    "out_of_bounds": json.dumps({"token_budget": 10**7, "max_chunk": 10**7, "generation": 10**6}),  # engine refuses
    "undecided": json.dumps({"token_budget": 64, "max_chunk": 32, "generation": 10**6}),  # valid, nobody decided it
}


@pytest.mark.parametrize("kind", list(CONFIGMAP_EDITS))
def test_a_hand_edited_knobs_configmap_is_put_right_and_the_pod_keeps_the_decided_knobs(stack, kind):
    """Someone edits the knobs ConfigMap by hand: the operator's next pass (the tuner's status writes bring one
    every window; the resync every 5 minutes) finds the live data differing from its own and puts it back, before
    the kubelet's volume sync (about a minute) could hand the edit to a container that restarts; the running
    engine took its knobs by push and never read the edit; the edit's generation is adopted by nobody. (Had a
    container restarted from the edited file, a bad one keeps the start-up knobs and a valid one runs until the
    operator, seeing the new container, pushes the decided knobs: test_a_restarted_engine_container_runs_the_
    current_knobs and the engine's knobs-file tests.)"""
    edit = CONFIGMAP_EDITS[kind]
    t0 = time.monotonic()
    stack.k.core.patch_namespaced_config_map(f"{NAME}-knobs", NS, {"data": {"knobs.json": edit}})

    def decided() -> tuple:
        """status.knobs now: the tuner may decide new knobs during the test, and those are right too."""
        k = stack.k.status(NS, NAME)["knobs"]
        return k["tokenBudget"], k["maxChunk"], k["generation"]

    def put_back():
        data = stack.k.get("configmaps", NS, f"{NAME}-knobs")["data"]["knobs.json"]
        if data == edit:
            return False
        cm = json.loads(data)
        return (cm["token_budget"], cm["max_chunk"], cm["generation"]) == decided()
    poll(put_back, 330, "the operator putting the ConfigMap back", stack.diagnose, interval=0.2)
    TIMINGS[f"configmap_{kind}_to_put_back_s"] = time.monotonic() - t0
    print(f"\nknobs ConfigMap edited ({kind}) -> put back {TIMINGS[f'configmap_{kind}_to_put_back_s']:.1f} s")

    def runs_decided():
        metrics = engine_metrics(stack.pod().status.pod_ip)
        return (metrics[m.SCHEDULER_TOKEN_BUDGET], metrics[m.SCHEDULER_MAX_CHUNK],
                metrics[m.SCHEDULER_GENERATION]) == decided() and metrics
    metrics = poll(runs_decided, 30, "the pod running the decided knobs", stack.diagnose, interval=0.2)
    # the edit's knobs were adopted by nobody: not delivered, not acknowledged, not run
    st = stack.k.status(NS, NAME)
    assert 10**6 not in (st["knobs"]["generation"], st["scheduler"]["generation"], metrics[m.SCHEDULER_GENERATION])


def only_one_of_each_child(stack) -> None:
    """No orphaned or duplicated object: one of each child the operator makes for the resource."""
    sel = f"app.kubernetes.io/instance={NAME}"
    assert len(stack.k.apps.list_namespaced_deployment(NS, label_selector=sel).items) == 1
    assert len(stack.k.core.list_namespaced_service(NS, label_selector=sel).items) == 1
    assert len(stack.k.core.list_namespaced_config_map(NS, label_selector=sel).items) == 1
    assert len([p for p in stack.k.core.list_namespaced_pod(NS, label_selector=sel).items
                if p.metadata.deletion_timestamp is None]) == 1


def reconciled_after_change(stack, trials: int):
    """Make a spec change now (maxTrials: nothing restarts for it); returns a check that the operator observed it."""
    stack.k.patch(NAME, {"spec": {"tuning": {"maxTrials": trials}}}, NS)
    obj = stack.k.get("inferencedeployments", NS, NAME)
    return lambda: stack.k.get("inferencedeployments", NS, NAME)["status"].get("observedGeneration") == \
        obj["metadata"]["generation"]


def garbage_collector_collects(stack) -> None:
    """The cluster's own garbage collector is back after the control plane was: a child ConfigMap goes when its
    owner does. (Without this wait the next test's cascading delete took 30-40 s longer: the collector was still
    re-syncing its graph after the API server came back.)"""
    owner = stack.k.core.create_namespaced_config_map(NS, {"metadata": {"generateName": "gc-owner-"}})
    child = stack.k.core.create_namespaced_config_map(NS, {"metadata": {
        "generateName": "gc-child-", "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap",
                                                           "name": owner.metadata.name, "uid": owner.metadata.uid}]}})
    stack.k.core.delete_namespaced_config_map(owner.metadata.name, NS)
    poll(lambda: stack.k.get("configmaps", NS, child.metadata.name) is None, 180,
         "the garbage collector deleting a child whose owner went", stack.diagnose)


def node_not_ready_since(stack, since: datetime.datetime) -> bool:
    """Whether the node's Ready condition changed after `since` (marked not ready, and ready again)."""
    (node,) = stack.k.core.list_node().items
    ready = next(c for c in node.status.conditions if c.type == "Ready")
    return ready.last_transition_time >= since


def tuner_wrote_status_since(stack, mark: int):
    user = service_account_user("tuner")
    return lambda: any((e.get("objectRef") or {}).get("subresource") == "status" and
                       (e.get("objectRef") or {}).get("name") == NAME and e.get("verb") in ("patch", "update")
                       and (e.get("responseStatus") or {}).get("code", 200) < 300
                       for e in stack.cluster.audit(user, mark))


def test_controllers_prometheus_and_the_api_server_fail_while_streams_run_and_no_request_is_lost(stack):
    """Issue 37's game day for the parts off the data path, one fault at a time, with streamed requests running
    through the Service all along: the operator SIGKILLed and restarted; the tuner SIGKILLed and restarted;
    Prometheus stopped until the tuner holds, then back; the API server and etcd stopped for 30 s, then back
    (the controllers reconnect on their own, no restart). No client request fails; each part is back (the
    operator observes a spec change made after, the tuner writes status again, `Tuning` turns True); the knobs
    stay what the tuner decided; one of each child object."""
    op, tn = stack.procs
    gen_before = stack.k.status(NS, NAME)["scheduler"]["generation"]
    with Load(stack.service_url()) as load:
        # 1. the operator killed while it works: its restart is level-triggered from fresh reads
        op.stop(sig=signal.SIGKILL, grace=5)
        op.start()
        t0 = time.monotonic()
        poll(reconciled_after_change(stack, 5), 120, "the restarted operator reconciling a spec change", stack.diagnose)
        TIMINGS["operator_kill_to_reconciled_s"] = time.monotonic() - t0
        # 2. the tuner killed: the restarted one opens the same study and writes status again
        trials = stack.k.status(NS, NAME)["tuning"].get("trial", 0)
        tn.stop(sig=signal.SIGKILL, grace=5)
        mark = stack.cluster.audit_mark()
        tn.start()
        t0 = time.monotonic()
        poll(tuner_wrote_status_since(stack, mark), 120, "the restarted tuner writing status", stack.diagnose)
        TIMINGS["tuner_kill_to_status_s"] = time.monotonic() - t0
        assert stack.k.status(NS, NAME)["tuning"].get("trial", 0) >= trials  # no trial lost
        # 3. Prometheus gone: the tuner holds (nothing moves blind), and resumes when it is back
        stack.prom.stop()
        try:
            poll(lambda: stack.k.cond(NS, NAME, "Tuning").get("reason") == "MeasurementsUnavailable", 180,
                 "the tuner holding while Prometheus is down", stack.diagnose)
            held_at = stack.k.status(NS, NAME)["scheduler"]["generation"]
        finally:
            stack.prom.start()
        t0 = time.monotonic()
        poll(lambda: stack.k.cond(NS, NAME, "Tuning").get("status") == "True", 180,
             "the tuner measuring again after Prometheus is back", stack.diagnose)
        TIMINGS["prometheus_back_to_tuning_s"] = time.monotonic() - t0
        assert stack.k.status(NS, NAME)["scheduler"]["generation"] >= held_at
    TIMINGS["faults_requests_served"], TIMINGS["faults_requests_failed"] = load.served, len(load.errors)
    assert not load.errors, load.errors[:3]
    assert load.served > 0
    # 4. the control plane gone for 30 s: the engines serve on; both controllers reconnect by themselves
    cluster = stack.cluster
    with Load(stack.service_url()) as outage:
        since = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
        t_kill = time.monotonic()
        cluster.kill_apiserver()
        try:
            stop_process(cluster.procs.pop("etcd", None), grace=5)
            time.sleep(30)
        finally:  # the cluster is the session's: it comes back whatever happened here
            cluster.start_etcd()
            cluster.start_apiserver()
        t0 = time.monotonic()
        TIMINGS["apiserver_outage_s"] = t0 - t_kill
        mark = cluster.audit_mark()
        poll(reconciled_after_change(stack, 4), 180, "the operator reconciling after the outage", stack.diagnose)
        poll(tuner_wrote_status_since(stack, mark), 180, "the tuner writing status after the outage",
             stack.diagnose)
        TIMINGS["apiserver_back_to_both_controllers_s"] = time.monotonic() - t0
        assert op.alive() and tn.alive(), stack.diagnose()
        garbage_collector_collects(stack)
    # The kubelet's heartbeat stops with the API server for the outage plus the restart (about 20 s here): past the
    # node-monitor-grace-period (50 s) the node lifecycle controller marks the node not ready and Kubernetes takes
    # its pods out of the Service (seen in one run of three). Those failures are Kubernetes', and reported; with
    # the node ready throughout, none may fail.
    node_flapped = node_not_ready_since(stack, since)
    TIMINGS["outage_requests_served"], TIMINGS["outage_requests_failed"] = outage.served, len(outage.errors)
    print(f"\nfaults under load: {load.served} requests served, {len(load.errors)} failed; operator killed -> "
          f"reconciling {TIMINGS['operator_kill_to_reconciled_s']:.1f} s, tuner killed -> status "
          f"{TIMINGS['tuner_kill_to_status_s']:.1f} s, Prometheus back -> Tuning True "
          f"{TIMINGS['prometheus_back_to_tuning_s']:.1f} s; API server and etcd out "
          f"{TIMINGS['apiserver_outage_s']:.0f} s: {outage.served} requests served, {len(outage.errors)} failed"
          f"{' (the node was marked not ready meanwhile)' if node_flapped else ''}, back -> both controllers "
          f"{TIMINGS['apiserver_back_to_both_controllers_s']:.1f} s")
    if not node_flapped:
        assert not outage.errors, outage.errors[:3]
    # the knobs on the pod are the ones decided (by the tuner before, or since): never older, never undecided
    def runs_the_recorded_knobs():
        k = stack.k.status(NS, NAME)["knobs"]
        return engine_metrics(stack.pod().status.pod_ip)[m.SCHEDULER_GENERATION] == k["generation"] and k
    k = poll(runs_the_recorded_knobs, 60, "the pod running the knobs status.knobs records", stack.diagnose)
    assert k["generation"] >= gen_before
    only_one_of_each_child(stack)


def test_deleting_drains_in_flight_streams_with_an_error_event_not_a_bare_eof(stack):
    """Delete the InferenceDeployment: the pod gets preStop, then SIGTERM. A stream that can finish within the
    engine's grace period finishes; one that cannot is aborted with an error event the client reads (not a cut
    connection); the engine exits by itself within the termination grace period of the pod's deletion."""
    import openai

    from chunkpilot.operator.builders import TERMINATION_GRACE_SECONDS

    url = stack.service_url()
    outcome: dict[str, object] = {}

    def stream(key: str, max_tokens: int):
        try:
            n = 0
            for c in chat(url, max_tokens, ignore_eos=True):
                if c.choices and c.choices[0].delta.content:
                    n += 1
                    outcome.setdefault(f"{key}-first", time.monotonic())
                if c.choices and c.choices[0].finish_reason:
                    outcome[key] = c.choices[0].finish_reason
            outcome.setdefault(key, f"ended without finish_reason after {n} tokens")
        except openai.APIConnectionError as e:
            outcome[key] = f"connection error: {e!r}"
        except openai.APIError as e:
            outcome[key] = f"error event: {e.message}"
        except Exception as e:  # noqa: BLE001 - whatever ended the stream is the test's evidence, never a dead thread
            outcome[key] = f"{type(e).__name__}: {e}"

    def started() -> bool:
        ended_early = [k for k in ("long", "short") if k in outcome and f"{k}-first" not in outcome]
        if ended_early:  # a stream that ended before its first token will not start: say how, now
            pytest.fail(f"the {ended_early} stream ended before its first token: {outcome}\n{stack.diagnose()}")
        return "long-first" in outcome and "short-first" in outcome
    # The Service answers first (after the last test's control-plane outage the proxy's rules are re-listed): this
    # test is about the delete, so it starts from a pod that serves through its Service.
    poll(lambda: first_token(url), 120, "a token through the Service before the delete", stack.diagnose)
    short = threading.Thread(target=stream, args=("short", 40))
    long = threading.Thread(target=stream, args=("long", 1900))  # ~2 min at this machine's step time
    long.start()
    short.start()
    poll(started, 60, "both streams started", lambda: f"streams: {outcome}\n{stack.diagnose()}")
    pod = stack.pod()
    t0, deleted_at = time.monotonic(), datetime.datetime.now(datetime.timezone.utc)
    stack.k.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, NAME)
    short.join(TERMINATION_GRACE_SECONDS + 30)
    long.join(TERMINATION_GRACE_SECONDS + 30)
    # What the pod showed last before it went, to tell an engine that outlived its grace period (killed: exit code
    # 137, finished near the grace period) from a slow cleanup by the kubelet and the API server after it exited.
    # The grace period runs from the pod's own deletion, which Kubernetes' garbage collector makes after the
    # InferenceDeployment's (owner references, background cascade: Deployment, then ReplicaSet, then pod). Right after
    # the control-plane outage of the test before, that cascade took 40 s in one CI run: Kubernetes' time, reported,
    # not the engine's, which is judged from the pod's deletion.
    last: dict = {"containers": {}, "finished": {}, "log": "", "pod_deleted": None, "gone": None, "log_read": 0.0}

    def gone():
        seen = stack.k.get("pods", NS, pod.metadata.name)
        if seen is None:
            last["gone"] = datetime.datetime.now(datetime.timezone.utc)
            return True
        meta = seen["metadata"]
        if meta.get("deletionTimestamp") and last["pod_deleted"] is None:
            # deletionTimestamp is when the grace period ends: the deletion itself came that many seconds before
            ends = datetime.datetime.fromisoformat(meta["deletionTimestamp"].replace("Z", "+00:00"))
            last["pod_deleted"] = ends - datetime.timedelta(seconds=meta.get("deletionGracePeriodSeconds") or 0)
        newly_ended = False
        for cs in seen.get("status", {}).get("containerStatuses", []):
            if "terminated" in cs.get("state", {}):
                done = cs["state"]["terminated"]
                finished = datetime.datetime.fromisoformat(done["finishedAt"].replace("Z", "+00:00"))
                newly_ended |= cs["name"] not in last["finished"]
                last["finished"][cs["name"]] = finished
                last["containers"][cs["name"]] = (f"exit {done.get('exitCode')} ({done.get('reason')}) "
                                                  f"{(finished - deleted_at).total_seconds():.0f} s after the delete")
        # the log (evidence for a failure) when a container has just ended, else every 2 s: reading it takes longer
        # than the poll, and the terminated status may live only a second before the pod goes
        if newly_ended or time.monotonic() - last["log_read"] > 2:
            last["log"] = stack.cluster.pod_log(NS, pod.metadata.name, 1500) or last["log"]
            last["log_read"] = time.monotonic()
        return False
    poll(gone, TERMINATION_GRACE_SECONDS + 120, "the pod deleted", stack.diagnose, interval=0.25)
    TIMINGS["delete_to_pod_gone_s"] = time.monotonic() - t0
    cascade = max(0.0, (last["pod_deleted"] - deleted_at).total_seconds()) if last["pod_deleted"] else None
    if cascade is not None:
        TIMINGS["delete_to_pod_deletion_s"] = cascade
    print(f"\ndelete -> pod deleted by the garbage collector {cascade} s; -> pod gone "
          f"{TIMINGS['delete_to_pod_gone_s']:.1f} s; short stream: {outcome['short']}; "
          f"long stream: {outcome['long']}; containers: {last['containers']}")
    assert outcome["short"] == "length", outcome
    assert str(outcome["long"]).startswith("error event:") and "shutting down" in str(outcome["long"]), outcome
    # the engine left by itself (exit 0: drained, aborted, flushed), within the grace period of the pod's deletion;
    # deletionTimestamp and finishedAt have whole seconds, hence the 2 s
    assert last["pod_deleted"] is not None, last
    if "engine" in last["finished"]:
        engine_took = (last["finished"]["engine"] - last["pod_deleted"]).total_seconds()
        assert last["containers"]["engine"].startswith("exit 0 "), (last["containers"], last["log"])
        assert engine_took < TERMINATION_GRACE_SECONDS + 2, (engine_took, last["containers"], last["log"])
    else:  # the pod went between two reads (its terminated status lives a second or so): its removal is the bound
        removed = (last["gone"] - last["pod_deleted"]).total_seconds()
        assert removed < TERMINATION_GRACE_SECONDS + 10, (removed, last["log"])


def failing_engine(stack, name: str, model_dir: str, what: str, timing: str) -> tuple[dict, dict]:
    """Apply an InferenceDeployment whose engine cannot start, and wait for the Ready and Degraded conditions
    to name the engine's own last line (EngineFailing); (ready, degraded)."""
    body = sample(name, NS, replicas=1, engine__resources={"gpus": 0}, engine__maxNumSeqs=8,
                  model__source=f"hostpath://{model_dir}", model__servedName=name,
                  tuning={"mode": "off"}, monitoring={"serviceMonitor": False})
    t0 = time.monotonic()
    stack.k.create(body)

    def named():
        ready, degraded = stack.k.cond(NS, name, "Ready"), stack.k.cond(NS, name, "Degraded")
        return (degraded.get("reason") == "EngineFailing" and what in ready.get("message", "")
                and (ready, degraded))
    ready, degraded = poll(named, 240, f"{what!r} named in the status",
                           lambda: f"{stack.k.status(NS, name)}\n{stack.k.events(NS, name)}\n"
                                   f"{stack.cluster.log('kubelet', 2000)}")
    TIMINGS[timing] = time.monotonic() - t0
    print(f"\n{name}: the error in the status after {TIMINGS[timing]:.0f} s: {ready['message']}")
    assert ready["status"] == "False" and ready["message"].startswith(f"0/1 engine pods ready: pod {name}-")
    assert "container engine" in ready["message"]
    assert degraded["status"] == "True" and degraded["message"] in ready["message"]
    # the operator posts its Event after it wrote the status: the status may be read first
    poll(lambda: any(t == "Warning" and r == "EngineFailing" and what in m for t, r, m in stack.k.events(NS, name)),
         30, "the EngineFailing Event", lambda: "\n".join(map(str, stack.k.events(NS, name))))
    return ready, degraded


def test_an_unreadable_model_folder_is_named_in_the_status(stack):
    """The model folder exists but the engine's user (uid 10001) may not read it: the engine's command line refuses
    it (exit 2, a usage error that typer prints in a box) and the status names it by the box's content. Before,
    the status said "last exit 2: ╰───╯", the box's bottom edge."""
    name = "unreadable"
    try:
        ready, _ = failing_engine(stack, name, stack.unreadable_model_dir, "is not readable",
                                  "unreadable_model_to_status_s")
        assert ready["message"].endswith("last exit 2: Error: Invalid value for '--model' (env var: "
                                         "'CHUNKPILOT_MODEL'): path '/models' is not readable."), ready["message"]
    finally:
        stack.k.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)


def test_a_model_that_fails_to_load_is_named_in_the_status(stack):
    """A model whose weights file is truncated: the engine exits with the error as its last log line, the kubelet
    keeps it as the container's termination message (FallbackToLogsOnError), and the operator puts it into the
    Ready and Degraded conditions and a Warning Event, within about a minute of the apply (before, the status said
    "0/1 engine pods ready" for the start-up probe's 900 s)."""
    name = "broken"
    try:
        ready, _ = failing_engine(stack, name, stack.broken_model_dir, "model failed to load",
                                  "broken_model_to_status_s")
        # the engine's own last line: the folder as the container sees it (the host path is mounted at /models)
        assert ready["message"].endswith("model failed to load from /models: SafetensorError: Error while "
                                         "deserializing header: incomplete metadata, file not fully covered; exiting")
        assert "last exit 1" in ready["message"]
    finally:
        stack.k.custom.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)

"""Prefill/decode disaggregation on the real node (issue 53): an InferenceDeployment with `disaggregation.mode: on`
runs one prefill and one decode pod from the engine image under the kubelet; clients stream through the Service
(the decode pod), which sends each long prompt to the prefill pod found through its headless Service (CoreDNS) and
pulls the KV blocks over NIXL/UCX between the two pods; the answers equal the offline engine's, token for token.
Then, under load, the prefill pod is deleted as a rollout or a drain deletes it (its grace period), and its
replacement's engine process is killed while it computes a prompt: no request is lost, the decode pod finds the
replacement by the same Service name, and it prefills locally what the killed process failed, counting the
fallback.

The operator runs as the chart's ServiceAccount, as in test_real_pods.py; no tuner (tuning.mode off).
"""

from __future__ import annotations

import datetime
import threading
import time
import urllib.request
import uuid

import pytest

from chunkpilot.contract import metric_names as m
from chunkpilot.operator.builders import LLMD_ROLE_LABEL, ROLE_LABEL

from ..conftest import install_chart_accounts
from ..operator.operator_proc import Cluster, operator, sample
from .test_real_pods import poll

pytestmark = pytest.mark.cluster
NS = "disagg"
NAME = "split"
SERVED = "smollm2"
MAX_LEN = 512
THRESHOLD = 32  # uncached prompt tokens above which the decode pod asks the prefill pod (every prompt below is longer)
MAX_TOKENS = 8
# the pods' knobs (spec.scheduler) and the offline reference's: the same chunks, so the same floating-point sums
TOKEN_BUDGET, MAX_CHUNK, MAX_NUM_SEQS = 128, 64, 8
TOPICS = ["schedulers", "key-value caches", "prefix caching", "token budgets", "chunked prefill", "leases"]


def long_prompt(topic: str) -> str:
    """80 to 90 tokens: past the threshold, in two prefill chunks."""
    return (f"A field guide to {topic}. " + "Every engine step first gives each running sequence one token, then "
            "spends what is left of the budget on prompt chunks. " * 3 + f"In short, {topic} are")


def complete(url: str, topic: str) -> str:
    """A streamed greedy completion through `url` with the official client; the text, or an exception. Each under a
    salt of its own, so no prompt is ever in the decode pod's prefix cache: every one is longer than the threshold
    there and goes to the prefill pod (a prompt the decode pod cached would be prefilled there, correctly)."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    text, finish = "", None
    for chunk in client.completions.create(model=SERVED, prompt=long_prompt(topic), max_tokens=MAX_TOKENS,
                                           temperature=0.0, stream=True,
                                           extra_body={"cache_salt": uuid.uuid4().hex}):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    if finish is None:
        raise AssertionError(f"the stream for {topic!r} ended without a finish_reason (a bare EOF) after {text!r}")
    return text


def pod_metrics(pod_ip: str) -> dict[tuple[str, frozenset], float]:
    """An engine pod's /metrics, read from its address: (sample name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{pod_ip}:8000/metrics", timeout=5).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(pod_ip: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples that carry `labels` (0 when there is none yet)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in pod_metrics(pod_ip).items() if n == name and want <= ls)


class Split:
    """The node, the operator and the user's view of the disaggregated InferenceDeployment."""

    def __init__(self, cluster, k: Cluster, op) -> None:
        self.cluster, self.k, self.op = cluster, k, op

    def pods(self, role: str) -> list:
        """The role's pods that are not being deleted."""
        pods = self.k.core.list_namespaced_pod(NS, label_selector=f"app.kubernetes.io/instance={NAME},"
                                                                   f"{ROLE_LABEL}={role}").items
        return [p for p in pods if p.metadata.deletion_timestamp is None]

    def ready_pod(self, role: str, other_than: str | None = None):
        """The role's one pod, once it is Ready (and is not the pod `other_than`), else None."""
        pods = [p for p in self.pods(role) if p.metadata.uid != other_than]
        if len(pods) != 1 or not any(c.type == "Ready" and c.status == "True" for c in pods[0].status.conditions or []):
            return None
        return pods[0]

    def service_url(self) -> str:
        return f"http://{self.k.core.read_namespaced_service(NAME, NS).spec.cluster_ip}:8000/v1"

    def diagnose(self) -> str:
        parts = [f"status: {self.k.status(NS, NAME)}", f"resource events: {self.k.events(NS, NAME)}"]
        try:  # whom the prefill pods' headless Service names now (the decode pods resolve it every poll)
            import kubernetes

            slices = kubernetes.client.DiscoveryV1Api(self.k.core.api_client).list_namespaced_endpoint_slice(
                NS, label_selector=f"kubernetes.io/service-name={NAME}-prefill").items
            parts.append(f"{NAME}-prefill endpoints: " + ", ".join(
                f"{e.addresses} ready={e.conditions.ready}" for sl in slices for e in sl.endpoints or []))
        except Exception as e:  # noqa: BLE001 - diagnostics only
            parts.append(f"no endpoint slices: {e}")
        for p in self.k.core.list_namespaced_pod(NS).items:
            ready = [c.status for c in p.status.conditions or [] if c.type == "Ready"]
            parts.append(f"--- pod {p.metadata.name} {p.status.pod_ip} (deleting: "
                         f"{p.metadata.deletion_timestamp is not None}) {p.status.phase}, Ready {ready}, "
                         f"events {self.k.events(NS, p.metadata.name)}")
            try:
                parts.append("disaggregation metrics: " + ", ".join(
                    f"{n}{dict(ls)} {v}" for (n, ls), v in sorted(pod_metrics(p.status.pod_ip).items(), key=str)
                    if n.startswith((m.KV_TRANSFERS, m.KV_FALLBACKS, m.PREFILL_PEERS_READY,
                                     m.REMOTE_PREFILLS_SERVED, m.KV_LEASES_HELD, m.KV_CACHE_USAGE))))
            except (OSError, ValueError) as e:
                parts.append(f"no metrics: {e}")
            try:  # what the pod's resolver says the prefill pods are
                cid = p.status.container_statuses[0].container_id.removeprefix("containerd://")
                parts.append("resolves: " + self.cluster.ctr(
                    "tasks", "exec", "--exec-id", f"dns-{uuid.uuid4().hex[:8]}", cid, "python3", "-c",
                    f"import socket; print(sorted({{i[4][0] for i in socket.getaddrinfo('{NAME}-prefill.{NS}.svc', "
                    "8000)}))", timeout=30).strip())
            except Exception as e:  # noqa: BLE001 - diagnostics only
                parts.append(f"does not resolve: {e}")
            # the decode pod polls the prefill pods every 0.5 s: those lines would hide everything else
            log = "\n".join(line for line in self.cluster.pod_log(NS, p.metadata.name, 200_000).splitlines()
                            if "/kv/load" not in line)
            parts.append(log[-6000:])
        parts.append(f"--- operator\n{self.op.log(3000)}")
        return "\n".join(parts)


@pytest.fixture(scope="module")
def offline(smollm2_dir):
    """Each prompt's greedy output from the offline engine, colocated. Computed before the pods start rather than
    beside them: two pods loading the model on two cores slowed it from about 8 s to about 70."""
    from chunkpilot.engine import LLM, SamplingParams

    llm = LLM(smollm2_dir, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=MAX_NUM_SEQS,
              token_budget=TOKEN_BUDGET, max_chunk=MAX_CHUNK)
    try:
        return {t: llm.generate(long_prompt(t), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0].text
                for t in TOPICS}
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def split(local_cluster, smollm2_dir, offline, tmp_path_factory):
    """The operator, and the InferenceDeployment applied."""
    import kubernetes

    work = tmp_path_factory.mktemp("disagg")
    accounts = install_chart_accounts(local_cluster, work)
    k = Cluster(local_cluster.api())
    k.namespace(NS)
    op = operator(accounts["operator"], work, "--engine-image", local_cluster.engine_image,
                  "--allowed-host-path", smollm2_dir)
    s = Split(local_cluster, k, op)
    try:
        op.start()
        k.create(sample(NAME, NS, engine__resources={"gpus": 0}, engine__maxNumSeqs=MAX_NUM_SEQS,
                        model__source=f"hostpath://{smollm2_dir}", model__servedName=SERVED,
                        model__maxModelLen=MAX_LEN, model__dtype="float32",
                        scheduler__tokenBudget=TOKEN_BUDGET, scheduler__maxChunk=MAX_CHUNK,
                        tuning={"mode": "off"}, monitoring={"serviceMonitor": False},
                        disaggregation={"mode": "on", "threshold": THRESHOLD, "prefill": {"replicas": 1},
                                        "decode": {"replicas": 1}}))
        yield s
    finally:
        op.stop()
        # Not waited for: the node goes right after this module, and its teardown kills and removes every
        # container (LocalCluster.stop).
        try:
            k.core.delete_namespace(NS)
        except kubernetes.client.ApiException:
            pass


def peers_ready(pod_ip: str) -> bool:
    """The decode pod's last poll of the headless Service found a prefill pod with its KV layout."""
    return metric(pod_ip, m.PREFILL_PEERS_READY) >= 1


def test_mode_on_runs_a_prefill_and_a_decode_pod_and_streams_equal_colocated(split, offline):
    """Both pods Ready with their role labels; the decode pod finds the prefill pod by the headless Service's name;
    streams through the client Service equal the offline engine's output, and the prompts' blocks moved between
    the pods (NIXL over UCX's TCP transport)."""
    prefill = poll(lambda: split.ready_pod("prefill"), 300, "the prefill pod Ready", split.diagnose)
    decode = poll(lambda: split.ready_pod("decode"), 300, "the decode pod Ready", split.diagnose)
    created = datetime.datetime.fromisoformat(
        split.k.get("inferencedeployments", NS, NAME)["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    ready_s = max((next(c for c in p.status.conditions if c.type == "Ready").last_transition_time - created)
                  .total_seconds() for p in (prefill, decode))
    for pod, role in ((prefill, "prefill"), (decode, "decode")):
        assert pod.metadata.labels[ROLE_LABEL] == pod.metadata.labels[LLMD_ROLE_LABEL] == role
        assert pod.metadata.owner_references[0].name.startswith(f"{NAME}-{role}-")  # its role's ReplicaSet
    assert split.k.core.read_namespaced_service(f"{NAME}-prefill", NS).spec.cluster_ip == "None"
    assert split.k.core.read_namespaced_service(NAME, NS).spec.selector[ROLE_LABEL] == "decode"

    # nixl (a dependency of the engine extra, imported lazily by the transport) imports inside the image itself
    t0 = time.monotonic()
    cid = decode.status.container_statuses[0].container_id.removeprefix("containerd://")
    out = split.cluster.ctr("tasks", "exec", "--exec-id", f"nixl-{uuid.uuid4().hex[:8]}", cid, "python3", "-c",
                            "import importlib.metadata, nixl._api; print(importlib.metadata.version('nixl'))",
                            timeout=120)
    assert out.strip() == "1.5.1", out
    took = {"exec": time.monotonic() - t0}

    poll(lambda: peers_ready(decode.status.pod_ip), 60, "the decode pod finding the prefill pod", split.diagnose)
    took["peer found"] = time.monotonic() - t0 - took["exec"]
    url = split.service_url()
    import openai

    def first() -> str | None:
        try:  # kube-proxy may program the Service's endpoint a moment after the pod turned Ready
            return complete(url, TOPICS[0])
        except openai.APIConnectionError:
            return None
    assert poll(first, 60, "a stream through the Service", split.diagnose, interval=1) == offline[TOPICS[0]]
    took["first stream"] = time.monotonic() - t0 - sum(took.values())
    assert complete(url, TOPICS[1]) == offline[TOPICS[1]]
    # (a request may be prefilled here after all, correctly and without a fallback, when the decode pod's last poll
    # of the prefill pod went unanswered: a 1 s timeout that a busy two-core machine can miss)
    ok = metric(decode.status.pod_ip, m.KV_TRANSFERS, outcome="ok")
    assert ok >= 1, split.diagnose()
    assert metric(decode.status.pod_ip, m.KV_TRANSFER_BYTES) > 0
    assert metric(decode.status.pod_ip, m.KV_FALLBACKS) == 0, split.diagnose()
    assert metric(prefill.status.pod_ip, m.REMOTE_PREFILLS_SERVED) == ok
    poll(lambda: split.k.cond(NS, NAME, "Ready").get("status") == "True", 60, "the InferenceDeployment Ready",
         split.diagnose)
    roles = split.k.status(NS, NAME)["disaggregation"]
    assert roles["prefill"]["readyReplicas"] == roles["decode"]["readyReplicas"] == 1, roles
    took["the rest"] = time.monotonic() - t0 - sum(took.values())
    print(f"\nmode on: both pods Ready {ready_s:.0f} s after the apply; {ok:.0f} remote prefills, "
          f"{metric(decode.status.pod_ip, m.KV_TRANSFER_BYTES):.0f} bytes pulled; then "
          + ", ".join(f"{k} {v:.1f} s" for k, v in took.items()))


class Streams:
    """Completions through the Service, `n` at a time, cycling through TOPICS for as long as the `with` block runs;
    every answer that differs from the offline one and every error is collected (the caller fails on them)."""

    def __init__(self, url: str, offline: dict[str, str], n: int = 4) -> None:
        self.url, self.offline, self.stop = url, offline, threading.Event()
        self.done: list[str] = []
        self.wrong: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, i: int) -> None:
        while not self.stop.is_set():
            topic = TOPICS[i % len(TOPICS)]
            i += 1
            try:
                text = complete(self.url, topic)
            except Exception as e:  # noqa: BLE001 - every failure is the test's
                self.wrong.append(f"{topic}: {type(e).__name__}: {e}")
                continue
            (self.done if text == self.offline[topic] else self.wrong).append(f"{topic}: {text!r}")

    def __enter__(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def __repr__(self) -> str:
        return f"streams: {len(self.done)} answered as the offline engine, {len(self.wrong)} not: {self.wrong[:5]}"

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=150)
        assert not any(t.is_alive() for t in self.threads), "a stream still runs 150 s after the load stopped"


def test_a_prefill_pod_deleted_under_load_loses_no_request(split, offline):
    """Streams run through the Service all along. The prefill pod is deleted as a rollout or a drain deletes it
    (its grace period: preStop, while its address leaves the headless Service, then SIGTERM, and it drains); the
    decode pod finds the replacement (a new address behind the same name) and moves blocks from it; then the
    replacement's engine process is killed (SIGKILL, as the OOM killer does) while it computes a prompt. Every
    stream ends with the offline engine's answer; the decode pod prefilled locally what the killed process failed,
    and counted it; its KV pool is empty again once the load stops."""
    decode = poll(lambda: split.ready_pod("decode"), 60, "the decode pod Ready", split.diagnose)
    ip = decode.status.pod_ip
    load = Streams(split.service_url(), offline)

    def diagnose() -> str:
        return f"{load!r}\n{split.diagnose()}"

    def more_answers(n: int = 4) -> None:
        done = len(load.done)
        poll(lambda: len(load.done) >= done + n, 120, f"{n} more streams completing", diagnose)

    def computing(pod_ip: str) -> bool:
        return metric(pod_ip, m.NUM_RUNNING) + metric(pod_ip, m.NUM_WAITING) > 0

    with load:
        old = poll(lambda: split.ready_pod("prefill"), 60, "the prefill pod Ready", diagnose)
        served = metric(old.status.pod_ip, m.REMOTE_PREFILLS_SERVED)
        poll(lambda: metric(old.status.pod_ip, m.REMOTE_PREFILLS_SERVED) > served, 60,
             "the prefill pod serving the load", diagnose)
        before = {r: metric(ip, m.KV_FALLBACKS, reason=r) for r in m.KV_FALLBACK_REASONS}
        t0 = time.monotonic()
        split.k.core.delete_namespaced_pod(old.metadata.name, NS)
        poll(lambda: split.k.get("pods", NS, old.metadata.name) is None, 120, "the deleted prefill pod gone", diagnose)
        gone_s = time.monotonic() - t0
        more_answers()
        # a pod that drained before it stopped fails no prefill; one that still got prompts, or held blocks, as
        # it stopped did (then the decode pod prefilled them itself: correct, and counted)
        graceful = {r: metric(ip, m.KV_FALLBACKS, reason=r) - before[r] for r in m.KV_FALLBACK_REASONS}
        new = poll(lambda: split.ready_pod("prefill", other_than=old.metadata.uid), 300,
                   "the replacement prefill pod Ready", diagnose)
        ok = metric(ip, m.KV_TRANSFERS, outcome="ok")
        poll(lambda: metric(ip, m.KV_TRANSFERS, outcome="ok") > ok, 120,
             "blocks moving from the replacement prefill pod", diagnose)
        replaced_s = time.monotonic() - t0

        fallbacks = metric(ip, m.KV_FALLBACKS)
        poll(lambda: computing(new.status.pod_ip), 60, "the replacement computing a prompt", diagnose, interval=0.02)
        split.cluster.ctr("tasks", "kill", "-s", "SIGKILL",
                          new.status.container_statuses[0].container_id.removeprefix("containerd://"))
        poll(lambda: metric(ip, m.KV_FALLBACKS) > fallbacks, 60, "the decode pod counting a fallback", diagnose)
        more_answers()
    assert not load.wrong, (load.wrong[:5], diagnose())
    by_reason = {reason: metric(ip, m.KV_FALLBACKS, reason=reason) for reason in m.KV_FALLBACK_REASONS}
    poll(lambda: metric(ip, m.KV_CACHE_USAGE) == 0, 30, "the decode pod's KV pool empty again", diagnose)
    print(f"\nprefill pod deleted, its replacement's process killed, under load: {len(load.done)} streams, all equal "
          f"to the offline engine's; fallbacks {by_reason}, of them around the delete {graceful}; delete -> pod gone "
          f"{gone_s:.0f} s, -> the replacement moving blocks {replaced_s:.0f} s")


def auto_pods(split: Split) -> dict[str, object] | None:
    """Mode auto's two pods, by role, once both are Ready, one of each role, and the role Deployments' pods gone."""
    pods = split.k.core.list_namespaced_pod(NS, label_selector=f"app.kubernetes.io/instance={NAME}").items
    if any(p.metadata.owner_references[0].name.startswith((f"{NAME}-prefill-", f"{NAME}-decode-")) for p in pods):
        return None  # mode on's pods still stopping
    live = [p for p in pods if p.metadata.deletion_timestamp is None]
    ready = [p for p in live if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]
    roles = {p.metadata.labels.get(ROLE_LABEL): p for p in ready}
    return roles if len(live) == 2 and set(roles) == {"prefill", "decode"} else None


def engine_role(pod_ip: str) -> str | None:
    """The role the engine says it serves in (chunkpilot:disagg_role)."""
    return next((dict(ls)["role"] for (n, ls), v in pod_metrics(pod_ip).items() if n == m.DISAGG_ROLE and v == 1),
                None)


def test_mode_auto_switches_roles_in_place_under_load(split, offline):
    """Switched to mode auto: one Deployment of two --live-roles pods, one of which the operator makes the prefill
    pod (labels, which the Services follow, and a knobs push). Under load through the Service, the split moves to
    colocated (prefill.replicas 0: the prefill pod serves clients) and back (the newest decode pod computes prompts
    again), each a role switch in place: the same two pods, no container restart, every stream the offline
    engine's answer, and blocks moving again after the switch back."""
    split.k.patch(NAME, {"spec": {"disaggregation": {"mode": "auto"}}}, NS)
    pods = poll(lambda: auto_pods(split), 300, "mode auto's two pods Ready, one of each role", split.diagnose)
    for role, pod in pods.items():
        assert pod.metadata.labels[LLMD_ROLE_LABEL] == role
        poll(lambda: engine_role(pod.status.pod_ip) == role, 30, f"the {role} pod's engine in its role",
             split.diagnose)
    decode_ip = pods["decode"].status.pod_ip
    poll(lambda: peers_ready(decode_ip), 60, "the decode pod finding the prefill pod", split.diagnose)
    start = {p.metadata.uid: p.status.container_statuses[0].restart_count for p in pods.values()}
    load = Streams(split.service_url(), offline)

    def diagnose() -> str:
        return f"{load!r}\n{split.diagnose()}"

    def labelled() -> dict[str, str]:
        return {p.metadata.uid: p.metadata.labels.get(ROLE_LABEL) for p in split.pods("prefill") + split.pods("decode")}

    with load:
        ok = metric(decode_ip, m.KV_TRANSFERS, outcome="ok")
        poll(lambda: metric(decode_ip, m.KV_TRANSFERS, outcome="ok") > ok, 120, "blocks moving in mode auto",
             diagnose)
        # colocated: the prefill pod switches to decode and serves clients
        old_prefill = pods["prefill"]
        served = metric(old_prefill.status.pod_ip, m.REQUEST_SUCCESS)
        t0 = time.monotonic()
        split.k.patch(NAME, {"spec": {"disaggregation": {"prefill": {"replicas": 0}, "decode": {"replicas": 2}}}}, NS)
        poll(lambda: set(labelled().values()) == {"decode"} and engine_role(old_prefill.status.pod_ip) == "decode",
             60, "both pods decode pods", diagnose, interval=0.1)
        took = {"to colocated": time.monotonic() - t0}
        poll(lambda: metric(old_prefill.status.pod_ip, m.REQUEST_SUCCESS) > served + 2, 120,
             "the old prefill pod serving clients", diagnose)
        # and back: one of them computes prompts again, and the other pulls its blocks
        t0 = time.monotonic()
        split.k.patch(NAME, {"spec": {"disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}}, NS)
        back = poll(lambda: auto_pods(split), 60, "one prefill pod again", diagnose, interval=0.1)
        took["back to the split"] = time.monotonic() - t0
        poll(lambda: engine_role(back["prefill"].status.pod_ip) == "prefill", 30, "its engine a prefill engine",
             diagnose)
        ip = back["decode"].status.pod_ip
        ok = metric(ip, m.KV_TRANSFERS, outcome="ok")
        poll(lambda: metric(ip, m.KV_TRANSFERS, outcome="ok") > ok, 120, "blocks moving after the switch back",
             diagnose, interval=0.1)
        took["to the first pull after it"] = time.monotonic() - t0
        done = len(load.done)
        poll(lambda: len(load.done) >= done + 4, 120, "4 more streams completing", diagnose)
    assert not load.wrong, (load.wrong[:5], diagnose())
    after = {p.metadata.uid: p.status.container_statuses[0].restart_count for p in back.values()}
    assert after == start, (start, after)  # the same pods, not restarted
    assert any(r == "RolesSwitched" for _, r, _ in split.k.events(NS, NAME)), split.k.events(NS, NAME)
    poll(lambda: (split.k.status(NS, NAME).get("disaggregation") or {}).get("prefill", {}).get("readyReplicas") == 1,
         30, "status counting one prefill pod", diagnose)
    # The tuner's split with a budget of the prefill pods' own, written as the tuner writes it (tuning.mode auto,
    # status.scheduler from the tuner; no tuner runs here): the prefill pod runs it as budget and chunk, the decode
    # pod the budget and chunk beside it, each acknowledged in its role's status.
    split.k.patch(NAME, {"spec": {"tuning": {"mode": "auto"}}}, NS)
    generation = int(split.k.status(NS, NAME)["knobs"]["generation"]) + 100
    split.k.patch(NAME, {"status": {"scheduler": {"tokenBudget": TOKEN_BUDGET, "maxChunk": MAX_CHUNK // 2,
                                                  "source": "tuner", "generation": generation, "prefillPods": 1,
                                                  "prefillTokenBudget": 256}}}, NS, status=True)
    prefill_ip, decode_ip = back["prefill"].status.pod_ip, back["decode"].status.pod_ip

    def runs(ip: str, budget: int, chunk: int) -> bool:
        return (metric(ip, m.SCHEDULER_TOKEN_BUDGET), metric(ip, m.SCHEDULER_MAX_CHUNK),
                metric(ip, m.SCHEDULER_GENERATION)) == (budget, chunk, generation)
    poll(lambda: runs(prefill_ip, 256, 256) and runs(decode_ip, TOKEN_BUDGET, MAX_CHUNK // 2), 60,
         "the prefill pod at the tuner's prefill budget, the decode pod at its budget and chunk", split.diagnose)

    def recorded() -> dict | None:
        roles = split.k.status(NS, NAME)["disaggregation"]
        return roles if (roles["prefill"].get("knobs") or {}).get("tokenBudget") == 256 else None
    role_knobs = poll(recorded, 30, "status.disaggregation recording the prefill pod's knobs", split.diagnose)
    assert (role_knobs["prefill"]["knobs"]["source"], role_knobs["prefill"]["appliedReplicas"]) == ("tuner", 1)
    assert role_knobs["decode"]["knobs"]["maxChunk"] == MAX_CHUNK // 2
    print(f"\nmode auto: roles switched in place twice under load, {len(load.done)} streams, all equal to the offline "
          f"engine's; from the spec's patch: " + ", ".join(f"{k} {v:.1f} s" for k, v in took.items()))

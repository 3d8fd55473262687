"""Knobs delivery, pure parts: which pods get a push, what is recorded as their acknowledgement, and the objects
that make the push possible (the token Secret, the admin port, the NetworkPolicy that admits the operator alone)."""

from __future__ import annotations

import base64

from chunkpilot.api.types import KnobsStatus, PodKnobs
from chunkpilot.contract.knobs import SchedulerKnobs
from chunkpilot.operator import builders as b
from chunkpilot.operator.knobs_delivery import PushError, ReadyPod, deliver, one_by_one, ready_pods

from .test_crd_and_builders import SMOL, load

WANT = SchedulerKnobs(96, 32, 7)


def pod(name, ready=True, ip="10.0.0.1", started="t0", deleting=False):
    return {"metadata": {"name": name, **({"deletionTimestamp": "x"} if deleting else {})},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": "engine", "state": {"running": {"startedAt": started}}}]}}


def test_only_ready_serving_pods_are_pushed_to():
    pods = ready_pods([pod("b"), pod("a"), pod("c", ready=False), pod("d", deleting=True), pod("e", ip="")])
    assert [p.name for p in pods] == ["a", "b"] and pods[0].started == "t0"


def test_a_push_goes_only_where_the_acknowledgement_differs_and_failures_are_reported():
    pushed = []

    def push(p, knobs):
        pushed.append(p.name)
        if p.name == "c":
            raise PushError("HTTP 401: a valid bearer token is required")
        return knobs
    before = KnobsStatus(tokenBudget=96, maxChunk=32, generation=7, source="tuner", pods=[
        PodKnobs(pod="a", started="t0", tokenBudget=96, maxChunk=32, generation=7),  # acked: no push
        PodKnobs(pod="b", started="t0", tokenBudget=64, maxChunk=32, generation=6)])  # older: pushed
    pods = [ReadyPod("a", "1", "t0"), ReadyPod("b", "2", "t0"), ReadyPod("c", "3", "t0")]
    status, failures = deliver(before, WANT, "tuner", pods, one_by_one(push))
    assert pushed == ["b", "c"] and failures == ["c: HTTP 401: a valid bearer token is required"]
    assert [p.pod for p in status.pods] == ["a", "b"] and status.applied_replicas == 2
    assert not status.applied_everywhere(WANT, ready_replicas=3)  # c has not acknowledged
    assert status.applied_everywhere(WANT, ready_replicas=2)
    assert not status.applied_everywhere(SchedulerKnobs(96, 32, 8), ready_replicas=2)  # exact generation only


def test_a_restarted_container_is_pushed_again():
    """Its ConfigMap volume may hold an older copy than the knobs it had acknowledged before the restart."""
    before = KnobsStatus(tokenBudget=96, maxChunk=32, generation=7, pods=[
        PodKnobs(pod="a", started="t0", tokenBudget=96, maxChunk=32, generation=7)])
    pushed = []
    deliver(before, WANT, "tuner", [ReadyPod("a", "1", "t1")], one_by_one(lambda p, k: pushed.append(p.name) or k))
    assert pushed == ["a"]


def test_the_admin_port_is_token_guarded_and_admitted_from_the_operator_pods_alone():
    obj = load(SMOL)
    settings = b.OperatorSettings(admin_token_key="k1", operator_namespace="chunkpilot-system",
                                  operator_pod_labels=(("app.kubernetes.io/component", "operator"),))
    secret = b.admin_token_secret(obj, settings)
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert token == b.admin_token(obj, settings) != b.admin_token(obj, b.OperatorSettings(admin_token_key="k2"))
    assert secret["metadata"]["ownerReferences"][0]["uid"] == obj.metadata["uid"]
    pod_spec = b.deployment(obj, settings)["spec"]["template"]["spec"]
    c = pod_spec["containers"][0]
    assert {"name": "admin", "containerPort": b.ADMIN_PORT, "protocol": "TCP"} in c["ports"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["CHUNKPILOT_ADMIN_TOKEN_FILE"] == f"{b.ADMIN_TOKEN_DIR}/token"
    assert {"name": "admin-token", "secret": {"secretName": secret["metadata"]["name"], "defaultMode": 0o440}} in \
        pod_spec["volumes"]
    rules = b.network_policy(obj, settings)["spec"]["ingress"]
    admin = [r for r in rules if r["ports"] == [{"port": "admin", "protocol": "TCP"}]]
    assert admin == [{"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "chunkpilot-system"}},
                                "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}}}],
                      "ports": [{"port": "admin", "protocol": "TCP"}]}]
    # an operator outside the cluster: nobody is admitted to the admin port (a rule without `from` admits all)
    outside = b.network_policy(obj, b.OperatorSettings())["spec"]["ingress"]
    assert all(r["ports"] != [{"port": "admin", "protocol": "TCP"}] for r in outside)
    # the token stays out of the pod template: rotating the key never restarts pods
    assert b.deployment(obj, settings) == b.deployment(obj, b.OperatorSettings(
        admin_token_key="k2", operator_namespace="chunkpilot-system",
        operator_pod_labels=(("app.kubernetes.io/component", "operator"),)))


# -- the HTTP push: a deadline for the whole request, a cap on the answer, many pods at once -------------------

class FakePods:
    """Engine pods on loopback addresses 127.0.0.2.. sharing one port (a pusher has one admin port), each answering
    the way `behave(index, connection)` does. Counts what each sent, so a test can tell a push given up from one
    that waited for the whole answer."""

    def __init__(self, n: int, behave) -> None:
        import socket
        import threading

        from chunkpilot.lab.child_process import free_port

        self.port, self.behave, self.sent = free_port(), behave, [0] * n
        self.socks, self.threads, self.stopping = [], [], threading.Event()
        for i in range(n):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((f"127.0.0.{i + 2}", self.port))
            s.listen(8)
            s.settimeout(0.2)
            self.socks.append(s)
            t = threading.Thread(target=self._serve, args=(i, s), daemon=True)
            t.start()
            self.threads.append(t)
        self.pods = [ReadyPod(f"p{i}", f"127.0.0.{i + 2}", "t0") for i in range(n)]

    def _serve(self, i, s) -> None:
        import socket

        while not self.stopping.is_set():
            try:
                conn, _ = s.accept()
            except (TimeoutError, socket.timeout):
                continue
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(65536)  # the request (small: one packet)
                    self.behave(self, i, conn)
                except OSError:  # the pusher gave up and closed: what the deadline tests want
                    pass

    def send(self, i, conn, data: bytes) -> None:
        conn.sendall(data)
        self.sent[i] += len(data)

    def close(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(5)
        for s in self.socks:
            s.close()


ANSWER = b'{"token_budget": 96, "max_chunk": 32, "generation": 7}'


def test_a_pod_that_answers_one_byte_at_a_time_is_given_up_at_the_deadline():
    import time

    from chunkpilot.operator.knobs_delivery import HttpPusher

    body = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(ANSWER) + ANSWER

    def drip(fake, i, conn):
        for byte in body:  # one byte every 0.2 s: each read is quick, the whole answer takes ~20 s
            fake.send(i, conn, bytes([byte]))
            time.sleep(0.2)
    fake = FakePods(1, drip)
    try:
        got = HttpPusher(fake.port, deadline=1.0).for_token("t")(fake.pods, WANT)
        assert isinstance(got["p0"], PushError) and "within 1 s" in str(got["p0"]), got
        assert fake.sent[0] < len(body), "the pusher waited for the whole slow answer"
    finally:
        fake.close()


def test_an_answer_larger_than_the_cap_is_refused_unread():
    from chunkpilot.operator.knobs_delivery import HttpPusher

    big = 50 * 1024 * 1024

    def flood(fake, i, conn):
        fake.send(i, conn, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % big)
        for _ in range(big // 65536):
            fake.send(i, conn, b"x" * 65536)
    fake = FakePods(1, flood)
    try:
        got = HttpPusher(fake.port, max_answer=4096).for_token("t")(fake.pods, WANT)
        assert isinstance(got["p0"], PushError) and "larger than 4096 bytes" in str(got["p0"]), got
        assert fake.sent[0] < big  # refused before the pod could send it all
    finally:
        fake.close()


def test_pods_are_pushed_concurrently_and_each_answer_is_its_acknowledgement():
    import threading

    n = 4
    barrier = threading.Barrier(n, timeout=10)  # passes only when all four pushes are in flight at once

    def answer(fake, i, conn):
        barrier.wait()
        fake.send(i, conn, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(ANSWER) + ANSWER)
    fake = FakePods(n, answer)
    try:
        from chunkpilot.operator.knobs_delivery import HttpPusher

        status, failures = deliver(None, WANT, "tuner", fake.pods, HttpPusher(fake.port, deadline=20).for_token("t"))
        assert failures == [] and status.applied_replicas == n, failures
    finally:
        fake.close()


def test_only_pods_of_the_replica_sets_our_deployment_controls_get_the_token():
    from chunkpilot.operator.knobs_delivery import owned_pods

    def owned(kind_uid, controller=True, **meta):
        return {"metadata": {**meta, "ownerReferences": [{"uid": kind_uid, "controller": controller}]}}
    replica_sets = [owned("deploy-1", uid="rs-1"), owned("deploy-1", uid="rs-2"), owned("someone", uid="rs-x")]
    pods = [owned("rs-1", name="a"), owned("rs-2", name="b"), owned("rs-x", name="labelled-alike"),
            {"metadata": {"name": "bare"}}, owned("rs-1", controller=False, name="not-controlled")]
    assert [p["metadata"]["name"] for p in owned_pods(pods, replica_sets, "deploy-1")] == ["a", "b"]
    assert owned_pods(pods, replica_sets, None) == []  # no Deployment yet: nobody gets the token


def test_acknowledgements_are_verified_again_after_a_while():
    """Someone with the token pushed other knobs through a port-forward: the recorded acknowledgement would say the
    pod runs ours for ever. A pass trusts a record for `verify_seconds` (the resync period), then pushes again, and
    the pod's answer replaces the record."""
    from chunkpilot.operator.reconciler import Reconciler

    obj = load(SMOL)
    obj.metadata.update({"namespace": "ns", "uid": "id-1"})
    desired = SchedulerKnobs(obj.spec.scheduler.token_budget, obj.spec.scheduler.max_chunk,
                             obj.metadata.get("generation", 1) or 1)

    class Kube:
        def list_pods(self, ns, selector):
            p = pod("a")
            p["metadata"]["ownerReferences"] = [{"uid": "rs-1", "controller": True}]
            return [p]

        def list_replica_sets(self, ns, selector):
            return [{"metadata": {"uid": "rs-1", "ownerReferences": [{"uid": "deploy-1", "controller": True}]}}]

    pushed = []

    class Pusher:
        def for_token(self, token):
            return one_by_one(lambda p, k: pushed.append(p.name) or k)
    clock = [0.0]
    r = Reconciler(Kube(), b.OperatorSettings(admin_token_key="k"), lambda *a: None, pusher=Pusher(),
                   verify_seconds=300, clock=lambda: clock[0])
    deploy = {"metadata": {"uid": "deploy-1"}}
    status, *_ = r._deliver_knobs(obj, {None: deploy})
    assert pushed == ["a"] and status.applied_replicas == 1
    desired = status.pods[0].scheduler_knobs
    obj.status.knobs = status  # what the pass wrote
    clock[0] = 100
    r._deliver_knobs(obj, {None: deploy})
    assert pushed == ["a"]  # trusted while fresh
    clock[0] = 300
    status, *_ = r._deliver_knobs(obj, {None: deploy})
    assert pushed == ["a", "a"] and status.pods[0].scheduler_knobs == desired  # asked again
    assert r._deliver_knobs(obj, {None: {"metadata": {"uid": "someone-else"}}})[0].pods == []  # not our pods: no push

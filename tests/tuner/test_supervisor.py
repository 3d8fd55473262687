"""The tuner's per-resource threads: started for tuned resources, stopped on deletion or tuning off, restarted
after a failure by the next event; failures are retried in one place, inside tune_one (retry.py)."""

from __future__ import annotations

import threading

from chunkpilot.tuner.retry import Backoff
from chunkpilot.tuner.supervisor import Supervisor

from ..engine.server_proc import wait_for


def fake_sources(**given):
    """What tune_one builds a loop from, without Prometheus or kopf: no measurer (the fake loops measure
    nothing), Events dropped, short pauses; `given` replaces any of them."""
    from chunkpilot.tuner import daemon

    return daemon.Sources(**{"measurer": lambda selector, slo, sleep, classes: None, "events": lambda raw: lambda *event: None,
                             "backoff": lambda: Backoff(0.01, daemon.ERROR_BACKOFF_MAX), **given})


def obj(name: str, mode: str = "auto", deleting: bool = False, uid: str | None = None) -> dict:
    meta = {"namespace": "ns", "name": name, "uid": uid or f"uid-{name}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"metadata": meta, "spec": {"tuning": {"mode": mode}}}


def test_threads_follow_the_resources():
    calls: dict[str, int] = {}
    live: dict[str, int] = {}  # threads inside tune_one now, by name: proves that stopped threads really ended
    uids: list[str] = []
    lock = threading.Lock()

    def tune_one(namespace, name, uid, stop: threading.Event) -> None:
        with lock:
            calls[name] = calls.get(name, 0) + 1
            live[name] = live.get(name, 0) + 1
            uids.append(uid)
        try:
            if name == "flaky" and calls[name] == 1:
                raise RuntimeError("first try fails")
            stop.wait()
        finally:
            with lock:
                live[name] -= 1

    def inside() -> set[str]:
        with lock:
            return {n for n, k in live.items() if k}

    s = Supervisor(tune_one)
    s.observe(None, obj("a"))
    s.observe(None, obj("off", mode="off"))
    s.observe("MODIFIED", obj("a"))  # no second thread for the same resource
    s.observe("ADDED", obj("flaky"))
    # tune_one retries its own failures (retry.py): what escapes it ends the thread, logged, and does not stop
    # the others; the next event for the resource starts a fresh one
    assert wait_for(lambda: calls.get("flaky") == 1 and s.running() == {("ns", "a")}, 5)
    s.observe("MODIFIED", obj("flaky"))
    assert wait_for(lambda: inside() == {"a", "flaky"} and calls.get("flaky") == 2, 5)
    assert calls["a"] == 1 and "off" not in calls
    s.observe("MODIFIED", obj("a", mode="off"))
    assert wait_for(lambda: inside() == {"flaky"} and s.running() == {("ns", "flaky")}, 5)
    s.observe("MODIFIED", obj("flaky", deleting=True))
    assert wait_for(lambda: not inside() and not s.running(), 5)
    s.observe("MODIFIED", obj("a", mode="advisory"))
    assert wait_for(lambda: inside() == {"a"} and calls["a"] == 2, 5)
    # deleted and made again under the same name, the DELETED event missed: a fresh thread for the new uid
    s.observe("ADDED", obj("a", uid="uid-a-2"))
    assert wait_for(lambda: calls["a"] == 3 and uids[-1] == "uid-a-2" and live["a"] == 1, 5)
    s.observe("DELETED", obj("a", uid="uid-a-2"))
    assert wait_for(lambda: not inside() and not s.running(), 5)
    s.observe(None, obj("b"))
    assert wait_for(lambda: inside() == {"b"}, 5)
    s.stop_all(5)
    assert not s.running() and not inside()


def test_a_failed_iteration_keeps_the_loop_and_its_scaling_history():
    """Review: any exception in a tuning thread (a 404 from scale after a deletion, an API 5xx) escaped tune_one,
    and the supervisor built a new loop, losing the scale-down stabilization history. Now the same loop goes on
    after a pause, and the history is kept per resource uid, across rebuilds too."""
    import kopf
    from kubernetes.client.exceptions import ApiException

    from chunkpilot.tuner import daemon

    from ..operator.operator_proc import sample

    raw = sample("llm", "team")
    raw["metadata"]["uid"] = "u-1"
    stopped = threading.Event()
    built, iterations = [], []

    class Loop:
        class study:  # the daemon logs how many trials the study it opened holds
            total_completed = staticmethod(lambda: 0)

        def iterate(self):
            iterations.append(1)
            if len(iterations) == 1:
                raise ApiException(status=500, reason="Internal Server Error")
            if len(iterations) == 2:
                raise ApiException(status=404, reason="Not Found")
            stopped.set()

    def build_loop(config, actuator, measurer, publisher, scaler=None, scaling_history=None, backoff=None):
        built.append(scaling_history)
        return Loop()

    class Kube:
        def read_inference_deployment(self, namespace, name):
            return raw

    memo = kopf.Memo(kube=Kube(), cluster=daemon.ClusterConfig(prometheus_url="http://x", storage=":memory:"),
                     metrics=None)
    sources = fake_sources(build_loop=build_loop)
    daemon.tune_one("team", "llm", "u-1", memo, stopped, sources)
    assert len(built) == 1 and len(iterations) == 3  # one loop, through both failures
    built[0].append((0.0, 3))  # a recommendation the autoscaler made
    stopped.clear()
    iterations.clear()
    daemon.tune_one("team", "llm", "u-1", memo, stopped, sources)  # the thread restarted (or the spec changed)
    assert built[1] is built[0] and built[1] == [(0.0, 3)]


def test_tune_one_retries_a_failed_read_itself_with_the_loops_backoff():
    """The one retry layer: reading the resource used to sit outside tune_one's retry, so an API server outage
    escaped to the supervisor's second layer, which built a new loop. Now the read fails inside the same retry,
    the loop is built once and gets the same Backoff, and the pauses double across the failures."""
    import kopf
    from kubernetes.client.exceptions import ApiException

    from chunkpilot.tuner import daemon

    from ..operator.operator_proc import sample

    raw = sample("llm", "team")
    raw["metadata"]["uid"] = "u-1"
    stopped = threading.Event()
    built, reads, events = [], [], []

    class Loop:
        class study:
            total_completed = staticmethod(lambda: 0)

        def iterate(self):
            stopped.set()

    def build_loop(config, actuator, measurer, publisher, scaler=None, scaling_history=None, backoff=None):
        built.append(backoff)
        return Loop()

    class Kube:
        def read_inference_deployment(self, namespace, name):
            reads.append(1)
            if len(reads) <= 3:
                raise ApiException(status=503, reason="Service Unavailable")
            return raw

    memo = kopf.Memo(kube=Kube(), cluster=daemon.ClusterConfig(prometheus_url="http://x", storage=":memory:"),
                     metrics=None)
    sources = fake_sources(build_loop=build_loop, events=lambda raw: lambda *event: events.append(event))
    daemon.tune_one("team", "llm", "u-1", memo, stopped, sources)  # returns: nothing escaped
    assert len(reads) == 4 and len(built) == 1
    assert built[0] is not None and built[0].upcoming == 0.08  # the failed reads' doubling, handed to the loop
    assert events == []  # nothing to attach the Event to before the first read: the log says it


def test_a_holding_loop_keeps_doubling_under_tune_one():
    """The loop holds (Prometheus down) by pausing with the shared Backoff and returning normally; tune_one must
    not take that return for a good iteration and reset the pause (the scale bench saw 200 holding threads
    polling every 2 s instead of backing off to 60 s)."""
    import kopf

    from chunkpilot.tuner import daemon

    from ..operator.operator_proc import sample

    raw = sample("llm", "team")
    raw["metadata"]["uid"] = "u-1"
    stopped = threading.Event()
    pauses = []

    class Loop:
        class study:
            total_completed = staticmethod(lambda: 0)

        def __init__(self, backoff):
            self.backoff = backoff

        def iterate(self):  # as TunerLoop._hold: take the pause, return HOLD
            pauses.append(self.backoff.failed())
            if len(pauses) == 4:
                stopped.set()
            return "hold"

    memo = kopf.Memo(kube=type("K", (), {"read_inference_deployment": lambda self, ns, n: raw})(),
                     cluster=daemon.ClusterConfig(prometheus_url="http://x", storage=":memory:"), metrics=None)
    # the production pauses (2 s doubling): what the scale bench must see
    sources = fake_sources(build_loop=lambda *a, backoff=None, **kw: Loop(backoff),
                           backoff=daemon.Sources.of(memo.cluster).backoff)
    daemon.tune_one("team", "llm", "u-1", memo, stopped, sources)
    assert pauses == [2.0, 4.0, 8.0, 16.0]

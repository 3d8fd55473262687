"""The shared controller runtime (chunkpilot.kube.work_queue, peering_gate, autoscalers, object_key): merged keys,
one pass at a time per key, rate-limited retries, resync, a gate that holds everything, and kopf's peering rule."""

from __future__ import annotations

import datetime
import threading
import time

from chunkpilot.kube.autoscalers import AutoscalerCheck, targeting
from chunkpilot.kube.object_key import ObjectKey
from chunkpilot.kube.peering_gate import PeeringGate, live_priorities, may_act
from chunkpilot.kube.work_queue import WorkQueue

from ..waiting import consistently


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_an_object_key_is_read_from_metadata_in_one_way():
    """The key the operator queues and the tuner keeps a thread per: "default" when the metadata names no
    namespace, an owner in its child's namespace, and the plain pair wherever a tuple is expected."""
    key = ObjectKey.from_meta({"namespace": "ml", "name": "chat", "uid": "u-1"})
    assert key == ("ml", "chat") and hash(key) == hash(("ml", "chat")) and str(key) == "ml/chat"
    assert ObjectKey.from_meta({"name": "chat"}) == ObjectKey("default", "chat")
    child = {"namespace": "ml", "name": "chat-engine",
             "ownerReferences": [{"kind": "InferenceDeployment", "name": "chat"}]}
    assert ObjectKey.of_owner(child, child["ownerReferences"][0]) == key
    namespace, name = key
    assert (namespace, name) == (key.namespace, key.name)


class Recorder:
    """A pass that blocks until released, recording overlaps per key."""

    def __init__(self, retry_for=()):
        self.lock = threading.Lock()
        self.running: set = set()
        self.passes: list = []
        self.overlap = False
        self.release = threading.Event()
        self.retry_for = set(retry_for)

    def __call__(self, key) -> bool:
        with self.lock:
            self.overlap |= key in self.running
            self.running.add(key)
        self.release.wait(5)
        with self.lock:
            self.running.discard(key)
            self.passes.append(key)
        return key in self.retry_for

    def is_running(self, key) -> bool:
        with self.lock:
            return key in self.running

    def count(self, key) -> int:
        with self.lock:
            return self.passes.count(key)

    def all(self) -> list:
        with self.lock:
            return list(self.passes)


def test_keys_added_while_waiting_merge_and_a_key_never_runs_beside_itself():
    rec = Recorder()
    q = WorkQueue(rec, workers=4, resync=3600)
    q.start()
    try:
        q.add("a")
        assert wait_for(lambda: rec.is_running("a"))
        for _ in range(10):  # ten events while its pass runs: one more pass after it, not ten, and not beside it
            q.add("a")
        q.add("b")
        assert wait_for(lambda: rec.is_running("b"))
        rec.release.set()
        assert wait_for(lambda: q.pending() == 0)
        assert sorted(rec.all()) == ["a", "a", "b"] and not rec.overlap
    finally:
        rec.release.set()
        q.stop()


def test_a_failed_pass_is_retried_with_a_growing_backoff_and_a_forgotten_key_is_not():
    rec = Recorder(retry_for={"x"})
    rec.release.set()
    q = WorkQueue(rec, workers=1, resync=3600, backoff=0.05, max_backoff=0.2)
    q.start()
    try:
        q.add("x")
        assert wait_for(lambda: rec.count("x") >= 4, 5)
        q.forget("x")
        n = rec.count("x")
        q.add("y")  # a key passed once and done: once it ran twice more, x had time for several retries
        q.add_after("y", 0.4)
        consistently(lambda: rec.count("x") <= n + 1, until=lambda: rec.count("y") >= 2, timeout=5,
                     what="no retries after forget")
    finally:
        q.stop()


def test_resync_passes_every_known_key_again_and_the_gate_holds_everything():
    rec = Recorder()
    rec.release.set()
    open_, asked = threading.Event(), []
    q = WorkQueue(rec, workers=2, resync=0.1, gate=lambda: asked.append(1) or open_.is_set())
    q.start()
    try:
        q.add("a")
        q.add("b")
        # a standby replica passes nothing, not even what its own events queued: while both workers asked the
        # gate several times each (every asking of a shut gate is a chance to run a pass)
        consistently(lambda: rec.all() == [], until=lambda: len(asked) >= 10, timeout=10, what="a shut gate")
        open_.set()
        assert wait_for(lambda: rec.count("a") >= 2 and rec.count("b") >= 2)  # passes, then resyncs
        q.forget("b")
        n, a = rec.count("b"), rec.count("a")
        consistently(lambda: rec.count("b") <= n + 1, until=lambda: rec.count("a") >= a + 3, timeout=10,
                     what="no resync of a forgotten key")
    finally:
        q.stop()


def test_kopfs_peering_rule_read_off_the_peering_object():
    now = datetime.datetime(2026, 12, 4, 12, 0, tzinfo=datetime.UTC)

    def rec(priority, ago, lifetime=60):
        return {"priority": priority, "lifetime": lifetime,
                "lastseen": (now - datetime.timedelta(seconds=ago)).isoformat()}
    status = {"pod-a": rec(10, 5), "pod-b": rec(20, 5), "pod-c": rec(99, 120), "junk": "x"}
    assert sorted(live_priorities(status, now)) == [10, 20]  # pod-c's record expired
    assert may_act([10, 20], 20) and not may_act([10, 20], 10)
    assert not may_act([20, 20], 20)  # equal priorities: kopf pauses them all


def test_the_gate_stands_by_until_the_object_says_otherwise_and_caches_its_read():
    reads = []
    now = datetime.datetime.now(datetime.UTC).isoformat()
    objects = [{"status": {"me": {"priority": 5, "lastseen": now, "lifetime": 60},
                           "other": {"priority": 9, "lastseen": now, "lifetime": 60}}}]
    clock = [0.0]
    gate = PeeringGate(lambda: reads.append(1) or objects, priority=5, cache_seconds=5, clock=lambda: clock[0])
    assert gate() is False  # a higher live peer
    objects[0]["status"].pop("other")
    assert gate() is False and len(reads) == 1  # cached
    clock[0] = 6
    assert gate() is False and len(reads) == 2  # alone now: opening waits for a second read to confirm it
    objects[0]["status"]["other"] = {"priority": 9, "lastseen": now, "lifetime": 60}
    clock[0] = 12
    assert gate() is False and len(reads) == 3  # a replica started with it appeared meanwhile: never opened
    objects[0]["status"].pop("other")
    clock[0] = 18
    assert gate() is False
    clock[0] = 24
    assert gate() is True and len(reads) == 5  # two reads, 6 s apart, both alone: it acts
    assert PeeringGate(None, priority=0)() is True  # standalone


def test_one_hpa_list_per_namespace_serves_every_object_for_its_period():
    items = [{"metadata": {"name": "h1"}, "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                                                      "name": "a"}}},
             {"metadata": {"name": "h2"}, "spec": {"scaleTargetRef": {"apiVersion": "chunkpilot.io/v1alpha1",
                                                                      "kind": "InferenceDeployment", "name": "b"}}}]
    assert targeting(items, [("apps", "Deployment", "a")]) == {"h1": ("apps", "Deployment", "a")}

    class Kube:
        calls = 0

        def list_autoscalers(self, namespace):
            Kube.calls += 1
            return items
    clock = [0.0]
    check = AutoscalerCheck(Kube(), seconds=30, clock=lambda: clock[0])
    assert check.targeting("ns", [("apps", "Deployment", "a")]) == {"h1": ("apps", "Deployment", "a")}
    assert check.targeting("ns", [("chunkpilot.io", "InferenceDeployment", "b")]) == {
        "h2": ("chunkpilot.io", "InferenceDeployment", "b")}
    assert Kube.calls == 1
    clock[0] = 31
    check.targeting("ns", [])
    assert Kube.calls == 2


def test_a_gate_that_cannot_reach_the_api_server_ends_no_thread_and_keeps_its_last_answer():
    """A refused connection raises urllib3's errors, not ApiException; before, it ended the worker that asked (and
    each 5 s of outage another one, then the clock thread: no retry or resync ever again)."""
    import urllib3

    rec = Recorder()
    rec.release.set()
    down = threading.Event()
    reads = []

    def read():
        reads.append(1)
        if down.is_set():
            raise urllib3.exceptions.MaxRetryError(None, "/apis/kopf.dev", "Connection refused")
        return [{"status": {"me": {"priority": 5, "lastseen": datetime.datetime.now(datetime.UTC).isoformat(),
                                   "lifetime": 60}}}]
    gate = PeeringGate(read, priority=5, cache_seconds=0.05)
    q = WorkQueue(rec, workers=3, resync=0.2, gate=gate)
    q.start()
    try:
        q.add("a")
        assert wait_for(lambda: rec.count("a") >= 1)  # opened after two reads
        down.set()
        n = len(reads)
        assert wait_for(lambda: len(reads) >= n + 20, 10)  # twenty failed reads
        assert q.alive_threads() == 4 and q.restarts == 0 and q.health() is None
        passes = rec.count("a")
        assert wait_for(lambda: rec.count("a") >= passes + 2, 5)  # the last answer (open) holds: resyncs go on
        down.clear()
    finally:
        q.stop()


class BlockingGate:
    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self):
        self.entered.set()
        self.release.wait(10)
        return True


def test_the_gate_is_asked_outside_the_queues_lock():
    """A gate whose read hangs (an API server that accepts and never answers) must not block producers: kopf's
    handlers call add() from its event loop."""
    rec = Recorder()
    rec.release.set()
    gate = BlockingGate()
    q = WorkQueue(rec, workers=1, resync=3600, gate=gate)
    q.start()
    try:
        assert gate.entered.wait(5)
        done = threading.Event()
        threading.Thread(target=lambda: (q.add("k"), q.pending(), q.health(), done.set()), daemon=True).start()
        assert done.wait(5), "add() waited for the gate's read"
        gate.release.set()
        assert wait_for(lambda: rec.count("k") == 1)
    finally:
        gate.release.set()
        q.stop()


def test_a_thread_that_dies_is_started_again_and_its_key_is_not_lost():
    class Fatal(BaseException):  # not an Exception: escapes the pass's own handler, as SystemExit would
        pass
    calls = []

    def process(key):
        calls.append(key)
        if len(calls) == 1:
            raise Fatal("boom")
        return False
    q = WorkQueue(process, workers=1, resync=3600, backoff=0.05)
    q.start()
    try:
        q.add("k")  # the first pass kills the worker; the key goes back with a backoff, the worker starts again
        assert wait_for(lambda: calls.count("k") == 2, 10)
        assert q.restarts == 1 and q.alive_threads() == 2 and q.pending() == 0
        q.add("j")
        assert wait_for(lambda: "j" in calls)
    finally:
        q.stop()


def test_health_says_why_when_work_waits_or_a_pass_hangs_and_nothing_when_idle_or_standing_by():
    clock = [0.0]
    rec = Recorder()  # blocks until released
    open_ = threading.Event()
    open_.set()
    q = WorkQueue(rec, workers=1, resync=3600, stall_after=60, clock=lambda: clock[0], gate=open_.is_set)
    q.start()
    try:
        assert q.health() is None  # idle
        q.add("a")
        assert wait_for(lambda: rec.is_running("a"))
        q.add("b")  # waits behind the one worker
        clock[0] = 61
        trouble = q.health()
        assert trouble is not None and ("ready" in trouble or "has run for 61 s" in trouble), trouble
        rec.release.set()
        assert wait_for(lambda: q.pending() == 0)
        assert wait_for(lambda: q.health() is None)  # the worker took b, then found nothing: progress again
        open_.clear()  # standing by with work queued is not stuck
        q.add("c")
        clock[0] = 200
        assert wait_for(lambda: q.health() is None)
    finally:
        rec.release.set()
        q.stop()

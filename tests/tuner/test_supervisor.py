"""The tuner's per-resource threads: started for tuned resources, stopped on deletion or tuning off, restarted
after a failure."""

from __future__ import annotations

import threading

from chunkpilot.tuner import supervisor as sup
from chunkpilot.tuner.supervisor import Supervisor

from ..engine.server_proc import wait_for


def obj(name: str, mode: str = "auto", deleting: bool = False) -> dict:
    meta = {"namespace": "ns", "name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    return {"metadata": meta, "spec": {"tuning": {"mode": mode}}}


def test_threads_follow_the_resources(monkeypatch):
    monkeypatch.setattr(sup, "RETRY_SECONDS", 0.05)
    calls: dict[str, int] = {}
    lock = threading.Lock()

    def tune_one(namespace, name, stop: threading.Event) -> None:
        with lock:
            calls[name] = calls.get(name, 0) + 1
        if name == "flaky" and calls[name] == 1:
            raise RuntimeError("first try fails")
        stop.wait()

    s = Supervisor(tune_one)
    s.observe(None, obj("a"))
    s.observe(None, obj("off", mode="off"))
    s.observe("MODIFIED", obj("a"))  # no second thread for the same resource
    s.observe("ADDED", obj("flaky"))
    assert wait_for(lambda: s.running() == {("ns", "a"), ("ns", "flaky")} and calls.get("flaky") == 2, 5)
    assert calls["a"] == 1 and "off" not in calls
    s.observe("MODIFIED", obj("a", mode="off"))
    assert wait_for(lambda: s.running() == {("ns", "flaky")}, 5)
    s.observe("MODIFIED", obj("flaky", deleting=True))
    assert wait_for(lambda: not s.running(), 5)
    s.observe("MODIFIED", obj("a", mode="advisory"))
    assert wait_for(lambda: s.running() == {("ns", "a")} and calls["a"] == 2, 5)
    s.observe("DELETED", obj("a"))
    assert wait_for(lambda: not s.running(), 5)
    s.observe(None, obj("b"))
    s.stop_all(5)
    assert not s.running()

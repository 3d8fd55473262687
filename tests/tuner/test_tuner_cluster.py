"""Cluster mode against the emulated API server (see tests/operator/test_operator_kmock.py for why kmock): the
tuner process finds tuned InferenceDeployments, writes only its part of status, and holds when Prometheus is
unreachable; the status actuator writes knobs the operator picks up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from chunkpilot.operator.kube import Kube
from chunkpilot.tuner.daemon import ClusterConfig, StatusActuator, StatusWriter, start_knobs, tuning_config
from chunkpilot.tuner.prometheus import PrometheusSource
from chunkpilot.tuner.space import Knobs

from ..engine.server_proc import wait_for
from ..operator.kube_emulator import KubeEmulatorThread
from ..operator.operator_proc import client, create, patch, sample

CLUSTER = ClusterConfig(prometheus_url="http://127.0.0.1:1", storage=":memory:")


@pytest.fixture
def kube(tmp_path):
    with KubeEmulatorThread() as k:
        yield k


def test_tuning_config_follows_the_spec_and_fingerprints_the_targets():
    spec = sample("x")["spec"]
    c = tuning_config("ns", "x", spec, CLUSTER)
    assert c.settings.mode == "auto" and c.slo.itl is not None and c.deployment.startswith("ns/x@")
    assert c.budget_bounds[0] >= spec["engine"]["maxNumSeqs"]
    spec["slo"]["itl"]["thresholdSeconds"] = 0.5
    assert tuning_config("ns", "x", spec, CLUSTER).deployment != c.deployment  # new targets: new study
    spec["slo"] = {}
    with pytest.raises(ValueError, match="spec.slo"):
        tuning_config("ns", "x", spec, CLUSTER)


def test_status_actuator_writes_tuner_knobs_and_keeps_other_conditions(kube):
    api = client(kube)
    create(api, sample("act"))
    patch(api, "act", {"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "AllReplicasReady"}],
                                  "scheduler": {"tokenBudget": 128, "maxChunk": 64, "source": "spec",
                                                "generation": 3}}}, status=True)
    raw = kube.get("inferencedeployments", "default", "act")
    start, gen = start_knobs(raw)
    assert (start, gen) == (Knobs(128, 64), 3)
    writer = StatusWriter(Kube(api), "default", "act")
    act = StatusActuator(writer, PrometheusSource("http://127.0.0.1:1", 'job="x"'), start, gen)
    assert act.apply(Knobs(96, 32)) == 4
    st = kube.get("inferencedeployments", "default", "act")["status"]
    assert st["scheduler"] == {"tokenBudget": 96, "maxChunk": 32, "source": "tuner", "generation": 4}
    writer.write({"tuning": {"phase": "Exploring"}}, [{"type": "Tuning", "status": "True", "reason": "Exploring",
                                                        "message": ""}])
    conds = {c["type"]: c for c in kube.get("inferencedeployments", "default", "act")["status"]["conditions"]}
    assert conds["Ready"]["status"] == "True" and conds["Tuning"]["reason"] == "Exploring"


def test_tuner_process_holds_when_prometheus_is_unreachable(kube, tmp_path):
    api = client(kube)
    create(api, sample("tuned"))  # auto mode
    create(api, sample("plain", tuning__mode="off"))
    patch(api, "tuned", {"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "AllReplicasReady"}]}},
          status=True)
    env = dict(os.environ, KUBECONFIG=str(kube.kubeconfig(tmp_path / "kubeconfig")))
    log = open(tmp_path / "tuner.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "chunkpilot.cli.main", "tuner", "run", "--prometheus-url",
                             "http://127.0.0.1:1", "--metrics-port", "0", "--liveness", "",
                             "--storage", f"sqlite:///{tmp_path / 'study.db'}"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        def tuning():
            return (kube.get("inferencedeployments", "default", "tuned").get("status") or {}).get("tuning") or {}
        assert wait_for(lambda: tuning().get("phase") == "Holding", 60), (tmp_path / "tuner.log").read_text()[-3000:]
        st = kube.get("inferencedeployments", "default", "tuned")["status"]
        conds = {c["type"]: c for c in st["conditions"]}
        assert conds["Tuning"]["status"] == "False" and conds["Tuning"]["reason"] == "MeasurementsUnavailable"
        assert "127.0.0.1:1" in conds["Tuning"]["message"]
        assert conds["Ready"]["status"] == "True"  # the operator's condition is left alone
        assert "scheduler" not in st  # blind: no knobs written
        assert "tuner.chunkpilot.io/finalizer" in kube.get("inferencedeployments", "default", "tuned")[
            "metadata"].get("finalizers", [])
        assert "tuning" not in (kube.get("inferencedeployments", "default", "plain").get("status") or {})
        def warnings():
            return [e for e in kube.objects("events") if e.get("reason") == "MeasurementsUnavailable"
                    and e.get("involvedObject", {}).get("name") == "tuned"]
        assert wait_for(warnings, 20)
        time.sleep(3)
        assert len(warnings()) == 1  # posted on the transition, not on every retry
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(40) == 0, (tmp_path / "tuner.log").read_text()[-3000:]


def test_publisher_posts_events_on_knob_changes_and_health_transitions():
    from chunkpilot.tuner.daemon import StatusPublisher
    from chunkpilot.tuner.state import TunerState

    posted = []
    pub = StatusPublisher(writer=None, config=None, metrics=None, post_event=lambda *e: posted.append(e))
    state = TunerState(mode="auto", current=Knobs(128, 64), last_change="t1")
    pub._events(state)
    pub._events(state)  # nothing new: nothing posted
    state.healthy, state.reason = False, "Prometheus did not answer"
    pub._events(state)
    state.healthy = True
    state.current, state.last_change = Knobs(96, 32), "t2"
    pub._events(state)
    assert [(t, r) for t, r, _ in posted] == [("Normal", "KnobsTuned"), ("Warning", "MeasurementsUnavailable"),
                                              ("Normal", "MeasurementsBack"), ("Normal", "KnobsTuned")]
    assert "token budget 96, max chunk 32" in posted[-1][2]

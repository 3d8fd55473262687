"""Cluster mode on the real API server (tests/control_plane.py): the tuner process, as the chart's ServiceAccount,
finds tuned InferenceDeployments, writes only its part of status, and holds when Prometheus is unreachable; the
status actuator writes knobs the operator picks up; the tuner puts no finalizer on resources, so deleting one
with the tuner stopped completes at once."""

from __future__ import annotations

import pytest

from chunkpilot.api.types import Condition, TuningStatus
from chunkpilot.kube.client import Kube
from chunkpilot.tuner.daemon import ClusterConfig, StatusActuator, StatusWriter, start_knobs, tuning_config
from chunkpilot.tuner.space import Knobs

from ..conftest import service_account_user
from ..engine.server_proc import wait_for
from ..operator.operator_proc import Cluster, sample, tuner
from ..waiting import consistently

CLUSTER = ClusterConfig(prometheus_url="http://127.0.0.1:1", storage=":memory:")
TUNER = service_account_user("tuner")


@pytest.fixture
def k(control_plane, request):
    cluster = Cluster(control_plane.api())
    ns = cluster.namespace(f"tuner-{request.node.name.replace('_', '-')[5:40].strip('-')}")
    cluster.ns = ns
    yield cluster
    assert cluster.delete_namespace(ns, drop_finalizers=True)


def test_tuning_config_follows_the_spec_and_fingerprints_the_targets():
    spec = sample("x")["spec"]
    c = tuning_config("ns", "x", spec, CLUSTER)
    assert c.settings.mode == "auto" and c.slo.itl is not None and c.deployment.startswith("ns/x@")
    assert c.budget_bounds[0] >= spec["engine"]["maxNumSeqs"]
    assert c.settings.apply_timeout == 30  # a push and its acknowledgement take about a second
    spec["slo"]["itl"]["thresholdSeconds"] = 0.5
    assert tuning_config("ns", "x", spec, CLUSTER).deployment != c.deployment  # new targets: new study
    spec["slo"] = {}
    with pytest.raises(ValueError, match="spec.slo"):
        tuning_config("ns", "x", spec, CLUSTER)


@pytest.mark.parametrize("change", [
    {"tuning": {"bounds": {"tokenBudget": {"min": 8, "max": 1024}}}},   # below maxNumSeqs: the engine refuses it
    {"scheduler": {"tokenBudget": 8, "maxChunk": 8}},
    {"tuning": {"bounds": {"tokenBudget": {"min": 64, "max": 128}, "maxChunk": {"min": 256, "max": 512}}}},
    {"slo": {}},
], ids=["bounds-below-seqs", "budget-below-seqs", "chunk-over-budget", "no-slo"])
def test_the_tuner_holds_what_the_operator_refuses_with_the_same_message(change):
    """One rule (chunkpilot.api.types.knob_refusal): the tuner holds, not clamps, a budget bound the operator
    refuses."""
    from chunkpilot.api import InferenceDeployment
    from chunkpilot.operator.builders import SpecError, validate

    obj = sample("x")
    for key, value in change.items():
        obj["spec"][key] = {**obj["spec"].get(key, {}), **value} if value else value
    with pytest.raises(SpecError) as refused:
        validate(InferenceDeployment.model_validate(obj))
    with pytest.raises(ValueError) as held:
        tuning_config("ns", "x", obj["spec"], CLUSTER)
    assert str(held.value) == str(refused.value)


def test_the_tuners_knobs_are_newer_than_any_before_and_applied_means_every_pod_acknowledged(k):
    """The tuner counts its generation from the knobs the pods should run now (api.types.desired_knobs: the spec's
    under metadata.generation here), so no pod's acknowledgement of older knobs passes for its own; and "applied"
    is the operator's record in status.knobs, read from the API."""
    ns = k.ns
    k.create(sample("race", ns))
    start, gen = start_knobs(k.get("inferencedeployments", ns, "race"))
    assert (start, gen) == (Knobs(128, 64), 1)  # the spec's, as the operator delivers them
    act = StatusActuator(StatusWriter(Kube(k.api), ns, "race"), start, gen)
    assert act.apply(Knobs(96, 32)) == 2
    assert k.status(ns, "race")["scheduler"] == {"tokenBudget": 96, "maxChunk": 32, "source": "tuner",
                                                 "generation": 2}

    def operator_reports(ready: int, *acks) -> None:  # what the operator writes after its pushes
        pods = [{"pod": f"p{i}", "tokenBudget": b_, "maxChunk": c, "generation": g} for i, (b_, c, g) in enumerate(acks)]
        k.patch("race", {"status": {"readyReplicas": ready, "knobs": {
            "tokenBudget": 96, "maxChunk": 32, "generation": 2, "source": "tuner", "pods": pods}}}, ns, status=True)
    assert not act.applied(2)  # nothing delivered yet
    operator_reports(2, (96, 32, 2), (128, 64, 1))
    assert not act.applied(2)  # one pod still runs the spec's
    operator_reports(2, (96, 32, 2))
    assert not act.applied(2)  # one ready pod has not answered
    operator_reports(2, (96, 32, 2), (96, 32, 2))
    assert act.applied(2)
    assert act.apply(Knobs(64, 32)) == 3 and not act.applied(3)


def test_status_actuator_writes_tuner_knobs_and_keeps_other_conditions(k):
    ns = k.ns
    k.create(sample("act", ns))
    # status.scheduler as an operator before one-writer left it (source spec, its own generation count)
    k.patch("act", {"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "AllReplicasReady"}],
                               "scheduler": {"tokenBudget": 128, "maxChunk": 64, "source": "spec",
                                             "generation": 3}}}, ns, status=True)
    raw = k.get("inferencedeployments", ns, "act")
    start, gen = start_knobs(raw)
    assert (start, gen) == (Knobs(128, 64), 4)  # metadata.generation 1 + the 3 already used
    writer = StatusWriter(Kube(k.api), ns, "act")
    act = StatusActuator(writer, start, gen)
    assert act.apply(Knobs(96, 32)) == 5
    st = k.status(ns, "act")
    assert st["scheduler"] == {"tokenBudget": 96, "maxChunk": 32, "source": "tuner", "generation": 5}
    writer.write(tuning=TuningStatus(phase="Exploring"),
                 tuner_conditions=[Condition(type="Tuning", status="True", reason="Exploring")])
    conds = {c["type"]: c for c in k.status(ns, "act")["conditions"]}
    assert conds["Ready"]["status"] == "True" and conds["Tuning"]["reason"] == "Exploring"
    assert k.status(ns, "act")["tuning"]["phase"] == "Exploring"
    # with SLO classes, each class's measurement: the API server's schema takes it as the tuner writes it
    from chunkpilot.contract.slo import SLOClass, SLOClasses, SLOTargets
    from chunkpilot.tuner.measurement import Window, class_windows
    from chunkpilot.tuner.state import status_slo

    classes = SLOClasses((SLOClass("chat", 10, SLOTargets.p99(ttft=3.0, itl=0.5)), SLOClass("spare", -1)), "chat")
    w = Window(seconds=60, requests=10, request_rate=0.2, output_tokens_per_s=5.0, goodput=0.15, ttft=1.0,
               itl=0.2, classes=class_windows(classes, {"chat": dict(ttft=1.0, itl=0.2, finished=10, met=9)}))
    from chunkpilot.tuner.state import TunerState, conditions

    state = TunerState(mode="auto", current=start, current_window=w)
    writer.write(slo=status_slo(w, classes.get("chat").slo), tuner_conditions=conditions(state, classes.get("chat").slo))
    st = k.status(ns, "act")
    assert st["slo"]["classes"] == [
        {"name": "chat", "ttftSeconds": 1.0, "itlSeconds": 0.2, "attainment": 0.9, "met": True}, {"name": "spare"}]
    assert {c["type"]: c["status"] for c in st["conditions"]} == {
        "Ready": "True", "Tuning": "True", "SLOMet": "True", "SLOMet.chat": "True", "SLOMet.spare": "Unknown"}
    # a class that is gone takes its condition with it; the operator's stay
    fewer = SLOClasses((SLOClass("chat", 10, SLOTargets.p99(ttft=3.0, itl=0.5)),), "chat")
    state.current_window = Window(**{**w.__dict__, "classes": class_windows(fewer, {"chat": dict(ttft=9.0, itl=0.2,
                                                                                               finished=4, met=1)})})
    writer.write(tuner_conditions=conditions(state, fewer.get("chat").slo))
    assert {c["type"]: c["status"] for c in k.status(ns, "act")["conditions"]} == {
        "Ready": "True", "Tuning": "True", "SLOMet": "False", "SLOMet.chat": "False"}
    # a failure's report writes Tuning alone: the classes' conditions stay
    writer.write(tuner_conditions=[Condition(type="Tuning", status="False", reason="MeasurementsUnavailable")])
    assert {c["type"] for c in k.status(ns, "act")["conditions"]} == {"Ready", "Tuning", "SLOMet", "SLOMet.chat"}
    # and without classes any more, status.slo.classes goes
    writer.write(slo=status_slo(Window(**{**w.__dict__, "classes": ()}), classes.get("chat").slo))
    assert "classes" not in k.status(ns, "act")["slo"]


def test_tuner_process_holds_when_prometheus_is_unreachable(k, control_plane, chart_accounts, tmp_path):
    ns = k.ns
    k.create(sample("tuned", ns))  # auto mode
    k.create(sample("plain", ns, tuning__mode="off"))
    k.create(sample("second", ns))  # tuned too: deleted below while the tuner runs
    k.patch("tuned", {"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "AllReplicasReady"}]}},
            ns, status=True)
    mark = control_plane.audit_mark()
    with tuner(chart_accounts["tuner"], tmp_path) as proc:
        def tuning():
            return k.status(ns, "tuned").get("tuning") or {}
        assert wait_for(lambda: tuning().get("phase") == "Holding", 60, poll=0.25), proc.log()
        st = k.status(ns, "tuned")
        conds = {c["type"]: c for c in st["conditions"]}
        assert conds["Tuning"]["status"] == "False" and conds["Tuning"]["reason"] == "MeasurementsUnavailable"
        assert "127.0.0.1:1" in conds["Tuning"]["message"]
        assert conds["Ready"]["status"] == "True"  # the operator's condition is left alone
        assert "scheduler" not in st  # blind: no knobs written
        assert not k.get("inferencedeployments", ns, "tuned")["metadata"].get("finalizers")
        assert "tuning" not in k.status(ns, "plain")

        def warnings():
            return [e for e in k.events(ns, "tuned") if e[1] == "MeasurementsUnavailable"]
        assert wait_for(warnings, 20, poll=0.25)

        def holds_published() -> int:
            """The tuner's status writes to "tuned" since it started: one per hold (each publishes the Holding
            status, after posting any Event), the first of which posted the warning."""
            return sum(1 for e in control_plane.audit(TUNER, mark) if e.get("verb") == "patch"
                       and e.get("objectRef", {}).get("name") == "tuned"
                       and e.get("objectRef", {}).get("subresource") == "status"
                       and e.get("responseStatus", {}).get("code", 0) < 300)
        # posted on the transition, not on every retry: the first hold and two retries after it (the pause doubles
        # from 2 s, so about 14 s from the first hold)
        consistently(lambda: len(warnings()) == 1, until=lambda: holds_published() >= 3, timeout=45, poll=0.25,
                     what="one MeasurementsUnavailable warning over three holds")
        # Deleting a tuned resource stops its tuning thread.
        k.custom.delete_namespaced_custom_object("chunkpilot.io", "v1alpha1", ns, "inferencedeployments", "second")
        assert wait_for(lambda: k.get("inferencedeployments", ns, "second") is None, 10, poll=0.25), proc.log()
        assert proc.stop() == 0, proc.log()
    # With the tuner down (or uninstalled), deleting a tuned resource is not blocked by anything of the tuner's.
    k.custom.delete_namespaced_custom_object("chunkpilot.io", "v1alpha1", ns, "inferencedeployments", "tuned")
    assert wait_for(lambda: k.get("inferencedeployments", ns, "tuned") is None, 10, poll=0.25)


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


def test_a_scale_written_against_a_stale_read_is_refused_by_the_api_server(k):
    """The tuner decides on a count read before its window and writes it with that read's resourceVersion: on the
    real API server the scale subresource refuses it (409) once someone else scaled meanwhile, and the tuner's
    StatusScaler reports it as not written."""
    from chunkpilot.tuner.daemon import StatusScaler

    ns = k.ns
    k.create(sample("raced", ns, replicas=2))
    scaler = StatusScaler(Kube(k.api), ns, "raced")
    before = scaler.replicas()
    assert before.spec == 2 and before.version
    Kube(k.api).scale_inference_deployment(ns, "raced", 0)  # a person scales to zero during the window
    assert scaler.scale(3, before.version) is False
    assert k.get("inferencedeployments", ns, "raced")["spec"]["replicas"] == 0
    now = scaler.replicas()
    assert scaler.scale(1, now.version) is True
    assert k.get("inferencedeployments", ns, "raced")["spec"]["replicas"] == 1


def test_autoscaling_writes_the_scale_subresource_and_refuses_auto_under_an_hpa(k, chart_accounts, tmp_path):
    """Auto mode on the real API server, as the chart's ServiceAccount (whose role grants inferencedeployments/scale
    and not the spec): replicas below minReplicas are raised through the scale subresource even while Prometheus is
    unreachable; a resource an HPA targets is left alone, with Autoscaling=False/ConflictingAutoscaler and a
    Warning."""
    import kubernetes

    ns = k.ns
    scaling = {"mode": "auto", "minReplicas": 2, "maxReplicas": 3}
    k.create(sample("scaled", ns, replicas=1, autoscaling=scaling))
    k.create(sample("contested", ns, replicas=1, autoscaling=scaling))
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "contested-hpa", "namespace": ns},
           # the HPA's own minReplicas is 1, so without metrics it leaves the replicas at 1 itself
           "spec": {"scaleTargetRef": {"apiVersion": "chunkpilot.io/v1alpha1", "kind": "InferenceDeployment",
                                       "name": "contested"}, "minReplicas": 1, "maxReplicas": 5,
                    "metrics": [{"type": "External", "external": {
                        "metric": {"name": "chunkpilot:tuner_desired_replicas"},
                        "target": {"type": "AverageValue", "averageValue": "1"}}}]}}
    kubernetes.client.AutoscalingV2Api(k.api).create_namespaced_horizontal_pod_autoscaler(ns, hpa)
    # an HPA on the operator's Deployment of the resource fights over the same replicas
    k.create(sample("deployed", ns, replicas=1, autoscaling=scaling))
    on_child = {**hpa, "metadata": {"name": "child-hpa", "namespace": ns},
                "spec": {**hpa["spec"], "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                                           "name": "deployed"}}}
    kubernetes.client.AutoscalingV2Api(k.api).create_namespaced_horizontal_pod_autoscaler(ns, on_child)
    with tuner(chart_accounts["tuner"], tmp_path) as proc:
        def replicas(name):
            return k.get("inferencedeployments", ns, name)["spec"]["replicas"]
        assert wait_for(lambda: replicas("scaled") == 2, 60, poll=0.25), proc.log()
        assert wait_for(lambda: k.cond(ns, "contested", "Autoscaling").get("reason") == "ConflictingAutoscaler", 60,
                        poll=0.25), proc.log()
        cond = k.cond(ns, "contested", "Autoscaling")
        assert cond["status"] == "False" and "contested-hpa" in cond["message"]
        assert "contested-hpa" in k.status(ns, "contested")["autoscaling"]["reason"]
        assert wait_for(lambda: any(e[:2] == ("Warning", "ConflictingAutoscaler") for e in k.events(ns, "contested")),
                        20, poll=0.25)
        assert wait_for(lambda: any(e[:2] == ("Normal", "Scaled") for e in k.events(ns, "scaled")), 20, poll=0.25)
        st = k.status(ns, "scaled")["autoscaling"]
        assert st["desiredReplicas"] == 2 and "outside [2, 3]" in st["reason"], st
        assert replicas("contested") == 1  # the tuner never wrote it
        assert wait_for(lambda: "the Deployment of this InferenceDeployment" in
                        k.cond(ns, "deployed", "Autoscaling").get("message", ""), 60, poll=0.25), proc.log()
        assert replicas("deployed") == 1
        assert proc.stop() == 0, proc.log()

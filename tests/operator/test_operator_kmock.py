"""The operator process (`chunkpilot operator run`, real kopf) against an emulated API server.

Why kmock: the Kubernetes API server cannot be installed on these machines. kmock serves real HTTP and real watch
streams and keeps objects; `kube_emulator.StampingEmulator` adds uid/resourceVersion/generation and status
subresource semantics. What no emulator has is controllers: the tests play the Deployment controller by writing
Deployment status themselves, and garbage collection of owned objects is left to the real cluster (e2e test)."""

from __future__ import annotations

import json
import signal
import time

import pytest

from ..engine.server_proc import wait_for
from .kube_emulator import KubeEmulatorThread
from .operator_proc import OperatorProcess, client, create, patch, sample

CHILDREN = ("configmaps", "deployments", "services", "poddisruptionbudgets")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with KubeEmulatorThread() as kube:
        op = OperatorProcess(kube, tmp_path_factory.mktemp("operator")).start()
        api = client(kube)
        yield kube, op, api
        assert op.alive(), f"the operator died on user input:\n{op.log()[-3000:]}"
        assert op.stop() == 0, op.log()[-3000:]


def events(kube, name: str) -> list[tuple[str, str, str]]:
    return [(e.get("type"), e.get("reason"), e.get("message")) for e in kube.objects("events")
            if e.get("involvedObject", {}).get("name") == name]


def cond(kube, name: str, type_: str, ns: str = "default") -> dict:
    obj = kube.get("inferencedeployments", ns, name) or {}
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def knobs(kube, name: str) -> dict:
    cm = kube.get("configmaps", "default", f"{name}-knobs")
    return json.loads(cm["data"]["knobs.json"]) if cm else {}


def ready(kube, name: str) -> bool:
    return all(kube.get(p, "default", name if p != "configmaps" else f"{name}-knobs") for p in CHILDREN)


def test_create_renders_every_object_with_owner_references(cluster):
    kube, op, api = cluster
    owner = create(api, sample("alpha"))
    assert wait_for(lambda: ready(kube, "alpha"), 30), op.log()[-3000:]
    for plural in CHILDREN:
        obj = kube.get(plural, "default", "alpha" if plural != "configmaps" else "alpha-knobs")
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "InferenceDeployment", "alpha", owner["metadata"]["uid"], True)
    assert knobs(kube, "alpha") == {"token_budget": 128, "max_chunk": 64, "generation": 1}
    assert wait_for(lambda: cond(kube, "alpha", "Ready").get("reason") == "ReplicasNotReady", 10)
    status = kube.get("inferencedeployments", "default", "alpha")["status"]
    assert status["scheduler"] == {"tokenBudget": 128, "maxChunk": 64, "source": "spec", "generation": 1}
    assert status["observedGeneration"] == 1 and "app.kubernetes.io/instance=alpha" in status["selector"]
    assert wait_for(lambda: ("Normal", "Created", "created Deployment alpha") in events(kube, "alpha"), 10)
    # The sample asks for a ServiceMonitor; this cluster has no Prometheus Operator CRD: a Warning, no object.
    assert any(r == "ServiceMonitorUnavailable" for _, r, _ in events(kube, "alpha"))
    assert kube.get("servicemonitors", "default", "alpha") is None

    # Level-triggered and idempotent: another pass (triggered by an unrelated label) writes nothing to children.
    mark = kube.mark()
    patch(api, "alpha", {"metadata": {"labels": {"team": "search"}}})
    time.sleep(2.0)
    assert [len(kube.writes(p, mark)) for p in CHILDREN] == [0, 0, 0, 0]


def test_knob_change_updates_only_the_configmap(cluster):
    kube, op, api = cluster
    create(api, sample("beta"))
    assert wait_for(lambda: ready(kube, "beta"), 30)
    template = kube.get("deployments", "default", "beta")["spec"]["template"]
    mark = kube.mark()
    patch(api, "beta", {"spec": {"scheduler": {"tokenBudget": 256, "maxChunk": 32}}})
    assert wait_for(lambda: knobs(kube, "beta") == {"token_budget": 256, "max_chunk": 32, "generation": 2}, 15)
    assert kube.writes("deployments", mark, "beta") == [], "a knob change must not touch the Deployment"
    assert kube.get("deployments", "default", "beta")["spec"]["template"] == template
    assert wait_for(lambda: kube.get("inferencedeployments", "default", "beta")["status"]["scheduler"]["generation"]
                    == 2, 10)
    assert wait_for(lambda: any(r == "KnobsChanged" and "generation 2" in m for _, r, m in events(kube, "beta")), 10)


def test_tuner_knobs_in_status_reach_the_configmap_and_are_kept(cluster):
    kube, op, api = cluster
    create(api, sample("gamma"))  # the sample has tuning.mode: auto
    assert wait_for(lambda: ready(kube, "gamma"), 30)
    tuned = {"tokenBudget": 96, "maxChunk": 48, "source": "tuner", "generation": 5}
    patch(api, "gamma", {"status": {"scheduler": tuned}}, status=True)
    assert wait_for(lambda: knobs(kube, "gamma") == {"token_budget": 96, "max_chunk": 48, "generation": 5}, 15)
    time.sleep(1.0)
    assert kube.get("inferencedeployments", "default", "gamma")["status"]["scheduler"] == tuned
    # Tuning switched off: the spec's knobs come back with a newer generation, so pods can tell.
    patch(api, "gamma", {"spec": {"tuning": {"mode": "off"}}})
    assert wait_for(lambda: knobs(kube, "gamma") == {"token_budget": 128, "max_chunk": 64, "generation": 6}, 15)


def test_scaling_to_one_replica_removes_the_pdb(cluster):
    kube, op, api = cluster
    create(api, sample("eta"))
    assert wait_for(lambda: ready(kube, "eta"), 30)
    patch(api, "eta", {"spec": {"replicas": 1}})
    assert wait_for(lambda: kube.get("poddisruptionbudgets", "default", "eta") is None, 15)
    assert kube.get("deployments", "default", "eta")["spec"]["replicas"] == 1
    patch(api, "eta", {"spec": {"replicas": 3}})
    assert wait_for(lambda: kube.get("poddisruptionbudgets", "default", "eta") is not None, 15)


def test_image_change_rolls_the_deployment(cluster):
    kube, op, api = cluster
    create(api, sample("delta"))
    assert wait_for(lambda: ready(kube, "delta"), 30)
    before = kube.get("deployments", "default", "delta")["spec"]["template"]
    patch(api, "delta", {"spec": {"engine": {"image": "registry.example/engine:2"}}})

    def rolled():
        t = kube.get("deployments", "default", "delta")["spec"]["template"]
        return t["spec"]["containers"][0]["image"] == "registry.example/engine:2"
    assert wait_for(rolled, 15)
    after = kube.get("deployments", "default", "delta")["spec"]["template"]
    key = "chunkpilot.io/config-hash"
    assert after["metadata"]["annotations"][key] != before["metadata"]["annotations"][key]
    assert wait_for(lambda: any(r == "RollingUpdate" for _, r, _ in events(kube, "delta")), 10)
    assert knobs(kube, "delta")["generation"] == 1  # the knobs did not move


def test_deployment_status_drives_the_conditions(cluster):
    kube, op, api = cluster
    create(api, sample("epsilon"))
    assert wait_for(lambda: ready(kube, "epsilon"), 30)
    import kubernetes

    apps = kubernetes.client.AppsV1Api(api)
    gen = kube.get("deployments", "default", "epsilon")["metadata"]["generation"]
    apps.patch_namespaced_deployment_status("epsilon", "default", {"status": {
        "observedGeneration": gen, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2, "availableReplicas": 2,
        "conditions": [{"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}]}},
        _content_type="application/merge-patch+json")
    assert wait_for(lambda: cond(kube, "epsilon", "Ready").get("status") == "True", 15)
    assert cond(kube, "epsilon", "Progressing")["reason"] == "RolloutComplete"
    assert kube.get("inferencedeployments", "default", "epsilon")["status"]["readyReplicas"] == 2
    apps.patch_namespaced_deployment_status("epsilon", "default", {"status": {
        "readyReplicas": 1, "conditions": [{"type": "Progressing", "status": "False",
                                            "reason": "ProgressDeadlineExceeded", "message": "pod stuck pulling"}]}},
        _content_type="application/merge-patch+json")
    assert wait_for(lambda: cond(kube, "epsilon", "Degraded").get("reason") == "RolloutFailed", 15)
    assert cond(kube, "epsilon", "Ready")["status"] == "False"
    assert "pod stuck pulling" in cond(kube, "epsilon", "Degraded")["message"]


@pytest.mark.parametrize("name, override, reason, words", [
    ("bad-scheme", {"model__source": "s3://bucket/model"}, "InvalidSpec", "spec.model.source"),
    ("bad-budget", {"engine__maxNumSeqs": 300}, "InvalidSpec", "spec.scheduler.tokenBudget"),
    ("no-claim", {"model__source": "pvc://no-such-claim/smollm2"}, "MissingVolume", "no-such-claim"),
])
def test_invalid_spec_degrades_with_a_warning_and_creates_nothing(cluster, name, override, reason, words):
    kube, op, api = cluster
    create(api, sample(name, **override))
    assert wait_for(lambda: cond(kube, name, "Degraded").get("status") == "True", 15), op.log()[-3000:]
    assert cond(kube, name, "Degraded")["reason"] == reason and words in cond(kube, name, "Degraded")["message"]
    def warnings():
        return [m for t, r, m in events(kube, name) if t == "Warning" and r == reason]
    assert wait_for(lambda: warnings(), 10)
    time.sleep(1.0)  # the pass that wrote Degraded triggers another pass: it must not warn again
    assert len(warnings()) == 1 and words in warnings()[0]
    assert all(kube.get(p, "default", n) is None for p, n in
               [("deployments", name), ("services", name), ("configmaps", f"{name}-knobs")])
    assert op.alive()


def test_a_bad_update_leaves_the_running_objects_alone(cluster):
    kube, op, api = cluster
    create(api, sample("zeta"))
    assert wait_for(lambda: ready(kube, "zeta"), 30)
    mark = kube.mark()
    # A valid image change together with an invalid knob: nothing may be applied, not even the image.
    patch(api, "zeta", {"spec": {"engine": {"image": "x:2", "maxNumSeqs": 200}}})
    assert wait_for(lambda: cond(kube, "zeta", "Degraded").get("reason") == "InvalidSpec", 15)
    assert [len(kube.writes(p, mark)) for p in CHILDREN] == [0, 0, 0, 0]
    patch(api, "zeta", {"spec": {"engine": {"maxNumSeqs": 8}}})  # fixed: applied, condition clears
    assert wait_for(lambda: cond(kube, "zeta", "Degraded").get("status") == "False", 15)
    assert kube.get("deployments", "default", "zeta")["spec"]["template"]["spec"]["containers"][0]["image"] == "x:2"


def test_operator_restart_midway_converges_without_duplicates(tmp_path):
    n = 40
    with KubeEmulatorThread() as kube:
        api = client(kube)
        uids = {create(api, sample(f"r{i:02d}"))["metadata"]["uid"] for i in range(n)}
        op = OperatorProcess(kube, tmp_path).start()
        assert wait_for(lambda: len(kube.objects("deployments")) >= 3, 30), op.log()[-3000:]
        op.stop(signal.SIGKILL)  # no clean shutdown: mid-pass, some objects half-way
        partial = len(kube.objects("deployments"))
        op.start()
        assert wait_for(lambda: len(kube.objects("deployments")) == n and all(
            cond(kube, f"r{i:02d}", "Ready") for i in range(n)), 90), op.log()[-3000:]
        for plural in CHILDREN:
            objs = kube.objects(plural)
            assert len(objs) == n, (plural, len(objs))
            assert {o["metadata"]["ownerReferences"][0]["uid"] for o in objs} == uids
        assert op.stop() == 0
        print(f"killed with {partial}/{n} Deployments made; converged after restart")


def test_two_hundred_inference_deployments(tmp_path):
    n = 200
    with KubeEmulatorThread() as kube:
        api = client(kube)
        for i in range(n):
            create(api, sample(f"s{i:03d}", namespace=f"team-{i % 4}"))
        op = OperatorProcess(kube, tmp_path).start()
        t0 = time.monotonic()

        def done():
            ids = kube.objects("inferencedeployments")
            return len(kube.objects("deployments")) == n and all(
                (o.get("status") or {}).get("observedGeneration") == 1 for o in ids)
        assert wait_for(done, 240), op.log()[-3000:]
        elapsed = time.monotonic() - t0
        rss = op.peak_rss_mib()
        assert op.stop() == 0
        print(f"\n200 InferenceDeployments reconciled in {elapsed:.1f} s (from operator start, kopf start-up "
              f"included); operator peak RSS {rss:.0f} MiB")

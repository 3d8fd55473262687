"""Why engine pods do not come up, in the resource's own status (chunkpilot.operator.pod_trouble): pod statuses
as the kubelet and the scheduler write them."""

from __future__ import annotations

from chunkpilot.operator.conditions import Problem, deployment_conditions
from chunkpilot.operator.pod_trouble import engine_trouble, starting


def pod(name: str, *, containers=(), inits=(), conditions=(), deleting=False) -> dict:
    meta = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    return {"metadata": meta, "status": {"containerStatuses": list(containers), "initContainerStatuses": list(inits),
                                         "conditions": list(conditions)}}


def crash_looping(message: str, code: int = 1, restarts: int = 3) -> dict:
    return {"name": "engine", "ready": False, "restartCount": restarts,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
            "lastState": {"terminated": {"exitCode": code, "reason": "Error", "message": message}}}


RUNNING = {"name": "engine", "ready": True, "restartCount": 0, "state": {"running": {"startedAt": "x"}}}
LOADING = {"name": "engine", "ready": False, "restartCount": 0, "state": {"running": {"startedAt": "x"}}}


def test_a_crash_loop_names_the_container_and_the_end_of_its_log():
    log = "\n".join(["INFO loading"] * 50 + ["Traceback (most recent call last):", "  ...",
                                           "2026-12-04 12:00:01,123 ERROR chunkpilot.engine.serving.server: model "
                                           "failed to load from /models/m: SafetensorError: Error while deserializing "
                                           "header: incomplete metadata; exiting"])
    said = engine_trouble([pod("m-1", containers=[RUNNING]), pod("m-0", containers=[crash_looping(log)])])
    assert said.startswith("pod m-0: container engine CrashLoopBackOff; last exit 1: ")
    assert said.endswith("incomplete metadata; exiting")  # the error, not the top of the log
    # the same words at every crash (no time stamp, no restart count): one Event, not one per restart
    assert "2026-12-04" not in said and "ERROR chunkpilot.engine.serving.server: model failed" in said
    assert "back-off" not in said and len(said) < 800


def test_a_boxed_usage_error_is_named_by_its_content_not_its_bottom_edge():
    """Seen on the real node: typer printed the engine's usage error in a rich box, and the status said only
    "last exit 2: ╰────╯"."""
    log = "\n".join(["Usage: chunkpilot engine serve [OPTIONS]",
                     "Try 'chunkpilot engine serve --help' for help.",
                     "╭─ Error ──────────────────────────────────────────╮",
                     "│ Invalid value for '--model': Directory '/models'  │",
                     "│ is not readable.                                  │",
                     "╰───────────────────────────────────────────────────╯"])
    said = engine_trouble([pod("m-0", containers=[crash_looping(log, code=2)])])
    assert said == ("pod m-0: container engine CrashLoopBackOff; last exit 2: Error: Invalid value for '--model': "
                    "Directory '/models' is not readable."), said


def test_image_pulls_init_containers_and_unschedulable_pods_are_named():
    pull = {"name": "engine", "ready": False, "restartCount": 0,
            "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x:1"'}}}
    assert engine_trouble([pod("a", containers=[pull])]) == \
        'pod a: container engine ImagePullBackOff (Back-off pulling image "x:1")'
    download = {**crash_looping("HubDownloadError: 401 Unauthorized: set HF_TOKEN"), "name": "model-download"}
    said = engine_trouble([pod("a", inits=[download], containers=[LOADING])])
    assert said.startswith("pod a: init container model-download CrashLoopBackOff; last exit 1: HubDownloadError")
    unplaced = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."}
    assert engine_trouble([pod("a", conditions=[unplaced])]) == \
        "pod a: Unschedulable (0/1 nodes are available: 1 Insufficient nvidia.com/gpu.)"


def test_nothing_is_wrong_while_pods_load_or_serve_or_stop():
    assert engine_trouble([]) is None
    assert engine_trouble([pod("a", containers=[RUNNING]), pod("b", containers=[LOADING])]) is None
    # a pod being deleted stops its containers on purpose
    assert engine_trouble([pod("a", containers=[crash_looping("killed")], deleting=True)]) is None
    # restarted once, now running and ready: recovered
    recovered = {**crash_looping("x"), "ready": True, "state": {"running": {"startedAt": "y"}}}
    assert engine_trouble([pod("a", containers=[recovered])]) is None


def test_the_operator_looks_again_while_containers_start():
    assert starting([pod("a", containers=[LOADING])])
    assert starting([pod("a", containers=[crash_looping("x")])])
    done = {"name": "model-download", "ready": False, "state": {"terminated": {"exitCode": 0}}}
    assert not starting([pod("a", inits=[done], containers=[RUNNING])])
    # created, its containers not yet: their start moves no Deployment field (seen on the real node: the operator
    # stopped looking, and a crashing engine went unnamed until the resync)
    assert starting([pod("a")])
    assert starting([pod("a", conditions=[{"type": "PodScheduled", "status": "True"}])])
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes"}
    assert not starting([pod("a", conditions=[unschedulable])])  # the scheduler's to wait on; engine_trouble says it
    assert not starting([pod("a", containers=[LOADING], deleting=True)])


def test_the_ready_and_degraded_conditions_carry_the_engines_failure():
    deploy = {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1}}
    problem = Problem("EngineFailing", "pod m-0: container engine CrashLoopBackOff; last exit 1: boom")
    ready, _, degraded = deployment_conditions(deploy, 1, 1, problem)
    assert (ready.status, ready.reason) == ("False", "ReplicasNotReady")
    assert ready.message == "0/1 engine pods ready: pod m-0: container engine CrashLoopBackOff; last exit 1: boom"
    assert (degraded.status, degraded.reason, degraded.message) == ("True", "EngineFailing", problem.message)


def test_a_volume_the_kubelet_cannot_mount_is_named_from_its_event():
    """A missing Secret, ConfigMap or claim leaves the containers in ContainerCreating, which says nothing; the
    kubelet's FailedMount Event says why. Only pods still waiting count: an old Event of a pod that started since
    is not news."""
    from chunkpilot.operator.pod_trouble import creating, mount_trouble

    def pod(name, reason):
        return {"metadata": {"name": name}, "status": {"containerStatuses": [
            {"name": "engine", "ready": False, "state": {"waiting": {"reason": reason}} if reason else
             {"running": {}}}]}}

    def event(pod_name, at, message):
        return {"reason": "FailedMount", "involvedObject": {"kind": "Pod", "name": pod_name}, "lastTimestamp": at,
                "message": message}
    pods = [pod("a", "ContainerCreating"), pod("b", None)]
    assert creating(pods) == ["a"]
    events = [event("a", "2026-12-06T10:00:00Z", 'MountVolume.SetUp failed for volume "admin-token" : old'),
              event("a", "2026-12-06T10:00:09Z",
                    'MountVolume.SetUp failed for volume "admin-token" :\n secret "x-knobs-token" not found'),
              event("b", "2026-12-06T10:00:10Z", "b started since")]
    assert mount_trouble(pods, events) == ('pod a: FailedMount (MountVolume.SetUp failed for volume "admin-token" : '
                                           'secret "x-knobs-token" not found)')
    assert mount_trouble([pod("a", None)], events) is None  # started since
    assert mount_trouble(pods, []) is None

"""The cluster tuner (`daemon.tune_one`, as the chart's tuner ServiceAccount) on the real kube-apiserver, under
faults: killed mid-trial and started again, it makes the decisions the uninterrupted tuner made, writes no knobs
nobody decided and counts no trial twice; with its study storage read-only, it says so in the Tuning condition and
an Event, moves nothing and goes on when the storage works again.

What is real: the API server and its status subresource, the tuner's code path from reading the resource to
writing `status.scheduler` and waiting on `status.knobs`, the study on SQLite. What the test plays: the operator
and one ready pod (each "wait" delivers the desired knobs, `api.types.desired_knobs`, and acknowledges them in
`status.knobs`, as the operator does after a push) and Prometheus (a window computed from the acknowledged knobs,
tests/tuner/test_tuner_core.window). A "kill" is a BaseException raised inside the measurement, which the tuner's
retry (`except Exception`) does not catch: the thread dies with its trial left RUNNING in the study, as under
SIGKILL."""

from __future__ import annotations

import logging
import threading

import kopf
import kubernetes
import pytest

from chunkpilot.api.types import InferenceDeployment, KnobsStatus, PodKnobs, desired_knobs
from chunkpilot.kube.client import Kube
from chunkpilot.tuner import daemon
from chunkpilot.tuner.retry import Backoff
from chunkpilot.tuner.space import Knobs
from chunkpilot.tuner.study import TunerStudy

from ..operator.operator_proc import Cluster, sample
from ..engine.server_proc import wait_for
from ..waiting import consistently
from .test_tuner_core import Killed, window

NS = "tuner-restart"


class OperatorAndPods:
    """The measurer the tuner gets: time passing (the operator delivers and the pod acknowledges) and windows of
    the knobs the pod runs. `die_at`: the measurement that kills the tuner; `stop_after`: the one after which the
    tuner is asked to stop (it ends its iteration)."""

    def __init__(self, admin: Cluster, name: str, stopped: threading.Event, *, die_at: int | None = None,
                 stop_after: int | None = None, delivered: list | None = None) -> None:
        self.admin, self.name, self.stopped = admin, name, stopped
        self.die_at, self.stop_after = die_at, stop_after
        self.delivered = [] if delivered is None else delivered  # (budget, chunk, generation) in delivery order
        self.measures = 0

    def _resource(self) -> dict:
        return self.admin.custom.get_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS,
                                                              "inferencedeployments", self.name)

    def _running(self) -> Knobs:
        return KnobsStatus.model_validate(self._resource()["status"]["knobs"]).scheduler_knobs.knobs

    def check(self) -> None:
        pass

    def wait(self, seconds: float) -> None:
        raw = self._resource()
        want, source = desired_knobs(InferenceDeployment.model_validate(raw))
        have = (raw.get("status") or {}).get("knobs")
        if have and KnobsStatus.model_validate(have).scheduler_knobs == want:
            return
        self.delivered.append((want.token_budget, want.max_chunk, want.generation))
        ack = KnobsStatus(token_budget=want.token_budget, max_chunk=want.max_chunk, generation=want.generation,
                          source=source, applied_replicas=1,
                          pods=[PodKnobs(pod=f"{self.name}-0", token_budget=want.token_budget,
                                         max_chunk=want.max_chunk, generation=want.generation)])
        self.admin.patch(self.name, {"status": {"knobs": ack.model_dump(by_alias=True, exclude_none=True),
                                                "readyReplicas": 1}}, NS, status=True)

    def measure(self, seconds: float):
        self.measures += 1
        if self.measures == self.die_at:
            raise Killed()
        if self.measures == self.stop_after:
            self.stopped.set()
        return window(self._running(), seconds=seconds)


@pytest.fixture(scope="module")
def admin(control_plane, chart_accounts):
    k = Cluster(control_plane.api())
    k.namespace(NS)
    yield k
    assert k.delete_namespace(NS)


def tuner_kube(chart_accounts) -> Kube:
    return Kube(kubernetes.config.new_client_from_config(config_file=str(chart_accounts["tuner"])))


def run_tuner(chart_accounts, admin, name, storage, *, stopped=None, events=None,
              **measurer) -> OperatorAndPods:
    """One tuner process's life for `name`: until the measurer stops it (returns) or kills it (Killed), or
    `stopped` is set. Events the tuner posts are appended to `events` as (type, reason, message)."""
    raw = admin.custom.get_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS, "inferencedeployments", name)
    stopped = stopped or threading.Event()
    pods = OperatorAndPods(admin, name, stopped, **measurer)
    events = [] if events is None else events
    # a fixed seed for both resources: without one each deployment's name seeds its sampler (study._ask_seed)
    memo = kopf.Memo(kube=tuner_kube(chart_accounts), metrics=None,
                     cluster=daemon.ClusterConfig(prometheus_url="http://prometheus.invalid", storage=storage, seed=3))
    sources = daemon.Sources(measurer=lambda selector, slo, sleep, classes: pods,
                             events=lambda raw: lambda type_, reason, message: events.append((type_, reason, message)),
                             backoff=lambda: Backoff(0.2, daemon.ERROR_BACKOFF_MAX))
    daemon.tune_one(NS, name, raw["metadata"]["uid"], memo, stopped, sources)
    return pods


def failed_iterations(caplog, name: str, since: int = 0) -> int:
    """The iterations of `name` that raised and were retried (tune_one logs each one), among caplog's records
    after the first `since`."""
    return sum(1 for r in caplog.records[since:] if r.name == daemon.__name__
               and f"{NS}/{name}: an iteration failed" in r.getMessage())


def told(storage: str, name: str, admin) -> list[tuple[int, int]]:
    """The trials the study holds as measured, in order."""
    raw = admin.custom.get_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS, "inferencedeployments", name)
    config = daemon.tuning_config(NS, name, raw["spec"], daemon.ClusterConfig(prometheus_url="x", storage=storage))
    study = TunerStudy(storage, config.deployment, config.space(), config.slo, config.settings.objective, seed=3)
    return [(r.knobs.token_budget, r.knobs.max_chunk) for r in study.records()]


def test_a_tuner_killed_mid_trial_on_the_api_server_decides_as_the_uninterrupted_one(
        admin, chart_accounts, tmp_path):
    for name in ("twin", "killed"):
        admin.create(sample(name, NS, tuning__maxTrials=12))
    twin_db, killed_db = f"sqlite:///{tmp_path / 'twin.db'}", f"sqlite:///{tmp_path / 'killed.db'}"

    twin = run_tuner(chart_accounts, admin, "twin", twin_db, stop_after=12)
    delivered: list = []  # what reached the killed tuner's pod, over both of its processes
    with pytest.raises(Killed):
        run_tuner(chart_accounts, admin, "killed", killed_db, die_at=6, delivered=delivered)
    at_kill = len(delivered)
    # a new process: the pod still runs what the killed one last wrote, and the study holds its running trial
    resumed = run_tuner(chart_accounts, admin, "killed", killed_db, stop_after=6, delivered=delivered)
    assert resumed.measures >= 6

    # the same knobs under the same generations: nothing delivered twice (the trial left running is measured
    # again at the knobs the pod runs, not written anew), nothing that the uninterrupted tuner did not decide
    n = min(len(delivered), len(twin.delivered))
    assert n >= at_kill + 2 and delivered[:n] == twin.delivered[:n], (twin.delivered, delivered)
    # the trials: the one killed counted once, then the twin's
    twin_told, killed_told = told(twin_db, "twin", admin), told(killed_db, "killed", admin)
    n = min(len(twin_told), len(killed_told))
    assert n >= 5 and killed_told[:n] == twin_told[:n], (twin_told, killed_told)


def test_a_read_only_study_storage_is_named_in_the_status_and_nothing_moves(admin, chart_accounts, tmp_path,
                                                                           caplog):
    """The study's SQLite file on a volume that went read-only (SQLite's own refusal: the file opened with
    mode=ro, as a read-only mount makes every write fail): the study opens, its first write fails, and the tuner
    reports Tuning=False (StudyStorageUnavailable) and a Warning Event once, keeps the knobs and retries."""
    name = "readonly"
    admin.create(sample(name, NS, tuning__maxTrials=12))
    db = tmp_path / "study.db"
    run_tuner(chart_accounts, admin, name, f"sqlite:///{db}", stop_after=3)  # a study with trials
    before = admin.custom.get_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS, "inferencedeployments",
                                                       name)["status"]["scheduler"]
    caplog.set_level(logging.WARNING, logger=daemon.__name__)  # where tune_one logs each failed iteration
    stopped, events, since = threading.Event(), [], len(caplog.records)
    tuner = threading.Thread(target=run_tuner, args=(chart_accounts, admin, name,
                                                     f"sqlite:///file:{db}?mode=ro&uri=true"),
                             kwargs={"stopped": stopped, "events": events}, daemon=True)
    tuner.start()
    try:
        def reported():
            st = admin.custom.get_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS, "inferencedeployments",
                                                           name)["status"]
            tuning = next((c for c in st.get("conditions") or [] if c["type"] == "Tuning"), {})
            return tuning.get("reason") == "StudyStorageUnavailable" and (st, tuning)
        assert wait_for(reported, 30, poll=0.2)
        st, tuning = reported()
        assert tuning["status"] == "False" and "readonly database" in tuning["message"]
        assert "check the tuner's volume" in tuning["message"]
        assert st["scheduler"] == before  # nothing moved
        # said once while it lasts: over the failure reported and two retries after it (each logged before the
        # retry's report would be posted, so the third one's record comes after the second one's Event)
        consistently(lambda: [r for _, r, _ in events].count("StudyStorageUnavailable") == 1,
                     until=lambda: failed_iterations(caplog, name, since) >= 3, timeout=15,
                     what="one StudyStorageUnavailable Event while the storage is read-only")
    finally:
        stopped.set()
        tuner.join(30)
    assert not tuner.is_alive()


@pytest.fixture
def small_volume(tmp_path):
    """A real filesystem of 4 MiB (tmpfs) to hold a study, so that it can really fill up. Mounting needs root, as
    the local cluster's kubelet does."""
    import os
    import subprocess

    mnt = tmp_path / "study-volume"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        why = f"a 4-MiB tmpfs could not be mounted (run as root, as the cluster tests do): {done.stderr.strip()}"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(volume) -> int:
    """Write zeros into `volume` until the filesystem refuses (ENOSPC); the bytes written."""
    import errno

    written = 0
    with open(volume / "filler", "wb", buffering=0) as f:
        try:
            while True:
                written += f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return written


def test_a_full_study_volume_is_named_in_the_status_and_the_tuner_goes_on_when_there_is_room(
        admin, chart_accounts, small_volume, caplog):
    """The study's SQLite file on a real filesystem that fills up while the tuner runs: its next write fails with
    SQLite's "database or disk is full", the tuner reports Tuning=False (StudyStorageUnavailable) and one Warning
    Event, keeps the knobs and retries; once there is room it records trials again, the earlier ones intact and
    none counted twice."""
    name = "fulldisk"
    admin.create(sample(name, NS, tuning__maxTrials=12))
    storage = f"sqlite:///{small_volume / 'study.db'}"
    run_tuner(chart_accounts, admin, name, storage, stop_after=3)  # a study with trials
    earlier = told(storage, name, admin)
    before = admin.custom.get_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS, "inferencedeployments",
                                                       name)["status"]["scheduler"]
    assert len(earlier) >= 2 and fill(small_volume) > 0

    def tuning() -> tuple[dict, dict]:
        st = admin.custom.get_namespaced_custom_object("chunkpilot.io", "v1alpha1", NS, "inferencedeployments",
                                                       name)["status"]
        return st, next((c for c in st.get("conditions") or [] if c["type"] == "Tuning"), {})

    caplog.set_level(logging.WARNING, logger=daemon.__name__)  # where tune_one logs each failed iteration
    stopped, events, since = threading.Event(), [], len(caplog.records)
    tuner = threading.Thread(target=run_tuner, args=(chart_accounts, admin, name, storage),
                             kwargs={"stopped": stopped, "events": events, "stop_after": 6}, daemon=True)
    tuner.start()
    try:
        assert wait_for(lambda: tuning()[1].get("reason") == "StudyStorageUnavailable", 30, poll=0.2), tuning()
        st, cond = tuning()
        assert cond["status"] == "False" and "database or disk is full" in cond["message"], cond
        assert st["scheduler"] == before  # nothing moved while the study could not record it
        # said once while it lasts: over the failure reported and two retries after it
        consistently(lambda: [r for _, r, _ in events].count("StudyStorageUnavailable") == 1,
                     until=lambda: failed_iterations(caplog, name, since) >= 3, timeout=15,
                     what="one StudyStorageUnavailable Event while the volume is full")
        (small_volume / "filler").unlink()  # room again
        tuner.join(60)  # stop_after: it measures three more windows and stops
        assert not tuner.is_alive()
    finally:
        stopped.set()
        tuner.join(30)
    assert tuning()[1].get("reason") != "StudyStorageUnavailable", tuning()
    after = told(storage, name, admin)
    assert after[:len(earlier)] == earlier and len(after) > len(earlier), (earlier, after)

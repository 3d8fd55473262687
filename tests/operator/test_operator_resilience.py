"""The operator on the real API server when things go wrong or get big: drift in children it does not watch, its
own SIGKILL, the API server's SIGKILL, namespace deletion, 200 resources. Each test has its own namespace(s) and
its own operator process (stopped on failure too), as the chart's ServiceAccount."""

from __future__ import annotations

import base64
import json
import signal
import time
import urllib.request

import kubernetes
import pytest
from kubernetes.client import ApiException

from ..conftest import service_account_user
from .operator_proc import CHILDREN, Cluster, operator, sample
from ..waiting import eventually

OPERATOR = service_account_user("operator")


@pytest.fixture
def k(control_plane):
    return Cluster(control_plane.api(pool=16))


def converged(k: Cluster, namespaces: list[str], n: int) -> bool:
    items = [o for ns in namespaces for o in k.custom.list_namespaced_custom_object(
        "chunkpilot.io", "v1alpha1", ns, "inferencedeployments")["items"]]
    return len(items) == n and sum(k.count("deployments", ns) for ns in namespaces) == n and all(
        (o.get("status") or {}).get("observedGeneration") == o["metadata"]["generation"] for o in items)


def test_resync_repairs_children_nobody_watches_and_watches_reconnect(control_plane, chart_accounts, k, tmp_path):
    """The operator watches InferenceDeployments and its Deployments, not ConfigMaps or Services: a deleted knobs
    ConfigMap comes back through the periodic resync alone. With a 5 s resync the watches also reconnect every
    5 s (integer timeoutSeconds, continued from the last resourceVersion) and keep delivering changes."""
    ns = k.namespace("op-resync")
    with operator(chart_accounts["operator"], tmp_path, "--namespace", ns, "--resync", "5") as op:
        try:
            k.create(sample("drift", ns))
            assert eventually(lambda: k.children_exist(ns, "drift")), op.log()
            mark = control_plane.audit_mark()
            k.core.delete_namespaced_config_map("drift-knobs", ns)
            assert eventually(lambda: k.get("configmaps", ns, "drift-knobs") is not None, 20), op.log()
            def watches() -> list[dict]:
                return [e for e in control_plane.audit(OPERATOR, mark) if e.get("verb") == "watch"
                        and e.get("stage") == "ResponseComplete"
                        and e["objectRef"].get("resource") == "inferencedeployments"]
            # each watch request ends after --resync seconds and is reopened
            assert eventually(lambda: len(watches()) >= 2, 20), watches()
            # whole seconds, and bookmarks asked for (they keep kopf's resourceVersion fresh between changes)
            assert all("timeoutSeconds=5&" in e["requestURI"] + "&" and "allowWatchBookmarks=true" in e["requestURI"]
                       for e in watches()), watches()[0]["requestURI"]
            k.patch("drift", {"spec": {"scheduler": {"tokenBudget": 200}}}, ns)  # after several reconnects
            assert eventually(lambda: k.knobs(ns, "drift").get("token_budget") == 200), op.log()
            assert op.alive()
        finally:
            op.stop()
            k.delete_namespace(ns)


def test_operator_sigkill_midway_converges_without_duplicates(chart_accounts, k, tmp_path):
    n, ns = 40, k.namespace("op-restart")
    try:
        uids = {k.create(sample(f"r{i:02d}", ns))["metadata"]["uid"] for i in range(n)}
        with operator(chart_accounts["operator"], tmp_path, "--namespace", ns) as op:
            assert eventually(lambda: k.count("deployments", ns) >= 3), op.log()
            op.stop(signal.SIGKILL)  # no clean shutdown: mid-pass, some objects half-way
            partial = k.count("deployments", ns)
            op.start()
            assert eventually(lambda: converged(k, [ns], n), 120), op.log()
            for plural in CHILDREN:
                assert k.count(plural, ns) == n, plural
            owners = {o.metadata.owner_references[0].uid for o in k.apps.list_namespaced_deployment(ns).items}
            assert owners == uids
            assert op.stop() == 0
        print(f"killed with {partial}/{n} Deployments made; converged after restart")
    finally:
        k.delete_namespace(ns)


def etcd_compact(control_plane) -> int:
    """Compact etcd at its current revision (its HTTP gateway), so every older resourceVersion is gone."""
    def call(path: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{control_plane.etcd_port}/v3/{path}",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=10).read())
    rev = int(call("kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"])
    call("kv/compaction", {"revision": rev, "physical": True})
    return rev


def test_apiserver_sigkill_mid_reconcile_then_restart_converges(control_plane, chart_accounts, k, tmp_path):
    """The API server dies (-9) while the operator works through 20 new resources and comes back on the same
    address; etcd was compacted meanwhile, so the operator's watch position has expired (410 Gone): it re-lists,
    and every resource converges, including one created after the restart."""
    n, ns = 20, k.namespace("op-crash")
    try:
        with operator(chart_accounts["operator"], tmp_path, "--namespace", ns) as op:
            for i in range(n):
                k.create(sample(f"c{i:02d}", ns))
            old_rv = k.custom.list_namespaced_custom_object("chunkpilot.io", "v1alpha1", ns,
                                                            "inferencedeployments")["metadata"]["resourceVersion"]
            assert eventually(lambda: k.count("deployments", ns) >= 2), op.log()
            mark = control_plane.audit_mark()  # kopf's first list is behind us; the restarted server appends
            control_plane.kill_apiserver()
            try:
                time.sleep(2)
                etcd_compact(control_plane)
            finally:  # the control plane is the session's: it comes back whatever happens here
                control_plane.start_apiserver()
            # The operator's old position is gone: a watch from it is answered 410, which kopf answers by re-listing.
            w = kubernetes.watch.Watch()
            with pytest.raises(ApiException) as gone:
                for _ in w.stream(k.custom.list_namespaced_custom_object, "chunkpilot.io", "v1alpha1", ns,
                                  "inferencedeployments", resource_version=old_rv, timeout_seconds=5):
                    pass
            assert gone.value.status == 410
            k.create(sample("after", ns))
            assert eventually(lambda: converged(k, [ns], n + 1), 120), op.log()
            relists = [e for e in control_plane.audit(OPERATOR, mark) if e.get("verb") == "list"
                       and e["objectRef"].get("resource") == "inferencedeployments"]
            assert relists, "kopf re-lists after its watch position expired"
            assert op.alive(), op.log()
            assert op.stop() == 0
    finally:
        k.delete_namespace(ns)


def test_namespace_deletion_with_resources_in_it(chart_accounts, k, tmp_path):
    ns = k.namespace("op-nsdel")
    with operator(chart_accounts["operator"], tmp_path, "--namespace", ns) as op:
        for name in ("a", "b", "c"):
            k.create(sample(name, ns))
        assert eventually(lambda: converged(k, [ns], 3)), op.log()
        # The namespace controller deletes the resources, the garbage collector their children; the operator
        # holds no finalizer, so nothing waits for it.
        assert k.delete_namespace(ns, timeout=90), "namespace not deleted"
        assert op.alive(), op.log()


def test_two_hundred_inference_deployments(chart_accounts, k, tmp_path):
    """200 resources in 4 namespaces picked by a glob (kopf then lists and watches namespaces), all created
    before the operator starts; time from operator start to every status observed, and the operator's peak RSS."""
    n = 200
    namespaces = [k.namespace(f"op-scale-{j}") for j in range(4)]
    try:
        for i in range(n):
            k.create(sample(f"s{i:03d}", namespaces[i % 4]))
        t0 = time.monotonic()
        with operator(chart_accounts["operator"], tmp_path, "--namespace", "op-scale-*") as op:
            assert eventually(lambda: converged(k, namespaces, n), 300), op.log()
            elapsed = time.monotonic() - t0
            rss = op.peak_rss_mib()
            assert op.stop() == 0
        print(f"\n200 InferenceDeployments reconciled on a real API server in {elapsed:.1f} s (from operator "
              f"start, kopf start-up included); operator peak RSS {rss:.0f} MiB")
    finally:
        for ns in namespaces:
            k.core.delete_namespace(ns)
        for ns in namespaces:
            k.delete_namespace(ns, timeout=120)

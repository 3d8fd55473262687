"""The chart's RBAC is exactly what the code uses, proven on the real API server: the operator and the tuner run as
the chart's ServiceAccounts with the chart's rendered roles (tokens from the TokenRequest API) through every path
that touches a new kind of object. A verb the chart lacks fails there as a 403; the API server's audit log records
every request with its identity, and the set of (API group, resource, verb) each process used must equal the rules
the chart renders for it, but for the few rules listed below with the reason they cannot show up here."""

from __future__ import annotations

import copy
import time

import kubernetes
import pytest
import yaml

from ..conftest import service_account_user
from ..operator import gie
from ..operator.operator_proc import Cluster, operator, sample, tuner
from ..waiting import eventually
from .test_chart import docs, render

# Rules the chart grants that these runs cannot exercise, and why they are still needed.
NOT_EXERCISED = {
    ("", "secrets", "create"): "the admin token Secret is created by server-side apply, which the audit log records "
                               "as a patch; the API server also authorizes it as a create (without the verb: 403)",
    ("", "namespaces", "list"): "kopf lists namespaces only when --namespace is given (this run is cluster-wide; "
                                "tests/operator/test_operator_resilience.py runs the operator namespaced)",
    ("", "namespaces", "watch"): "kopf watches namespaces only when --namespace is given",
    ("", "events", "list"): "read only while an engine pod waits in ContainerCreating (FailedMount); no kubelet runs "
                           "pods here (tests/operator/test_pod_trouble.py, and the real node)",
    ("", "pods", "patch"): "the role labels of disaggregation mode auto's ready pods, moved when one switches roles; "
                           "no kubelet runs pods here (tests/cluster/test_disaggregation.py, as the chart's "
                           "ServiceAccount on the real node)",
    ("networking.k8s.io", "networkpolicies", "delete"): "pruned only when an operator restarted without "
                                                        "--engine-network-policy finds one of its NetworkPolicies",
    # what the endpoint picker's Role grants (spec.routing): the API server lets only a holder grant a permission
    # (RBAC's escalation prevention), so the operator holds what it never uses itself
    **{rule: "granted to spec.routing's endpoint picker, which only a holder may grant (escalation prevention)"
       for rule in [("", "pods", "get"), ("", "pods", "watch"),
                    ("inference.networking.k8s.io", "inferencepools", "list"),
                    ("inference.networking.k8s.io", "inferencepools", "watch"),
                    *(("inference.networking.x-k8s.io", r, v) for r in ("inferenceobjectives", "inferencemodelrewrites")
                      for v in ("get", "list", "watch"))]},
}
SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
             "names": {"kind": "ServiceMonitor", "plural": "servicemonitors", "singular": "servicemonitor",
                       "listKind": "ServiceMonitorList"},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                 "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


def chart_rules(component: str) -> set[tuple[str, str, str]]:
    out = set()
    for d in docs(render()):
        if d["kind"] == "ClusterRole" and d["metadata"]["name"] in (f"cp-chunkpilot-{component}",
                                                                    f"cp-chunkpilot-{component}-cluster"):
            for rule in d["rules"]:
                out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


def used(events: list[dict]) -> set[tuple[str, str, str]]:
    out = set()
    for e in events:
        ref = e.get("objectRef")
        if not ref or not ref.get("resource"):
            continue  # discovery and other non-resource URLs, open to every authenticated user
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        out.add((ref.get("apiGroup", ""), resource, e["verb"]))
    return out


@pytest.fixture
def service_monitor_crd(control_plane):
    ext = kubernetes.client.ApiextensionsV1Api(control_plane.api())
    ext.create_custom_resource_definition(SERVICE_MONITOR_CRD)
    assert eventually(lambda: any(c.type == "Established" and c.status == "True" for c in
                                  ext.read_custom_resource_definition(SERVICE_MONITOR_CRD["metadata"]["name"])
                                  .status.conditions or []))
    yield
    ext.delete_custom_resource_definition(SERVICE_MONITOR_CRD["metadata"]["name"])

    def gone() -> bool:
        try:
            ext.read_custom_resource_definition(SERVICE_MONITOR_CRD["metadata"]["name"])
            return False
        except kubernetes.client.ApiException as e:
            return e.status == 404
    assert eventually(gone), "the ServiceMonitor CRD must be gone before other tests (they expect none)"


@pytest.fixture
def gie_crds(control_plane):
    with gie.installed_crds(control_plane):
        yield


def test_roles_equal_the_api_calls_of_operator_and_tuner(control_plane, chart_accounts, service_monitor_crd,
                                                          gie_crds, tmp_path):
    k = Cluster(control_plane.api())
    ns = k.namespace("rbac")
    mark = control_plane.audit_mark()
    (tmp_path / "op").mkdir()
    (tmp_path / "tu").mkdir()
    with operator(chart_accounts["operator"], tmp_path / "op", "--engine-network-policy") as op, \
            tuner(chart_accounts["tuner"], tmp_path / "tu") as tu:
        try:
            k.create(sample("a", ns))  # replicas 2: PDB; serviceMonitor: true; tuning auto
            k.create(sample("b", ns, model__source="pvc://models/smollm2"))  # reads the PVC (missing: Degraded)
            # disaggregated, switched off below: the role Deployments and the prefill Service are deleted
            k.create(sample("e", ns, replicas=1, tuning={"mode": "off"}, disaggregation={"mode": "on"}))
            # autoscaling auto below its minReplicas: the tuner lists HPAs, then scales through /scale
            k.create(sample("d", ns, replicas=1, autoscaling={"mode": "auto", "minReplicas": 2, "maxReplicas": 2}))
            sm = ("monitoring.coreos.com", "v1", ns, "servicemonitors", "a")
            def monitor():
                try:
                    return k.custom.get_namespaced_custom_object(*sm)
                except kubernetes.client.ApiException:
                    return None
            assert eventually(lambda: monitor() is not None and k.children_exist(ns, "a")), op.log()
            assert eventually(lambda: k.cond(ns, "b", "Degraded").get("reason") == "MissingVolume")
            assert eventually(lambda: k.get("services", ns, "e-prefill") is not None
                              and k.get("deployments", ns, "e-decode") is not None), op.log()
            k.patch("e", {"spec": {"disaggregation": {"mode": "off"}}}, ns)
            assert eventually(lambda: k.get("services", ns, "e-prefill") is None
                              and k.get("deployments", ns, "e-decode") is None
                              and k.get("deployments", ns, "e") is not None), op.log()
            assert eventually(lambda: k.get("inferencedeployments", ns, "d")["spec"]["replicas"] == 2, 60), tu.log()
            routed_drift_and_removed(k, ns, op)
            # Someone edits what the operator owns: the next pass puts it back (a patch of each kind).
            svc = k.get("services", ns, "a")["spec"]["ports"][0]
            k.core.patch_namespaced_service("a", ns, {"spec": {"ports": [{"port": svc["port"], "targetPort": 1}]}})
            k.policy.patch_namespaced_pod_disruption_budget("a", ns, {"spec": {"maxUnavailable": 5}})
            k.custom.patch_namespaced_custom_object(*sm, {"spec": {"endpoints": []}})
            net = kubernetes.client.NetworkingV1Api(control_plane.api())
            net.patch_namespaced_network_policy("a", ns, {"spec": {"policyTypes": ["Ingress", "Egress"]}})
            k.patch("a", {"metadata": {"labels": {"poke": "1"}}}, ns)
            assert eventually(lambda: k.get("services", ns, "a")["spec"]["ports"][0]["targetPort"] != 1
                              and k.get("poddisruptionbudgets", ns, "a")["spec"]["maxUnavailable"] != 5
                              and monitor()["spec"]["endpoints"]
                              and net.read_namespaced_network_policy("a", ns).spec.policy_types == ["Ingress"]), \
                op.log()
            k.patch("a", {"spec": {"replicas": 1, "monitoring": {"serviceMonitor": False},
                                   "scheduler": {"tokenBudget": 256}}}, ns)
            assert eventually(lambda: k.get("poddisruptionbudgets", ns, "a") is None and monitor() is None)
            assert eventually(lambda: (k.status(ns, "a").get("tuning") or {}).get("phase") == "Holding", 60), \
                tu.log()
            # kopf posts Events from a queue of its own: wait for the tuner's before stopping it
            assert eventually(lambda: any(r == "MeasurementsUnavailable" for _, r, _ in k.events(ns, "a")))
            time.sleep(2)  # a few more passes, so steady-state calls are in the log too
        finally:
            op.stop()
            tu.stop()
            k.delete_namespace(ns)  # the tuner puts no finalizer on anything
    for component, proc in (("operator", op), ("tuner", tu)):
        granted = chart_rules(component)
        calls = used(control_plane.audit(service_account_user(component), mark))
        assert calls, proc.log() if proc else component
        assert calls <= granted, f"{component} used calls the chart does not grant: {sorted(calls - granted)}"
        unused = granted - calls - set(NOT_EXERCISED)
        assert not unused, f"the chart grants {component} more than it uses: {sorted(unused)}"
        refused = [e for e in control_plane.audit(service_account_user(component), mark)
                   if (e.get("responseStatus") or {}).get("code") == 403]
        assert not refused, f"{component} got 403s: {[e['requestURI'] for e in refused][:5]}"
    # the tuner may not patch InferenceDeployments themselves (status and scale only): the review's finding 9
    assert ("chunkpilot.io", "inferencedeployments", "patch") not in chart_rules("tuner")
    # the rules in the chart are literally these, no wildcards anywhere
    rules = [r for d in docs(render()) if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert not [r for r in rules if "*" in yaml.safe_dump(r)]


def routed_drift_and_removed(k: Cluster, ns: str, op) -> None:
    """spec.routing (operator/routing.py): its objects made, each kind edited by someone and put back (a patch
    each), then removed with routing (a delete each)."""
    rbac = kubernetes.client.RbacAuthorizationV1Api(k.api)
    pool = ("inference.networking.k8s.io", "v1", ns, "inferencepools", "r")
    route = ("gateway.networking.k8s.io", "v1", ns, "httproutes", "r")

    def get(fn, *args):
        try:
            return fn(*args)
        except kubernetes.client.ApiException as e:
            if e.status == 404:
                return None
            raise
    k.create(sample("r", ns, replicas=1, tuning={"mode": "off"}, routing={"gateway": {"name": "gw"}}))
    assert eventually(lambda: get(k.custom.get_namespaced_custom_object, *route) is not None
                      and k.get("deployments", ns, "r-epp") is not None, 60), op.log()
    k.custom.patch_namespaced_custom_object(*pool, {"spec": {"endpointPickerRef": {"failureMode": "FailClose"}}})
    k.custom.patch_namespaced_custom_object(*route, {"spec": {"parentRefs": [{"name": "elsewhere"}]}})
    rbac.patch_namespaced_role("r-epp", ns, {"rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]})
    rbac.patch_namespaced_role_binding("r-epp", ns, {"subjects": [{"kind": "ServiceAccount", "name": "default",
                                                                  "namespace": ns}]})
    k.core.patch_namespaced_service_account("r-epp", ns, {"metadata": {"labels": {
        "app.kubernetes.io/managed-by": "someone"}}})
    k.patch("r", {"metadata": {"labels": {"poke": "1"}}}, ns)
    assert eventually(lambda: k.custom.get_namespaced_custom_object(*pool)["spec"]["endpointPickerRef"][
        "failureMode"] == "FailOpen"  # the spec's default
        and k.custom.get_namespaced_custom_object(*route)["spec"]["parentRefs"][0]["name"] == "gw"
        and len(rbac.read_namespaced_role("r-epp", ns).rules) == 3
        and rbac.read_namespaced_role_binding("r-epp", ns).subjects[0].name == "r-epp"
        and k.core.read_namespaced_service_account("r-epp", ns).metadata.labels[
            "app.kubernetes.io/managed-by"] == "chunkpilot-operator", 60), op.log()
    k.patch("r", {"spec": {"routing": None}}, ns)
    assert eventually(lambda: get(k.custom.get_namespaced_custom_object, *pool) is None
                      and get(k.custom.get_namespaced_custom_object, *route) is None
                      and get(rbac.read_namespaced_role, "r-epp", ns) is None
                      and get(rbac.read_namespaced_role_binding, "r-epp", ns) is None
                      and get(k.core.read_namespaced_service_account, "r-epp", ns) is None
                      and k.get("configmaps", ns, "r-epp") is None, 60), op.log()


def test_a_verb_missing_from_the_role_shows_as_a_403_in_status(control_plane, chart_accounts, tmp_path):
    """The chart's operator role less one verb (create Services), bound in one namespace: the operator says so in
    a Degraded condition and a Warning Event naming the 403, and keeps running."""
    k = Cluster(control_plane.api())
    ns = k.namespace("rbac-limited")
    role = next(d for d in docs(render()) if d["kind"] == "ClusterRole"
                and d["metadata"]["name"] == "cp-chunkpilot-operator")
    limited = copy.deepcopy(role)
    limited["metadata"] = {"name": "chunkpilot-operator-limited"}
    for rule in limited["rules"]:
        if "services" in rule["resources"]:
            rule["resources"].remove("services")
    limited["rules"] = [r for r in limited["rules"] if r["resources"]]  # the API server refuses a rule of none
    limited["rules"].append({"apiGroups": [""], "resources": ["services"], "verbs": ["get", "patch"]})
    rbac = kubernetes.client.RbacAuthorizationV1Api(k.api)
    rbac.create_cluster_role(limited)
    k.core.create_namespaced_service_account(ns, {"metadata": {"name": "limited"}})
    rbac.create_namespaced_role_binding(ns, {
        "metadata": {"name": "limited"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                                    "name": limited["metadata"]["name"]},
        "subjects": [{"kind": "ServiceAccount", "name": "limited", "namespace": ns}]})
    rbac.create_cluster_role_binding({  # kopf's cluster-scoped look-ups (CRDs, namespaces) as the chart grants them
        "metadata": {"name": "chunkpilot-operator-limited"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "cp-chunkpilot-operator-cluster"},
        "subjects": [{"kind": "ServiceAccount", "name": "limited", "namespace": ns}]})
    kubeconfig = control_plane.service_account_kubeconfig(ns, "limited", tmp_path / "limited.kubeconfig")
    try:
        with operator(kubeconfig, tmp_path, "--namespace", ns) as op:
            k.create(sample("x", ns))
            assert eventually(lambda: k.cond(ns, "x", "Degraded").get("reason") == "ApiError"), op.log()
            message = k.cond(ns, "x", "Degraded")["message"]
            assert "403" in message and "services" in message, message
            assert eventually(lambda: any(t == "Warning" and r == "ApiError" and "403" in m
                                          for t, r, m in k.events(ns, "x")))
            assert op.alive()
    finally:
        k.delete_namespace(ns)
        rbac.delete_cluster_role(limited["metadata"]["name"])
        rbac.delete_cluster_role_binding("chunkpilot-operator-limited")

"""The controllers' only door to the API server: read, create, server-side apply, delete, patch status, check
existence.

Raw JSON in and out (`_preload_content=False`): the builders speak plain dicts, and skipping the client's model
classes keeps 200 deployments cheap. Every call the operator and the tuner make (besides kopf's own watches and
Events) is in this file; the tests check the Helm chart's RBAC against what they do on a real API server.

Every call carries a request timeout: without one a connection the API server stops answering on (a control-plane
node gone, a network partition) blocks the calling thread for as long as the kernel keeps the socket, and with it
whatever that thread holds (a work queue's worker, the peering gate every worker asks)."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass

import kubernetes
from kubernetes.client import ApiException

from chunkpilot.api.types import GROUP, PLURAL, VERSION

APPLY = "application/apply-patch+yaml"
# (connect, read) seconds for every call: a read of 200 objects answers in well under a second; 30 s leaves room for
# a loaded API server and still frees a thread before the work queue's stall bound (kube/work_queue.py)
REQUEST_TIMEOUT = (5.0, 30.0)
MERGE = "application/merge-patch+json"


@dataclass(frozen=True)
class _Typed:
    api: str  # class in kubernetes.client
    suffix: str  # e.g. config_map -> read_namespaced_config_map


TYPED = {
    ("v1", "ConfigMap"): _Typed("CoreV1Api", "config_map"),
    ("v1", "Service"): _Typed("CoreV1Api", "service"),
    ("v1", "Secret"): _Typed("CoreV1Api", "secret"),
    ("v1", "PersistentVolumeClaim"): _Typed("CoreV1Api", "persistent_volume_claim"),
    ("apps/v1", "Deployment"): _Typed("AppsV1Api", "deployment"),
    ("policy/v1", "PodDisruptionBudget"): _Typed("PolicyV1Api", "pod_disruption_budget"),
    ("networking.k8s.io/v1", "NetworkPolicy"): _Typed("NetworkingV1Api", "network_policy"),
    # spec.routing's endpoint picker: its account and its least-privilege Role (operator/routing.py)
    ("v1", "ServiceAccount"): _Typed("CoreV1Api", "service_account"),
    ("rbac.authorization.k8s.io/v1", "Role"): _Typed("RbacAuthorizationV1Api", "role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): _Typed("RbacAuthorizationV1Api", "role_binding"),
}
CUSTOM = {("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors",
          (f"{GROUP}/{VERSION}", "InferenceDeployment"): PLURAL,
          ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
          ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes"}


def load_config() -> None:
    """In a pod: the service account; elsewhere: $KUBECONFIG or ~/.kube/config (like kubectl)."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()


class Kube:
    def __init__(self, api_client: kubernetes.client.ApiClient | None = None, pool_size: int = 32,
                 field_manager: str = "chunkpilot", timeout: tuple[float, float] = REQUEST_TIMEOUT) -> None:
        if api_client is None:
            conf = kubernetes.client.Configuration.get_default_copy()
            conf.connection_pool_maxsize = pool_size  # handlers run in a thread pool
            api_client = kubernetes.client.ApiClient(conf)
        self.client = api_client
        self.field_manager = field_manager  # who owns the fields we set, for server-side apply
        self._apis: dict[str, object] = {}
        # raw JSON (see above) and a bound on every call
        self._raw = {"_preload_content": False, "_request_timeout": timeout}

    def _api(self, name: str):
        if name not in self._apis:
            self._apis[name] = getattr(kubernetes.client, name)(self.client)
        return self._apis[name]

    @staticmethod
    def _json(resp) -> dict:
        return json.loads(resp.data)

    def read(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            if (api_version, kind) in TYPED:
                t = TYPED[(api_version, kind)]
                fn = getattr(self._api(t.api), f"read_namespaced_{t.suffix}")
                return self._json(fn(name, namespace, **self._raw))
            group, version = api_version.split("/")
            return self._json(self._api("CustomObjectsApi").get_namespaced_custom_object(
                group, version, namespace, CUSTOM[(api_version, kind)], name, **self._raw))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def create(self, obj: dict) -> dict:
        av, kind, ns = obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"]
        if (av, kind) in TYPED:
            t = TYPED[(av, kind)]
            fn = getattr(self._api(t.api), f"create_namespaced_{t.suffix}")
            return self._json(fn(ns, obj, field_manager=self.field_manager, **self._raw))
        group, version = av.split("/")
        return self._json(self._api("CustomObjectsApi").create_namespaced_custom_object(
            group, version, ns, CUSTOM[(av, kind)], obj, field_manager=self.field_manager, **self._raw))

    def apply(self, obj: dict, force: bool = True) -> dict:
        """Server-side apply as our field manager: fields we stopped setting are removed, others' are kept. With
        force=False a field another manager set is a 409 conflict instead of taken over."""
        av, kind, ns, name = obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]
        kw = dict(field_manager=self.field_manager, force=force, _content_type=APPLY, **self._raw)
        if (av, kind) in TYPED:
            t = TYPED[(av, kind)]
            return self._json(getattr(self._api(t.api), f"patch_namespaced_{t.suffix}")(name, ns, obj, **kw))
        group, version = av.split("/")
        return self._json(self._api("CustomObjectsApi").patch_namespaced_custom_object(
            group, version, ns, CUSTOM[(av, kind)], name, obj, **kw))

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        try:
            if (api_version, kind) in TYPED:
                t = TYPED[(api_version, kind)]
                getattr(self._api(t.api), f"delete_namespaced_{t.suffix}")(name, namespace, **self._raw)
            else:
                group, version = api_version.split("/")
                self._api("CustomObjectsApi").delete_namespaced_custom_object(
                    group, version, namespace, CUSTOM[(api_version, kind)], name, **self._raw)
        except ApiException as e:
            if e.status != 404:
                raise

    def patch_status(self, namespace: str, name: str, status: dict, resource_version: str | None = None) -> dict:
        """Merge-patch status. With `resource_version`, the server refuses (409) if the object changed since it
        was read, so a pass working from a stale copy cannot overwrite what the tuner wrote meanwhile."""
        body: dict = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return self._json(self._api("CustomObjectsApi").patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, body, _content_type=MERGE, **self._raw))

    def post_event(self, obj: dict, type_: str, reason: str, message: str, component: str) -> None:
        """A core/v1 Event about `obj`, as `kubectl describe` shows it. Ours and not kopf.event: kopf can post only
        from inside its own handlers (its queue lives in their context), and the passes run in the work queue."""
        meta = obj.get("metadata") or {}
        now = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
        ns = meta.get("namespace", "default")
        body = {"metadata": {"generateName": f"{meta.get('name', 'object')}.", "namespace": ns},
                "involvedObject": {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"), "name": meta.get("name"),
                                   "namespace": ns, "uid": meta.get("uid"),
                                   "resourceVersion": meta.get("resourceVersion")},
                "type": type_, "reason": reason, "message": message[:1024], "count": 1,
                "firstTimestamp": now, "lastTimestamp": now, "source": {"component": component},
                "reportingComponent": component}
        self._api("CoreV1Api").create_namespaced_event(ns, body, **self._raw)

    def read_peerings(self, name: str, namespaces: tuple[str, ...] = ()) -> list[dict]:
        """kopf's peering object(s) of that name: the ClusterKopfPeering, or the KopfPeering in each namespace."""
        api = self._api("CustomObjectsApi")
        if not namespaces:
            return [self._json(api.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", name,
                                                             **self._raw))]
        return [self._json(api.get_namespaced_custom_object("kopf.dev", "v1", ns, "kopfpeerings", name,
                                                            **self._raw)) for ns in namespaces]

    def list_pods(self, namespace: str, selector: dict[str, str]) -> list[dict]:
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        return self._json(self._api("CoreV1Api").list_namespaced_pod(
            namespace, label_selector=label_selector, **self._raw)).get("items", [])

    def patch_pod_labels(self, namespace: str, name: str, labels: dict[str, str]) -> dict:
        """Merge-patch a pod's labels (disaggregation mode auto: a pod's role labels, which the Services select by,
        moved when it switches roles; its ReplicaSet's selector leaves them out)."""
        return self._json(self._api("CoreV1Api").patch_namespaced_pod(
            name, namespace, {"metadata": {"labels": labels}}, _content_type=MERGE, **self._raw))

    def list_events(self, namespace: str, field_selector: str) -> list[dict]:
        """core/v1 Events of `namespace` matching `field_selector` (e.g. "reason=FailedMount")."""
        return self._json(self._api("CoreV1Api").list_namespaced_event(
            namespace, field_selector=field_selector, **self._raw)).get("items", [])

    def list_replica_sets(self, namespace: str, selector: dict[str, str]) -> list[dict]:
        """The ReplicaSets with these labels (whose owner a pod's ownership is checked against)."""
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        return self._json(self._api("AppsV1Api").list_namespaced_replica_set(
            namespace, label_selector=label_selector, **self._raw)).get("items", [])

    def list_inference_deployments(self, namespaces: list[str] | tuple[str, ...] = ()) -> list[dict]:
        """Every InferenceDeployment of `namespaces` (all namespaces when empty)."""
        api = self._api("CustomObjectsApi")
        if not namespaces:
            return self._json(api.list_cluster_custom_object(GROUP, VERSION, PLURAL, **self._raw))["items"]
        return [i for ns in namespaces for i in self._json(api.list_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, **self._raw))["items"]]

    def read_inference_deployment(self, namespace: str, name: str) -> dict | None:
        return self.read(f"{GROUP}/{VERSION}", "InferenceDeployment", namespace, name)

    def scale_inference_deployment(self, namespace: str, name: str, replicas: int,
                                   resource_version: str | None = None) -> dict:
        """Set spec.replicas through the scale subresource (what an HPA or `kubectl scale` writes): the tuner may
        change the replica count without rights to the rest of the spec. With `resource_version`, only if the
        object is still at it (409 Conflict otherwise: someone else wrote since that read)."""
        body: dict = {"spec": {"replicas": replicas}}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return self._json(self._api("CustomObjectsApi").patch_namespaced_custom_object_scale(
            GROUP, VERSION, namespace, PLURAL, name, body, _content_type=MERGE, **self._raw))

    def list_autoscalers(self, namespace: str) -> list[dict]:
        """The HorizontalPodAutoscalers (autoscaling/v2) in `namespace` (chunkpilot.kube.autoscalers reads them)."""
        return self._json(self._api("AutoscalingV2Api").list_namespaced_horizontal_pod_autoscaler(
            namespace, **self._raw)).get("items", [])

    def crd_exists(self, name: str) -> bool:
        try:
            self._api("ApiextensionsV1Api").read_custom_resource_definition(name, **self._raw)
            return True
        except ApiException as e:
            if e.status in (403, 404):
                return False
            raise

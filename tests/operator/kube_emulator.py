"""A stateful Kubernetes API for tests: kmock's emulator plus the bookkeeping the real API server does.

The real API server cannot be installed on these machines, so the operator tests run kopf and the kubernetes
client against kmock (real HTTP, real watch streams). kmock stores objects as plain merge-patched JSON; the real
server also stamps ``uid``/``resourceVersion``/``generation`` and keeps ``status`` behind its subresource. kopf
and our reconciler both rely on those, so this subclass adds exactly that and nothing more.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import threading
import uuid
from pathlib import Path

import attrs
import kmock
import yaml

# (group, version, plural, kind, namespaced): everything kopf's backbone and our operator touch.
RESOURCES = [
    ("", "v1", "namespaces", "Namespace", False),
    ("", "v1", "events", "Event", True),
    ("", "v1", "configmaps", "ConfigMap", True),
    ("", "v1", "services", "Service", True),
    ("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", True),
    ("apps", "v1", "deployments", "Deployment", True),
    ("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True),
    ("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False),
    ("coordination.k8s.io", "v1", "leases", "Lease", True),
    ("kopf.dev", "v1", "kopfpeerings", "KopfPeering", True),
    ("kopf.dev", "v1", "clusterkopfpeerings", "ClusterKopfPeering", False),
    ("chunkpilot.io", "v1alpha1", "inferencedeployments", "InferenceDeployment", True),
    ("monitoring.coreos.com", "v1", "servicemonitors", "ServiceMonitor", True),
]
WITH_STATUS = {"deployments", "inferencedeployments"}
VERBS = ["get", "list", "watch", "create", "patch", "update", "delete"]


@attrs.frozen
class Call:
    group: str
    resource: str
    subresource: str | None
    verb: str
    authorization: str

    @property
    def rule(self) -> tuple[str, str, str]:
        return (self.group, self.resource + (f"/{self.subresource}" if self.subresource else ""), self.verb)


VERBS_BY_ACTION = {kmock.action.LIST: "list", kmock.action.WATCH: "watch", kmock.action.FETCH: "get",
                   kmock.action.CREATE: "create", kmock.action.UPDATE: "patch", kmock.action.DELETE: "delete"}


@attrs.frozen
class ResourceVersionConflict(kmock.KubernetesError):
    status: int = 409
    reason: str = "Conflict"
    message: str = "the object has been modified; please apply your changes to the latest version and try again"


@attrs.define(kw_only=True)
class StampingEmulator(kmock.KubernetesEmulator):
    """uid, resourceVersion (and 409 on a stale one), generation (spec changes only), generateName, status
    subresource semantics."""

    _rv: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)
    _inflight: set = attrs.field(factory=set, init=False)
    # (plural, name, HTTP method) of every request, for assertions; kmock's own request log is trimmed below.
    log: list = attrs.field(factory=list, init=False)
    calls: list = attrs.field(factory=list, init=False)  # for RBAC: who asked for which verb on what

    async def _handle(self, request: kmock.Request):
        # kmock matches each request against its reactions by scanning its whole request history, which makes
        # a long run quadratic (200 deployments: ~100 ms per request). Keep only the requests in flight there.
        self._inflight.add(id(request))
        self._requests[:] = [r for r in self._requests if id(r) in self._inflight]
        try:
            return await self._stamp_and_handle(request)
        finally:
            self._inflight.discard(id(request))

    async def _stamp_and_handle(self, request: kmock.Request):
        data = request.data
        if request.resource is not None:
            name = request.name or ((data or {}).get("metadata", {}).get("name") if isinstance(data, dict) else None)
            self.log.append((request.resource.plural, name, str(request.method.value).upper()))
            if request.resource.plural:  # not discovery (/apis/group)
                self.calls.append(Call(request.resource.group or "", request.resource.plural, request.subresource,
                                       VERBS_BY_ACTION.get(request.action, str(request.action)),
                                       request.headers.get("Authorization", "")))
        if request.resource is not None and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            precondition = meta.get("resourceVersion")
            if precondition and request.action == kmock.action.UPDATE and request.name is not None:
                key = (request.resource, request.namespace, request.name)
                if key in self.objects and not self.objects[key].deleted and \
                        self.objects[key].raw.get("metadata", {}).get("resourceVersion") != precondition:
                    raise ResourceVersionConflict()  # optimistic concurrency, as the real server does
            meta["resourceVersion"] = str(next(self._rv))
            with_status = request.resource.plural in WITH_STATUS
            if request.action == kmock.action.CREATE:
                if not meta.get("name") and meta.get("generateName"):  # kopf posts Events this way
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp",
                                datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
                meta["generation"] = 1
                if with_status:
                    data.pop("status", None)
            elif request.action == kmock.action.UPDATE and request.name is not None:
                if with_status and request.subresource == "status":
                    for key in list(data):
                        if key not in ("status", "metadata"):
                            del data[key]
                    data["metadata"] = {"resourceVersion": meta["resourceVersion"]}
                elif with_status:
                    data.pop("status", None)
                if request.subresource is None and "spec" in data:
                    key = (request.resource, request.namespace, request.name)
                    current = self.objects[key] if key in self.objects else None
                    if current is not None and not current.deleted:
                        merged = kmock.Object(current.raw)
                        merged.patch({"spec": data["spec"]})
                        if merged.raw.get("spec") != current.raw.get("spec"):
                            meta["generation"] = int(current.raw.get("metadata", {}).get("generation", 1)) + 1
        response = await super()._handle(request)
        if request.action == kmock.action.CREATE and response.status == 200 and not response.prepared:
            response.set_status(201)  # the real server's code; the generated clients map only 201 to a body
        return response


class KubeEmulatorThread:
    """The emulator on its own event loop thread, so that sync clients and subprocesses can use it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.handler: StampingEmulator | None = None
        self.server: kmock.Server | None = None

    async def _start(self) -> None:
        self.handler = StampingEmulator()
        await self.handler.__aenter__()
        for group, version, plural, kind, namespaced in RESOURCES:
            self.handler.resources[f"{group}/{version}/{plural}" if group else f"v1/{plural}"] = {
                "kind": kind, "namespaced": namespaced, "verbs": VERBS,
                "subresources": ["status"] if plural in WITH_STATUS else []}
        self.server = kmock.Server(self.handler)
        await self.server.__aenter__()

    async def _stop(self) -> None:
        await self.server.__aexit__(None, None, None)
        await self.handler.__aexit__(None, None, None)

    def __enter__(self) -> KubeEmulatorThread:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self) -> str:
        return str(self.server.url).rstrip("/")

    def kubeconfig(self, path: Path, token: str = "test") -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": token}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}],
        }))
        return path

    def objects(self, plural: str, namespace: str | None = None) -> list[dict]:
        out = []
        for (res, ns, _name), obj in list(self.handler.objects.items()):
            if res.plural == plural and not obj.deleted and (namespace is None or ns == namespace):
                out.append(obj.raw)
        return out

    def get(self, plural: str, namespace: str, name: str) -> dict | None:
        for (res, ns, n), obj in list(self.handler.objects.items()):
            if res.plural == plural and ns == namespace and n == name and not obj.deleted:
                return obj.raw
        return None

    def mark(self) -> int:
        """A position in the request log, for counting the writes that came after it."""
        return len(self.handler.log)

    def writes(self, plural: str, since: int = 0, name: str | None = None) -> list[tuple[str, str, str]]:
        return [entry for entry in self.handler.log[since:] if entry[0] == plural and (name is None or entry[1] == name)
                and entry[2] in ("POST", "PATCH", "PUT", "DELETE")]

"""What `helm test` checks inside the cluster, as cert-manager's startupapicheck does: more than a health URL.

Each check talks to the real thing an installed chunkpilot needs: the API server serves InferenceDeployments and
refuses a bad spec (the CRD's schema; and the admin's policy at admission, when the chart installed the
ValidatingAdmissionPolicy), the operator answers on its health endpoint, and Prometheus answers at the URL the
tuner was given (cluster DNS and the network path included). Refusals are asked for with server-side dry-run, so
nothing is stored and the operator never sees the test objects."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from chunkpilot.api.types import GROUP, KIND, PLURAL, VERSION, InferenceDeployment, InferenceDeploymentSpec, ModelSpec

# A host path no admin allows (the policy allows none by default, and never /proc): the admission policy must
# refuse it before the object is stored.
FORBIDDEN_SOURCE = "hostpath:///proc/chunkpilot-install-check"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def sample(name: str, source: str) -> dict:
    """A valid InferenceDeployment (from the API types, the CRD's owner) that the checks then break."""
    obj = InferenceDeployment(metadata={"name": name}, spec=InferenceDeploymentSpec(model=ModelSpec(source=source)))
    return obj.model_dump(by_alias=True, exclude={"status"}, exclude_none=True)


def _dry_run_create(api, namespace: str, body: dict) -> tuple[int, str]:
    """(HTTP status, message) of a server-side dry-run create: 201 stored-if-it-were-real, 422/403 refused."""
    from kubernetes.client import ApiException, CustomObjectsApi

    try:
        CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body, dry_run="All")
        return 201, ""
    except ApiException as e:
        try:
            message = json.loads(e.body or "{}").get("message", "")
        except ValueError:
            message = str(e.body)
        return e.status, message


def _get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read(2000).decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(2000).decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return 0, str(getattr(e, "reason", e))


def run_checks(api, namespace: str, operator_url: str | None, prometheus_url: str | None,
               admission_policy: bool) -> list[Check]:
    from kubernetes.client import ApiException, CustomObjectsApi

    checks = []
    try:
        CustomObjectsApi(api).list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, limit=1)
        checks.append(Check("crd", True, f"{KIND} is served in {namespace}"))
    except ApiException as e:
        checks.append(Check("crd", False, f"listing {PLURAL} in {namespace}: HTTP {e.status} {e.reason} (is the "
                                          "CRD installed? helm installs crds/ on first install only)"))
    bad = sample("chunkpilot-install-check", "pvc://models/m")
    bad["spec"]["replicas"] = -1
    status, message = _dry_run_create(api, namespace, bad)
    checks.append(Check("schema", status == 422 and "replicas" in message,
                        f"a spec with replicas -1: HTTP {status} {message[:300]}"))
    if admission_policy:
        status, message = _dry_run_create(api, namespace, sample("chunkpilot-install-check", FORBIDDEN_SOURCE))
        checks.append(Check("admission-policy", status in (403, 422) and "allowedHostPaths" in message,
                            f"a spec naming {FORBIDDEN_SOURCE}: HTTP {status} {message[:600]}"))
    if operator_url:
        status, body = _get(operator_url)
        checks.append(Check("operator", status == 200, f"{operator_url}: HTTP {status} {body[:200]}"))
    if prometheus_url:
        url = prometheus_url.rstrip("/") + "/api/v1/status/buildinfo"
        status, body = _get(url)
        checks.append(Check("prometheus", status == 200 and '"success"' in body,
                            f"{url}: HTTP {status} {body[:200]} (the tuner reads Prometheus there: chart value "
                            "tuner.prometheusUrl or monitoring.prometheus.namespace)"))
    return checks

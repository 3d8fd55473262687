"""Knobs to every ready engine pod in seconds: a PUT to each pod's admin endpoint (engine/admin.py), and the pod's
answer recorded as its acknowledgement in `status.knobs` (api.types.KnobsStatus), which the tuner waits on.

Why push and not only the ConfigMap: the kubelet rewrites a ConfigMap volume at its periodic pod sync, about a
minute after the change (66 s median on the local cluster). Why push and not have each engine watch its own
ConfigMap through the API: that gives every engine pod a ServiceAccount token and API rights (the engine runs
user-chosen models and images and holds no token today), one watch per pod on the API server, and the operator
would still have to ask each pod what it applied to acknowledge it. A push answers with what the pod runs.

The ConfigMap stays the durable copy: a pod that starts (or restarts) reads it before serving, and a pod that
misses a push (not ready yet, a network blip) is pushed again on the next pass (its Deployment's readiness
changes trigger one; failures are retried with a backoff). Pure planning here; the HTTP call is injected."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import urllib3

from chunkpilot.api.types import KnobsStatus, PodKnobs
from chunkpilot.contract.knobs import SchedulerKnobs, parse_knobs

log = logging.getLogger(__name__)

PUSH_TIMEOUT_SECONDS = 3.0


@dataclass(frozen=True)
class ReadyPod:
    name: str
    ip: str
    started: str | None = None  # when its engine container (last) started: a restart makes an old ack void


def ready_pods(pods: list[dict]) -> list[ReadyPod]:
    """Pods that serve (Ready condition true, an IP, not terminating), by name."""
    out = []
    for p in pods:
        meta, st = p.get("metadata") or {}, p.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
        if ready and st.get("podIP") and not meta.get("deletionTimestamp"):
            started = [((c.get("state") or {}).get("running") or {}).get("startedAt")
                       for c in st.get("containerStatuses") or [] if c.get("name") == "engine"]
            out.append(ReadyPod(meta["name"], st["podIP"], started[0] if started else None))
    return sorted(out, key=lambda p: p.name)


# (pod, knobs) -> the knobs the pod answers it runs; raises PushError
Pusher = Callable[[ReadyPod, SchedulerKnobs], SchedulerKnobs]


class PushError(Exception):
    pass


def deliver(previous: KnobsStatus | None, desired: SchedulerKnobs, source: str, pods: list[ReadyPod],
            push: Pusher) -> tuple[KnobsStatus, list[str]]:
    """Push `desired` to every ready pod whose acknowledgement differs; returns the new status.knobs and, for each
    pod the push failed on, why. A pod's earlier acknowledgement is kept only while it still matches (the same
    pod's container may have restarted since, and then runs what the kubelet last wrote into its ConfigMap volume,
    which can be older: it is pushed again)."""
    acked = {(p.pod, p.started): p for p in (previous.pods if previous else []) if p.scheduler_knobs == desired}
    entries, failures = [], []
    for pod in pods:
        if (pod.name, pod.started) in acked:
            entries.append(acked[(pod.name, pod.started)])
            continue
        try:
            got = push(pod, desired)
        except PushError as e:
            failures.append(f"{pod.name}: {e}")
            continue
        entries.append(PodKnobs(pod=pod.name, started=pod.started, token_budget=got.token_budget,
                                max_chunk=got.max_chunk, generation=got.generation))
    applied = sum(1 for e in entries if e.scheduler_knobs == desired)
    status = KnobsStatus(token_budget=desired.token_budget, max_chunk=desired.max_chunk,
                         generation=desired.generation, source=source, applied_replicas=applied, pods=entries)
    return status, failures


class HttpPusher:
    """PUT /admin/knobs with the bearer token; the answer is the pod's acknowledgement."""

    def __init__(self, port: int, timeout: float = PUSH_TIMEOUT_SECONDS) -> None:
        self.port = port
        self.http = urllib3.PoolManager(num_pools=64, retries=False, timeout=urllib3.Timeout(total=timeout))

    def for_token(self, token: str) -> Pusher:
        def push(pod: ReadyPod, knobs: SchedulerKnobs) -> SchedulerKnobs:
            body = json.dumps({"token_budget": knobs.token_budget, "max_chunk": knobs.max_chunk,
                               "generation": knobs.generation})
            try:
                r = self.http.request("PUT", f"http://{pod.ip}:{self.port}/admin/knobs", body=body,
                                      headers={"Content-Type": "application/json",
                                               "Authorization": f"Bearer {token}"})
            except urllib3.exceptions.HTTPError as e:
                raise PushError(f"cannot reach {pod.ip}:{self.port}: {type(e).__name__}") from None
            if r.status != 200:
                raise PushError(f"HTTP {r.status}: {_message(r.data)}")
            try:
                return parse_knobs(r.data)
            except ValueError as e:
                raise PushError(f"unreadable answer: {e}") from None
        return push


def _message(data: bytes) -> str:
    try:
        return json.loads(data)["error"]["message"][:300]
    except (ValueError, KeyError, TypeError):
        return data[:300].decode(errors="replace")

"""Knobs to every ready engine pod in seconds: a PUT to each pod's admin endpoint (engine/serving/admin.py), and the
pod's answer recorded as its acknowledgement in `status.knobs` (api.types.KnobsStatus), which the tuner waits on.

Why push and not only the ConfigMap: the kubelet rewrites a ConfigMap volume at its periodic pod sync, about a
minute after the change (66 s median on the local cluster). Why push and not have each engine watch its own
ConfigMap through the API: that gives every engine pod a ServiceAccount token and API rights (the engine runs
user-chosen models and images and holds no token today), one watch per pod on the API server, and the operator
would still have to ask each pod what it applied to acknowledge it. A push answers with what the pod runs.

The ConfigMap stays the durable copy: a pod that starts (or restarts) reads it before serving, and a pod that
misses a push (not ready yet, a network blip) is pushed again on the next pass (its Deployment's readiness
changes trigger one; failures are retried with a backoff). Pure planning here; the HTTP call is injected."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp

from chunkpilot.api.types import ROLE_LABEL, KnobsStatus, PodKnobs
from chunkpilot.contract.knobs import ADMIN_PATH, SchedulerKnobs, dumps_knobs, parse_knobs

log = logging.getLogger(__name__)

# The whole request, connect to last byte: an engine applies knobs at its next step boundary and answers in
# milliseconds; a pod that has not answered in 3 s is retried on the next pass, and its ConfigMap still holds them.
PUSH_DEADLINE_SECONDS = 3.0
# The answer is three or four integers (~100 bytes); more than this is not an engine talking.
MAX_ANSWER_BYTES = 4096
# Pods pushed at once: a pass over a 64-pod deployment takes one deadline, not 64, without opening 64 sockets.
PUSH_CONCURRENCY = 16


@dataclass(frozen=True)
class ReadyPod:
    name: str
    ip: str
    started: str | None = None  # when its engine container (last) started: a restart makes an old ack void
    role: str | None = None  # its role label (disaggregation), which the Services select it by


def owned_pods(pods: list[dict], replica_sets: list[dict], deployment_uid: str | None) -> list[dict]:
    """The pods whose controller is a ReplicaSet controlled by the Deployment with `deployment_uid`: only those get
    the admin token. Labels alone are not ownership: anyone who may create a pod in the namespace could give it
    the engine's labels and receive every push (and its bearer token)."""
    if not deployment_uid:
        return []
    ours = {(rs.get("metadata") or {}).get("uid") for rs in replica_sets
            if _controller_uid(rs) == deployment_uid}
    return [p for p in pods if _controller_uid(p) in ours]


def _controller_uid(obj: dict) -> str | None:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def ready_pods(pods: list[dict]) -> list[ReadyPod]:
    """Pods that serve (Ready condition true, an IP, not terminating), by name."""
    out = []
    for p in pods:
        meta, st = p.get("metadata") or {}, p.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
        if ready and st.get("podIP") and not meta.get("deletionTimestamp"):
            started = [((c.get("state") or {}).get("running") or {}).get("startedAt")
                       for c in st.get("containerStatuses") or [] if c.get("name") == "engine"]
            out.append(ReadyPod(meta["name"], st["podIP"], started[0] if started else None,
                                (meta.get("labels") or {}).get(ROLE_LABEL)))
    return sorted(out, key=lambda p: p.name)


class PushError(Exception):
    pass


# (pods, knobs) -> for each pod's name, the knobs it answers it runs, or why the push failed
Pusher = Callable[[list[ReadyPod], SchedulerKnobs], Mapping[str, SchedulerKnobs | PushError]]


def one_by_one(push: Callable[[ReadyPod, SchedulerKnobs], SchedulerKnobs]) -> Pusher:
    """A Pusher from a function of one pod that raises PushError (tests; a pusher without concurrency)."""
    def push_all(pods: list[ReadyPod], knobs: SchedulerKnobs) -> dict[str, SchedulerKnobs | PushError]:
        out: dict[str, SchedulerKnobs | PushError] = {}
        for pod in pods:
            try:
                out[pod.name] = push(pod, knobs)
            except PushError as e:
                out[pod.name] = e
        return out
    return push_all


def deliver(previous: KnobsStatus | None, desired: SchedulerKnobs, source: str, pods: list[ReadyPod],
            push: Pusher) -> tuple[KnobsStatus, list[str]]:
    """Push `desired` to every ready pod whose acknowledgement differs (all of them at once); returns the new
    status.knobs and, for each pod the push failed on, why. A pod's earlier acknowledgement is kept only while it
    still matches (the same pod's container may have restarted since, and then runs what the kubelet last wrote
    into its ConfigMap volume, which can be older: it is pushed again)."""
    acked = {(p.pod, p.started): p for p in (previous.pods if previous else []) if runs(p, desired)}
    todo = [pod for pod in pods if (pod.name, pod.started) not in acked]
    answers = push(todo, desired) if todo else {}
    entries, failures = [], []
    for pod in pods:
        if (pod.name, pod.started) in acked:
            entries.append(acked[(pod.name, pod.started)])
            continue
        got = answers.get(pod.name, PushError("not pushed"))
        if isinstance(got, PushError):
            failures.append(f"{pod.name}: {got}")
            continue
        # the threshold as the pod answered it: a decode pod that dropped the tuner's threshold has not applied them
        entries.append(PodKnobs(pod=pod.name, role=got.role, started=pod.started, token_budget=got.token_budget,
                                max_chunk=got.max_chunk, generation=got.generation,
                                disagg_threshold=got.disagg_threshold))
    applied = sum(1 for e in entries if runs(e, desired))
    status = KnobsStatus(token_budget=desired.token_budget, max_chunk=desired.max_chunk,
                         generation=desired.generation, disagg_threshold=desired.disagg_threshold, source=source,
                         applied_replicas=applied, pods=entries)
    return status, failures


def runs(pod: PodKnobs, desired: SchedulerKnobs) -> bool:
    """The pod acknowledged `desired`: the same knobs, and where they name a role (a live-roles pod's), that role."""
    return pod.scheduler_knobs == desired.with_role(None) and (desired.role is None or pod.role == desired.role)


def deliver_by_role(previous: KnobsStatus | None, wants: dict[str, tuple[SchedulerKnobs, str, list[ReadyPod]]],
                    shown: str, push: Pusher) -> tuple[KnobsStatus, dict[str, KnobsStatus], list[str]]:
    """A disaggregated resource: each role's knobs (`wants`: role -> its knobs, their source, its ready pods) to the
    pods of that role alone, as deliver() does for all of them. Returns the one record of every pod (status.knobs:
    each entry names its pod's role; the knobs at its top are role `shown`'s, the decode pods the clients reach,
    and it counts the pods that run those), each role's own record, and the failures."""
    by_role, failures, entries = {}, [], []
    for role, (desired, source, pods) in wants.items():
        status, failed = deliver(previous, desired, source, pods, push)
        # the role each pod answered it runs, where it names one (a live-roles pod's), else the one it was pushed for
        by_role[role] = status.model_copy(update={"pods": [p.model_copy(update={"role": p.role or role})
                                                           for p in status.pods]})
        entries += by_role[role].pods
        failures += failed
    top = by_role[shown]
    applied = sum(1 for e in entries if e.scheduler_knobs == top.scheduler_knobs)
    return top.model_copy(update={"pods": entries, "applied_replicas": applied}), by_role, failures


class HttpPusher:
    """PUT the knobs file's content to the admin path, with the bearer token, to many pods at once; each answer is
    that pod's acknowledgement.

    Each push has a deadline for the whole request (aiohttp's `total`, and asyncio's timeout around it) and a cap
    on the answer: a per-read socket timeout bounds nothing when a pod answers one byte every second, and one such
    pod would hold a worker of the operator for good."""

    def __init__(self, port: int, deadline: float = PUSH_DEADLINE_SECONDS, concurrency: int = PUSH_CONCURRENCY,
                 max_answer: int = MAX_ANSWER_BYTES) -> None:
        self.port, self.deadline, self.concurrency, self.max_answer = port, deadline, concurrency, max_answer

    def for_token(self, token: str) -> Pusher:
        def push_all(pods: list[ReadyPod], knobs: SchedulerKnobs) -> dict[str, SchedulerKnobs | PushError]:
            # a loop of its own per pass: the pass runs in a work-queue thread, outside kopf's event loop
            return asyncio.run(self._push_all(pods, knobs, token))
        return push_all

    async def _push_all(self, pods: list[ReadyPod], knobs: SchedulerKnobs,
                        token: str) -> dict[str, SchedulerKnobs | PushError]:
        body = dumps_knobs(knobs)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        limit = asyncio.Semaphore(self.concurrency)
        connector = aiohttp.TCPConnector(limit=self.concurrency, force_close=True)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=self.deadline),
                                         auto_decompress=False) as session:
            async def one(pod: ReadyPod) -> SchedulerKnobs | PushError:
                async with limit:
                    try:
                        async with asyncio.timeout(self.deadline):
                            return await self._push(session, pod, body, headers)
                    except PushError as e:
                        return e
                    except TimeoutError:
                        return PushError(f"no whole answer from {pod.ip}:{self.port} within {self.deadline:g} s")
                    except aiohttp.ClientError as e:
                        return PushError(f"cannot reach {pod.ip}:{self.port}: {type(e).__name__}")
            results = await asyncio.gather(*(one(pod) for pod in pods))
        return {pod.name: r for pod, r in zip(pods, results)}

    async def _push(self, session: aiohttp.ClientSession, pod: ReadyPod, body: str,
                    headers: dict[str, str]) -> SchedulerKnobs:
        async with session.put(f"http://{pod.ip}:{self.port}{ADMIN_PATH}", data=body, headers=headers,
                               allow_redirects=False) as r:
            data = bytearray()
            async for chunk in r.content.iter_any():
                data += chunk
                if len(data) > self.max_answer:
                    raise PushError(f"answer larger than {self.max_answer} bytes: not an engine's")
            if r.status != 200:
                raise PushError(f"HTTP {r.status}: {_message(bytes(data))}")
            try:
                return parse_knobs(bytes(data))
            except ValueError as e:
                raise PushError(f"unreadable answer: {e}") from None


def _message(data: bytes) -> str:
    try:
        return json.loads(data)["error"]["message"][:300]
    except (ValueError, KeyError, TypeError):
        return data[:300].decode(errors="replace")

"""Why engine pods do not come up, read from their container statuses: a pure function, pods in, one line out.

An SRE looking at `kubectl get infd` should not have to go through pods to learn that the engine cannot load its
model or its image cannot be pulled; the operator puts the container's own reason and the last line of its
termination message (with terminationMessagePolicy FallbackToLogsOnError, the log's tail; the engine's last line
is its load error) into the Ready and Degraded conditions and a Warning Event."""

from __future__ import annotations

import re

# Waiting reasons that mean the container will not start by waiting longer (kubelet's own words).
FAILING = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError",
           "CreateContainerError", "RunContainerError")
MAX_MESSAGE = 600  # of the termination message, in the condition (the Event and the pod keep the rest)
# A log line's leading time stamp: dropped, so that the message (and so the condition and the Event) stays the
# same from one crash to the next instead of being news at every restart
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?\s*")


def _tail(message: str) -> str:
    """The last line of a termination message (with FallbackToLogsOnError, the log's tail, where the error comes
    last: the engine's "model failed to load ...; exiting", a traceback's exception line), without its time stamp,
    at most MAX_MESSAGE characters. `kubectl describe pod` shows the rest."""
    lines = [_STAMP.sub("", ln.strip()) for ln in message.strip().splitlines() if ln.strip()]
    if lines and lines[-1].startswith("╰"):
        # a box (typer and rich print a usage error so, exit status 2): its last line is only its bottom edge, so
        # the box's title and content, as one line
        top = max((i for i, ln in enumerate(lines) if ln.startswith("╭")), default=None)
        if top is not None:
            title, body = lines[top].strip("╭╮─ "), " ".join(ln.strip("│ ") for ln in lines[top + 1:-1])
            return re.sub(r"\s+", " ", f"{title}: {body}" if title else body).strip()[:MAX_MESSAGE]
    return lines[-1][:MAX_MESSAGE] if lines else ""


def _one(pod: str, status: dict, kind: str) -> str | None:
    """The trouble of one container status, or None."""
    name = status.get("name", "?")
    waiting = (status.get("state") or {}).get("waiting") or {}
    last = (status.get("lastState") or {}).get("terminated") or {}
    failed_before = bool(last) and (last.get("exitCode") or 0) != 0
    if waiting.get("reason") not in FAILING and not (failed_before and not status.get("ready")):
        return None
    what = f"pod {pod}: {kind}container {name} " + (waiting.get("reason") or "restarting")
    if waiting.get("message") and waiting.get("reason") != "CrashLoopBackOff":  # the back-off text says nothing
        what += f" ({waiting['message'].strip()[:MAX_MESSAGE]})"
    if last:
        said = _tail(last.get("message") or "") or last.get("reason") or ""
        what += f"; last exit {last.get('exitCode', '?')}" + (f": {said}" if said else "")
    return what


def _live(pods: list[dict]) -> list[dict]:
    """Pods not being deleted (their containers stop on purpose), by name."""
    return sorted((p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")),
                  key=lambda p: (p.get("metadata") or {}).get("name", ""))


def engine_trouble(pods: list[dict]) -> str | None:
    """Why an engine pod does not come up: the first failing container (init containers first: the model
    download), else a pod the scheduler cannot place; None when nothing is wrong that waiting would not fix."""
    for p in _live(pods):
        meta, st = p.get("metadata") or {}, p.get("status") or {}
        for kind, key in (("init ", "initContainerStatuses"), ("", "containerStatuses")):
            for cs in st.get(key) or []:
                found = _one(meta.get("name", "?"), cs, kind)
                if found:
                    return found
    for p in _live(pods):
        if (c := _unschedulable(p)) is not None:
            return f"pod {p['metadata'].get('name', '?')}: Unschedulable ({(c.get('message') or '').strip()})"
    return None


def _unschedulable(pod: dict) -> dict | None:
    """The pod's PodScheduled condition when the scheduler found no node for it, else None."""
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"
                 and c.get("status") == "False" and c.get("reason") == "Unschedulable"), None)


def starting(pods: list[dict]) -> bool:
    """Some pod is on its way up but not ready: being scheduled, its containers being created, loading, or
    failing. None of that changes a field of the Deployment the operator watches (its status counts the pod from
    its creation and moves again only when it is ready), so the operator looks again until it is ready. A pod the
    scheduler has found no node for does not count (engine_trouble names it; waiting on it is the scheduler's).

    (It did not count pods without container statuses, on the belief that the Deployment's status moves when they
    start: on the real node a pod created after the operator's pass then went unlooked-at until the resync,
    "0/1 engine pods ready" for five minutes while its engine crashed.)"""
    for p in _live(pods):
        st = p.get("status") or {}
        statuses = (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or [])
        if not statuses:
            if _unschedulable(p) is None:
                return True
            continue
        if not all(cs.get("ready") or ((cs.get("state") or {}).get("terminated") or {}).get("exitCode") == 0
                   for cs in statuses):
            return True
    return False


def creating(pods: list[dict]) -> list[str]:
    """Pods scheduled whose containers still wait to be created (the kubelet mounts the volumes first): the pods a
    FailedMount can be holding up. Their statuses say only "ContainerCreating"; the why is in Events."""
    out = []
    for p in _live(pods):
        st = p.get("status") or {}
        statuses = (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or [])
        if any(((cs.get("state") or {}).get("waiting") or {}).get("reason") in ("ContainerCreating", "PodInitializing")
               for cs in statuses):
            out.append((p.get("metadata") or {}).get("name", "?"))
    return out


def mount_trouble(pods: list[dict], events: list[dict]) -> str | None:
    """The kubelet's latest FailedMount of a pod still waiting to create its containers (a missing Secret,
    ConfigMap or claim), as one line; None when there is none. Events of a pod that has since started are old news
    and ignored."""
    waiting = set(creating(pods))
    found = [e for e in events if e.get("reason") == "FailedMount"
             and (e.get("involvedObject") or {}).get("name") in waiting]
    if not found:
        return None
    last = max(found, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    message = " ".join((last.get("message") or "").split())[:MAX_MESSAGE]
    return f"pod {last['involvedObject']['name']}: FailedMount ({message})"

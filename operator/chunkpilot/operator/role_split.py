"""Disaggregation mode auto: which pod serves in which role. The pods of one Deployment all run --live-roles; the
operator keeps `prefill` of the ready ones in the prefill role and the rest in the decode role, switching as few as
it can, and a switch is a knobs push (the engine changes its role at its next step, no restart) followed by the
pod's role labels (the Services follow them: the client Service selects decode pods, the prefill pods' headless
Service the prefill ones). Pure: the reconciler pushes and labels."""

from __future__ import annotations

from collections.abc import Iterable

from chunkpilot.contract.engine_settings import LIVE_ROLES

PREFILL, DECODE = LIVE_ROLES


def split_roles(pods: Iterable[tuple[str, str | None, str | None]], prefill: int) -> dict[str, str]:
    """`pods`: (name, the role its label says, when its engine started: RFC 3339) of every ready pod; `prefill`: how
    many should be prefill pods. Returns each pod's role. At most all pods but one are prefill pods (a client
    Service with no pod would serve no one). Pods keep their role where they can; a pod without a known role (its
    label removed) counts as decode, the role a new pod starts in. The pods that switch are the newest of their
    role (then by name, so that two passes over the same pods agree): a new pod has the fewest streams in flight
    and the coldest prefix cache, so moving it costs the clients least."""
    pods = list(pods)
    current = {name: role if role in LIVE_ROLES else DECODE for name, role, _ in pods}
    newest_first = [name for name, _, _ in sorted(pods, key=lambda p: (p[2] or "", p[0]), reverse=True)]
    want = max(0, min(prefill, len(current) - 1))
    prefill_now = [n for n in newest_first if current[n] == PREFILL]
    decode_now = [n for n in newest_first if current[n] == DECODE]
    out = dict(current)
    for name in prefill_now[:max(0, len(prefill_now) - want)]:  # too many prefill pods: serve clients again
        out[name] = DECODE
    for name in decode_now[:max(0, want - len(prefill_now))]:  # too few
        out[name] = PREFILL
    return out

"""Status conditions as both controllers keep them: each replaces only the condition types it owns (the operator
Ready, Progressing and Degraded; the tuner Tuning, Autoscaling and SLOMet: api.types.ConditionType), so neither
wipes the other's, and a condition keeps its lastTransitionTime while its status stays the same (the Kubernetes
convention)."""

from __future__ import annotations

import datetime

from chunkpilot.api.types import Condition, ConditionType

# The order status.conditions are kept in; a type not named here (Autoscaling) sorts after them.
ORDER = (ConditionType.READY, ConditionType.PROGRESSING, ConditionType.DEGRADED, ConditionType.TUNING,
         ConditionType.SLO_MET)


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def dump_condition(cond: Condition) -> dict:
    return cond.model_dump(by_alias=True, exclude_none=True)


def merge_conditions(old: list[dict], new: list[Condition], now: str, family: str | None = None) -> list[dict]:
    """`old` as read from the resource, with the types in `new` replaced; the result as the API wants it. Types
    beginning with `family` are the writer's whole set of that family: when `new` carries any, those not in `new`
    are dropped (the tuner's SLOMet.<class> of a class that no longer exists)."""
    by_type = {c.get("type"): c for c in old or []}
    replaced = {n.type for n in new}
    # the family is replaced as a whole only by a write that carries it (a write of Tuning alone keeps it)
    family = family if family and any(t.startswith(family) for t in replaced) else None
    out = [c for c in old or [] if c.get("type") not in replaced
           and not (family and str(c.get("type", "")).startswith(family))]
    for cond in new:
        prev = by_type.get(cond.type)
        same = prev is not None and prev.get("status") == cond.status and prev.get("lastTransitionTime")
        out.append(dump_condition(cond.model_copy(update={"last_transition_time":
                                                          prev["lastTransitionTime"] if same else now})))
    order = {t: i for i, t in enumerate(ORDER)}
    return sorted(out, key=lambda c: order.get(c.get("type"), 99))


def condition(status: dict, type_: str) -> dict | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == type_), None)

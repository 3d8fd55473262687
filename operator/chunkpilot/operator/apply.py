"""Pure decisions for applying one desired object: create it, apply it, or leave it alone.

A child is (re)applied when what we want of it changed (a hash of the desired object, kept in an annotation on the
child) or when someone changed a field we set (drift: the desired object is no longer a subset of the live one; the
API server adds defaults, so "subset" and not "equal"). Everything else is a no-op, so a reconcile that finds the
cluster as wanted sends no writes at all."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from chunkpilot.api.types import GROUP

APPLIED_HASH = f"{GROUP}/applied-hash"
FIELD_MANAGER = "chunkpilot-operator"

Action = Literal["create", "apply", "none"]


def desired_hash(desired: dict) -> str:
    return hashlib.sha256(json.dumps(desired, sort_keys=True).encode()).hexdigest()[:16]


def with_hash(desired: dict) -> dict:
    """The desired object with its own hash in an annotation (hashed before the annotation is added)."""
    digest = desired_hash(desired)
    meta = dict(desired["metadata"])
    meta["annotations"] = {**meta.get("annotations", {}), APPLIED_HASH: digest}
    return {**desired, "metadata": meta}


def _scalar_eq(want: Any, have: Any) -> bool:
    if want == have:
        return True
    # The API server returns int-or-string fields and quantities in its own spelling ("1" vs 1).
    if isinstance(want, (int, float, str)) and isinstance(have, (int, float, str)) and not isinstance(want, bool):
        return str(want) == str(have)
    return False


def is_subset(want: Any, have: Any) -> bool:
    """Every field of `want` is in `have` with the same value; lists match element by element."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and is_subset(v, have[k]) for k, v in want.items()
                                              if v not in (None, {}, []) or k in have)
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(is_subset(w, h) for w, h in zip(want, have))
    return _scalar_eq(want, have)


def plan(desired: dict, current: dict | None) -> Action:
    if current is None:
        return "create"
    want = with_hash(desired)
    have_hash = (current.get("metadata", {}).get("annotations") or {}).get(APPLIED_HASH)
    if have_hash != want["metadata"]["annotations"][APPLIED_HASH]:
        return "apply"
    fields = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "status")}
    return "none" if is_subset(fields, current) else "apply"


def describe(obj: dict) -> str:
    return f"{obj['kind']} {obj['metadata']['name']}"

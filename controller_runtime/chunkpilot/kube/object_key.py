"""The key of a namespaced object, (namespace, name): what the operator's work queue holds, what the tuner keeps one
thread per, and what both remember things by. Read from a metadata dict in one place, so every reader agrees on
the namespace an object without one is in."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

# The namespace of an object whose metadata names none, as kubectl reads a manifest.
DEFAULT_NAMESPACE = "default"


class ObjectKey(NamedTuple):
    """A tuple, so it unpacks into the (namespace, name) arguments of the client and hashes like the pair."""

    namespace: str
    name: str

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "ObjectKey":
        """The key of the object with this metadata."""
        return cls(meta.get("namespace", DEFAULT_NAMESPACE), meta["name"])

    @classmethod
    def of_owner(cls, meta: Mapping[str, Any], ref: Mapping[str, Any]) -> "ObjectKey":
        """The key of an object's owner from one of its ownerReferences: a namespaced owner is in its child's
        namespace (Kubernetes allows no other)."""
        return cls(meta.get("namespace", DEFAULT_NAMESPACE), ref["name"])

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"

"""What the cluster admin allows InferenceDeployment authors to ask for. The operator creates pods with its own
rights, so without these rules anyone who may create an InferenceDeployment could mount any node directory
(`hostpath:///`), run any image, and schedule onto any tainted node or priority: things the Pod Security rules of
their namespace would have refused them. Defaults are closed where a spec could reach node files or other
tenants' capacity: no host paths, no priority classes, only the GPU taint tolerated, only the engine image."""

from __future__ import annotations

from dataclasses import dataclass

from chunkpilot.api.types import InferenceDeploymentSpec

ANY = "*"


class PolicyError(ValueError):
    """The spec asks for something the operator's settings do not allow; the message names the setting."""


@dataclass(frozen=True)
class Policy:
    # Host directories `hostpath://` sources may name: a prefix allows itself and everything below it.
    allowed_host_paths: tuple[str, ...] = ()
    # Image prefixes (registry/repository) `spec.engine.image` may use; None = the operator's engine image's
    # own repository, at any tag; "*" = any image.
    allowed_image_prefixes: tuple[str, ...] | None = None
    allowed_priority_classes: tuple[str, ...] = ()
    # Toleration keys; "*" allows any, including a key-less toleration (which tolerates every taint).
    allowed_toleration_keys: tuple[str, ...] = ("nvidia.com/gpu",)


def _repository(image: str) -> str:
    name = image.split("@", 1)[0]
    head, _, tail = name.rpartition(":")
    return head if head and "/" not in tail else name  # "host:5000/repo" has a port, not a tag


def image_prefixes(policy: Policy, engine_image: str) -> tuple[str, ...]:
    if policy.allowed_image_prefixes is not None:
        return policy.allowed_image_prefixes
    repo = _repository(engine_image)
    return (f"{repo}:", f"{repo}@")


def image_allowed(image: str, prefix: str) -> bool:
    """A prefix ends at a boundary: "registry.corp/ml" allows "registry.corp/ml:1" and "registry.corp/ml/x", not
    "registry.corp/ml-untrusted"."""
    if not image.startswith(prefix):
        return False
    return prefix[-1:] in ("/", ":", "@") or len(image) == len(prefix) or image[len(prefix)] in "/:@"


def host_path_canonical(path: str) -> bool:
    """No empty, '.' or '..' segments: the path the kubelet mounts is the one judged (the admission rule tests the
    same substrings, so both sides agree on every spelling)."""
    return not ("//" in path or "/./" in path or "/../" in path or path.endswith(("/.", "/..")))


def host_path_under(path: str, prefix: str) -> bool:
    """`prefix` allows itself and everything below it, with or without a trailing slash on either."""
    return prefix == "/" or path == prefix or path + "/" == prefix or \
        path.startswith(prefix if prefix.endswith("/") else prefix + "/")


def check(spec: InferenceDeploymentSpec, policy: Policy, engine_image: str) -> None:
    sources = [("spec.model.source", spec.model.source)]
    if spec.engine.speculative is not None and spec.engine.speculative.draft_model:
        sources.append(("spec.engine.speculative.draftModel", spec.engine.speculative.draft_model))
    for field_, src in sources:
        if not src.startswith("hostpath://"):
            continue
        path = src.removeprefix("hostpath://")  # what the pod mounts (the CRD's pattern makes it start with /)
        if not host_path_canonical(path):
            raise PolicyError(f"{field_} {src!r}: a host path must be canonical (no '//', '.' or '..' "
                              "segments); write it as the directory's plain path")
        if not any(host_path_under(path, p) for p in policy.allowed_host_paths):
            allowed = ", ".join(policy.allowed_host_paths) or "none"
            raise PolicyError(f"{field_} {src!r}: host path {path} is not allowed (allowed prefixes: "
                              f"{allowed}); use a pvc:// source, or ask the cluster admin to allow it with the "
                              "operator's --allowed-host-path (chart: operator.policy.allowedHostPaths)")
    image = spec.engine.image
    prefixes = image_prefixes(policy, engine_image)
    if image and ANY not in prefixes and not any(image_allowed(image, p) for p in prefixes):
        raise PolicyError(f"spec.engine.image {image!r} is not allowed (allowed prefixes: {', '.join(prefixes)}); "
                          "leave it unset for the default engine image, or ask the cluster admin to allow it with "
                          "--allowed-image-prefix (chart: operator.policy.allowedImagePrefixes)")
    pc = spec.engine.priority_class_name
    if pc and ANY not in policy.allowed_priority_classes and pc not in policy.allowed_priority_classes:
        raise PolicyError(f"spec.engine.priorityClassName {pc!r} is not allowed (allowed: "
                          f"{', '.join(policy.allowed_priority_classes) or 'none'}); remove it, or ask the cluster "
                          "admin to allow it with --allowed-priority-class (chart: "
                          "operator.policy.allowedPriorityClasses)")
    keys = policy.allowed_toleration_keys
    for i, t in enumerate(spec.engine.tolerations):
        key = t.get("key")
        if ANY not in keys and (not key or key not in keys):
            what = f"key {key!r}" if key else "no key (it tolerates every taint)"
            raise PolicyError(f"spec.engine.tolerations[{i}] has {what}, which is not allowed (allowed keys: "
                              f"{', '.join(keys) or 'none'}); remove it, or ask the cluster admin to allow it with "
                              "--allowed-toleration-key (chart: operator.policy.allowedTolerationKeys)")

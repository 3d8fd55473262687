"""Which SLO class a request is served in (docs/slo-classes.md): a header (chunkpilot's own, or the Gateway API
Inference Extension's objective as a gateway passes it on), else OpenAI's `service_tier`, else the deployment's
default class; never above the class its API key carries. A class nobody defined is a 400 naming the classes;
a class above the key's is a 403. Without classes (one implicit class) nothing is read: today's behaviour."""

from __future__ import annotations

from collections.abc import Mapping

from chunkpilot.contract.slo import CLASS_HEADERS, DEFAULT_TIERS, SLOClass, SLOClasses
from chunkpilot.engine.serving.api_error import ApiError


def choose(classes: SLOClasses | None, headers: Mapping[str, str], service_tier: str | None,
           ceiling: str | None) -> SLOClass | None:
    """The request's class; None where the deployment has no classes. `headers` as Starlette's (any case);
    `ceiling`: the highest class the caller's API key may ask for (None: any)."""
    if classes is None or classes.is_implicit:
        return None
    asked, where = None, None
    for name in CLASS_HEADERS:
        if headers.get(name):
            asked, where = headers[name].strip(), f"header {name}"
            break
    if asked is None and service_tier and service_tier not in DEFAULT_TIERS:
        asked, where = service_tier, "service_tier"
    chosen = classes.get(asked) if asked is not None else classes.get(classes.default)
    if chosen is None:
        raise ApiError(400, f"SLO class {asked!r} ({where}) is not defined here; the classes are "
                            f"{', '.join(classes.names)} (default {classes.default})", "invalid_request_error",
                       param="service_tier" if where == "service_tier" else None, code="unknown_slo_class")
    top = classes.get(ceiling) if ceiling is not None else None
    if top is not None and chosen.priority > top.priority:
        if asked is None:  # the default is above this key's ceiling: the key's own class, not an error
            return top
        raise ApiError(403, f"this API key may ask for SLO class {top.name!r} or below (priority {top.priority}); "
                            f"{chosen.name!r} has priority {chosen.priority}", "permission_error",
                       code="slo_class_not_allowed")
    return chosen

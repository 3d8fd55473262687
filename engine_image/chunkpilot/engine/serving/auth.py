"""API keys on /v1/* (and the prefill role's /kv/*), and the tenant each key stands for.

A plain ASGI middleware on purpose: Starlette's BaseHTTPMiddleware (`@app.middleware("http")`) wraps `receive`,
and then `request.is_disconnected()` never sees a client leave, so queued requests of vanished clients would not
be aborted.
"""

from __future__ import annotations

import hashlib
import hmac

from chunkpilot.engine.serving.api_error import ApiError

TENANT = "chunkpilot_tenant"  # key in the ASGI scope's "state" (request.state) holding the caller's cache salt


CEILING = "chunkpilot_slo_ceiling"  # key in the ASGI scope's "state": the highest SLO class the caller's key may ask


def parse_api_keys(value: str | None) -> tuple[str, ...]:
    """`--api-key` / CHUNKPILOT_API_KEY: one key, or several separated by commas (one per tenant); a key may end
    in `:CLASS`, the highest SLO class it may ask for (parse_key_ceilings), which is not part of the key."""
    keys = tuple(k.strip().split(":", 1)[0].strip() for k in (value or "").split(",") if k.strip())
    if len(set(keys)) != len(keys):
        raise ValueError("the API keys must be distinct: each one names a tenant")
    if not all(keys):
        raise ValueError("an API key is empty (a `:CLASS` suffix needs a key before it)")
    return keys


def parse_key_ceilings(value: str | None) -> dict[str, str]:
    """Each `KEY:CLASS` of `--api-key`: the key and the highest SLO class it may ask for."""
    out = {}
    for item in (value or "").split(","):
        key, sep, ceiling = item.strip().partition(":")
        if sep:
            if not ceiling.strip():
                raise ValueError("an API key ends in ':' without an SLO class; write KEY:CLASS or just KEY")
            out[key.strip()] = ceiling.strip()
    return out


def tenant_salt(key: str) -> bytes:
    # A digest, not the key: the salt sits in every prefix-cache hash and must not spell the secret.
    return hashlib.sha256(b"chunkpilot-tenant:" + key.encode()).digest()[:16]


class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` with any of the keys. With several keys, each request carries its key's
    salt, so tenants never share prefix-cache blocks and `cached_tokens` tells nobody about another tenant's
    prompts. With one key every caller is the same tenant."""

    def __init__(self, app, keys: tuple[str, ...], ceilings: dict[str, str] | None = None) -> None:
        self.app = app
        ceilings = ceilings or {}
        self.keys = [(k.encode(), tenant_salt(k) if len(keys) > 1 else b"", ceilings.get(k)) for k in keys]

    async def __call__(self, scope, receive, send) -> None:
        # /kv/* too: a prefill pod computes prompts for whoever calls it, under the caller's tenant
        if scope["type"] == "http" and scope["path"].startswith(("/v1/", "/kv/")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given.lower().startswith(b"bearer ") else b""
            # compare with every key, so the time taken says nothing about which one nearly matched
            matches = [(salt, ceiling) for key, salt, ceiling in self.keys if hmac.compare_digest(token, key)]
            if not matches:
                response = ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                                    "authentication_error", code="invalid_api_key").response()
                await response(scope, receive, send)
                return
            state = scope.setdefault("state", {})
            state[TENANT], state[CEILING] = matches[0]
        await self.app(scope, receive, send)
